"""The plan of `run` tool calls for the parts prepared: printed by ``prepare`` and kept in the doc's how-to-run
section (between its markers), which every generated ``gpu-verification.md`` carries along."""

from __future__ import annotations

import subprocess

from .layout import CALL_LIMIT, DOC, REPO, MiB, part_dir
from .report import HOW_TO_RUN
from .steps import GPU_DECODE_SELECTION

BUDGET = 480  # seconds of steps per call: the tool stops a command at 600 s; install and the report fit the rest
COMMAND = f"benchmarks/gpu_check.sh install; benchmarks/gpu_check.sh run --budget {BUDGET}"
#: issue 48's check alone (GPU decode: the expert forms, CUDA graphs, fpA_intB, the torch.compile peer, the kernel
#: under CUDA-graph timing): its steps after ``install`` are sized for one call of under 8 minutes
DECODE_BUDGET = 450
DECODE_COMMAND = (f"benchmarks/gpu_check.sh install; benchmarks/gpu_check.sh run --budget {DECODE_BUDGET} "
                  f"--steps {GPU_DECODE_SELECTION}")


def tree_bytes() -> int:
    """The bytes of the working tree that every call sends (tracked files and untracked ones git does not ignore)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.split(b"\0")
    paths = [REPO / p.decode() for p in listed if p]
    return sum(p.stat().st_size for p in paths if p.is_file())


def calls(manifest: dict) -> list[tuple[str, int]]:
    """(carry folder, bytes) of each call that carries a part."""
    sizes: dict[str, int] = {}
    for entry in manifest["packed"]["parts"] + manifest["wheels"]:
        folder = entry["file"].split("/")[0]
        sizes[folder] = sizes.get(folder, 0) + entry["bytes"]
    return sorted(sizes.items(), key=lambda kv: int(kv[0].split("-")[1]))


def markdown(manifest: dict, tree: int) -> str:
    """The how-to-run section for ``manifest``'s parts and a working tree of ``tree`` bytes."""
    packed, versions = manifest["packed"], manifest["versions"]
    parts = calls(manifest)
    rows = [f"| {i + 1} | `[\"{(part_dir(i).relative_to(REPO))}\"]` | `{COMMAND}` | {size / MiB:.1f} MiB |"
            for i, (_, size) in enumerate(parts)]
    over = [i + 1 for i, (_, size) in enumerate(parts) if size + tree > CALL_LIMIT]
    warning = f"\n**Calls {over} would exceed 64 MiB with this tree: prepare again.**\n" if over else ""
    return f"""{HOW_TO_RUN[0]}
## How to run

The GPU machine (one H100/H200, CUDA 13, Python 3.12, torch 2.11+cu130, triton; no network, no TensorRT) is
reached only through the `run` tool, which sends the working tree plus the paths named in `carry`, at most 64 MiB
a call. What its image lacks is carried as wheels: onnxruntime-gpu {versions['onnxruntime-gpu']} (its PyPI wheel
is built for CUDA 13.0, the CUDA major of torch's cu130 libraries there) and polygraphy {versions['polygraphy']}.
Everything else the project needs is in the image.

1. Here, once, in the checkout the `run` tool sends: `benchmarks/gpu_check.sh prepare`. It downloads the wheels for
   CPython 3.12 manylinux x86_64 into `.whl/downloads/`, rewrites onnxruntime-gpu's wheel uncompressed
   ({packed['stored_bytes'] / MiB:.0f} MiB), compresses it with xz ({packed['xz_bytes'] / MiB:.1f} MiB) and
   splits that into {len(packed['parts'])} parts, `.whl/gpu-check/part-0` to `part-{len(packed['parts']) - 1}`
   (polygraphy rides in part 0; each part folder holds the manifest with every sha256). The first time takes
   about 10 minutes of one core; a checkout's `.whl/` copied from another where it was prepared is checked and
   reused. `.whl/` is ignored by git: nothing of it is committed.
2. The calls, back to back: a machine idle for 30 s is given back with the parts sent so far (`install` then
   names the missing ones: carry them again). Every call runs the same command, timeout_s 600; the working
   tree ({tree / MiB:.1f} MiB when this was written) travels with each.

| call | `carry` | `command` | carried |
|---|---|---|---|
{chr(10).join(rows)}
| {len(parts) + 1}, {len(parts) + 2}, ... | none | `{COMMAND}` | |
{warning}
`install` joins and installs the parts into `build/gpu-check/site` once all are there (exit 3 until then).
`run` goes on from the records of the earlier calls (kept in `build/gpu-check/` while the machine stays warm):
the kernel tests and benchmark first, then the exports, then, once installed, the steps on ONNX Runtime's CUDA
provider; a step that does not fit the call's {BUDGET} s is left PENDING for the next call. Each call writes
`gpu-verification.md`, `steps.json` and `logs.tar.gz` into `$OUT`. Repeat the command while it exits 2 (steps
pending); then 0 means every step passed (or was skipped, with the reason) and 1 that a step failed (the others
still ran). Commit the last call's `gpu-verification.md` as `docs/gpu-verification.md`.

Issue 48's GPU decode check alone: the same calls with the command `{DECODE_COMMAND}`. While the parts travel,
the calls run what needs no onnxruntime-gpu (the device, both exports, the kernel bench under CUDA-graph timing);
the call after `install` runs the rest (the CUDA provider's load, the branches form profiled, the fused form
validated and timed with and without CUDA graphs and fpA_intB, the torch.compile peer, the CUDA engine's GPU tests)
within {DECODE_BUDGET} s.

Elsewhere: `benchmarks/gpu_check.sh run` on any GPU machine with the packages (all steps, no budget);
`benchmarks/gpu_check.sh run --dry-run [--models tiny] [--precisions fp16] [--out DIR]` on the CPU, which skips the
GPU steps and runs the pipeline on ONNX Runtime's CPU provider (bf16 skipped: no bf16 kernels there);
`benchmarks/gpu_check.sh run --list` prints the steps.
{HOW_TO_RUN[1]}"""


def update_doc(section: str) -> None:
    """Replace the how-to-run section of docs/gpu-verification.md (between its markers) with ``section``."""
    text = DOC.read_text()
    start, end = text.find(HOW_TO_RUN[0]), text.find(HOW_TO_RUN[1])
    if start < 0 or end < 0:
        raise SystemExit(f"{DOC} has no {HOW_TO_RUN[0]} ... {HOW_TO_RUN[1]} section to replace")
    DOC.write_text(text[:start] + section + text[end + len(HOW_TO_RUN[1]):])


def show(manifest: dict, write: bool) -> int:
    section = markdown(manifest, tree_bytes())
    print(section)
    if write:
        update_doc(section)
        print(f"(written into {DOC.relative_to(REPO)})")
    return 0
