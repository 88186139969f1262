"""The steps of the GPU check, as data: what each runs, whether it needs the GPU, what it waits for.

A step is one command whose output goes to ``logs/NAME.log`` and whose outcome goes to ``records/NAME.json`` in
the work folder. :func:`plan` lists them in the order they run; :mod:`.runner` runs them.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from .layout import REPO, Work

DECODE_CONTEXTS = "0,1024,4096"
DECODE_BATCHES = "1,32"
#: the kernel benchmark's grid: bench.py's own plus the issue's target points (batch >= 32, context >= 4096)
BENCH_GRID = ("--batch", "1", "8", "32", "64", "--heads", "16", "128", "--lengths", "1024", "4096", "8192", "32768")
TINY_BF16 = ("the tiny preset's random weights (init_std 0.3) put bf16 up to 1.2 off even in PyTorch "
             "(docs/validation.md): a failure is expected")
NO_BF16_ON_CPU = "ONNX Runtime's CPU provider has no bf16 kernels (the CLI refuses bf16 there): runs on the GPU only"


@dataclass(frozen=True)
class Model:
    """A model the pipeline steps export and run."""

    key: str
    export_args: tuple[str, ...]
    export_timeout: int
    validate_timeout: int


MODELS = {
    "tiny": Model("tiny", ("--preset", "tiny"), 300, 300),
    # 4 decoder layers of DeepSeek-V2-Lite (1 dense + 3 MoE of 64 experts), int4 weights in blocks of 32; a static
    # cache of 4096 + 256 rows holds the decode timing's longest context
    "v2lite4-int4": Model("v2lite4-int4", ("--preset", "deepseek-v2-lite", "--layers", "4", "--weights", "int4",
                                           "--max-cache-length", "4352"), 540, 540),
}
PRECISIONS = ("fp16", "bf16")


@dataclass(frozen=True)
class Step:
    """One command of the check.

    Attributes:
        group: ``env``, ``kernel``, ``export``, ``ort`` or ``decode`` (``--steps`` takes groups or names).
        argv: the command; run in the repository root.
        timeout: seconds before it is stopped (recorded as TIMEOUT).
        gpu: needs the GPU: ``--dry-run`` skips it.
        after: steps that must have passed first.
        needs_ort: needs onnxruntime and polygraphy (on the GPU machine: onnxruntime-gpu, from ``install``).
        skip: why it does not run in this mode (None: it runs).
        expect_fail: why a failure is expected: recorded as XFAIL (and a pass as XPASS), not counted as a failure.
        fail_on_skip: pytest: a skipped test fails the step (the GPU tests skip where torch sees no GPU).
        kind: which figures the report reads from its log.
    """

    name: str
    group: str
    argv: tuple[str, ...]
    timeout: int
    gpu: bool = False
    after: tuple[str, ...] = ()
    needs_ort: bool = False
    skip: str | None = None
    expect_fail: str | None = None
    fail_on_skip: bool = False
    kind: str = ""


@dataclass(frozen=True)
class Options:
    """What ``run`` was asked for."""

    work: Work
    dry_run: bool = False
    models: tuple[str, ...] = tuple(MODELS)
    precisions: tuple[str, ...] = PRECISIONS
    bench_has_provider: bool = False
    python: str = sys.executable

    @property
    def provider(self) -> str:
        return "cpu" if self.dry_run else "cuda"


def _mla(options: Options, *args: str) -> tuple[str, ...]:
    return (options.python, "-m", "mla_deploy", *args)


def _probe(options: Options, *args: str) -> tuple[str, ...]:
    return (options.python, "-m", "gpu_check.probes", *args)


def gpu_test_files(repo: Path = REPO) -> tuple[str, ...]:
    """The test files holding ``gpu``-marked tests (only these are collected: the rest may need packages the GPU
    machine lacks, and a collection error would fail the step), less the TensorRT modules (``pytest.mark.trt`` on
    the whole module): TensorRT cannot be installed there, so they skip as a whole at collection, which the
    deselection by marker cannot prevent, and a skip fails the step."""
    files = []
    for path in sorted((repo / "tests").rglob("test_*.py")):
        text = path.read_text()
        if "mark.gpu" in text and not re.search(r"^pytestmark = .*mark\.trt", text, re.M):
            files.append(str(path.relative_to(repo)))
    return tuple(files)


def env_steps(options: Options) -> list[Step]:
    smi = "nvidia-smi && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv"
    return [Step("nvidia-smi", "env", ("bash", "-c", smi), 60, gpu=True, kind="nvidia-smi"),
            Step("versions", "env", _probe(options, "versions"), 300, kind="versions")]


def kernel_steps(options: Options) -> list[Step]:
    pytest = (options.python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider")
    # TensorRT cannot be installed there: its tests would only skip
    return [Step("kernel-tests", "kernel", (*pytest, "-m", "gpu and not trt", *gpu_test_files()), 540, gpu=True,
                 fail_on_skip=True, kind="pytest"),
            Step("plugin-tests", "kernel", (*pytest, "-m", "not gpu and not trt", "tests/plugins"), 540, gpu=True,
                 kind="pytest"),
            Step("kernel-bench", "kernel", (options.python, "plugins/mla_decode/bench.py", *BENCH_GRID), 540, gpu=True,
                 kind="kernel-bench")]


def artifact(options: Options, model: str, precision: str) -> Path:
    return options.work.artifacts / f"{model}-{precision}"


def export_steps(options: Options) -> list[Step]:
    return [Step(f"export-{m}-{p}", "export",
                 _mla(options, "export", *MODELS[m].export_args, "--precision", p, "--cache-mode", "static", "--out",
                      str(artifact(options, m, p)), "--overwrite", "--quiet"), MODELS[m].export_timeout, kind="export")
            for m in options.models for p in options.precisions]


def pipeline_steps(options: Options, model: str, precision: str) -> list[Step]:
    """run, the in-place cache check and validate of one export on the provider (cuda; cpu in a dry run)."""
    path, provider, key = str(artifact(options, model, precision)), options.provider, f"{model}-{precision}"
    skip = NO_BF16_ON_CPU if options.dry_run and precision == "bf16" else None
    common = dict(after=(f"export-{key}",), needs_ort=True, skip=skip)
    prompts = ("--prompt-ids", "1,2,3,4,5,6,7", "--prompt-ids", "9,8")
    return [Step(f"run-{key}", "ort", _mla(options, "run", path, *prompts, "--max-new-tokens", "16", "--provider",
                                           provider, "--json"), 300, kind="run", **common),
            Step(f"static-{key}", "ort", _probe(options, "static", path, "--provider", provider), 300, kind="static",
                 **common),
            Step(f"validate-{key}", "ort", _mla(options, "validate", path, "--provider", provider, "--out",
                                                str(options.work.root / "validate" / key), "--quiet"),
                 MODELS[model].validate_timeout, kind="validate",
                 expect_fail=TINY_BF16 if key == "tiny-bf16" else None, **common)]


def ort_steps(options: Options) -> list[Step]:
    load = Step("ort-cuda-load", "ort", _probe(options, "cuda-load", "--env-file", str(options.work.env_file)), 600,
                gpu=True, needs_ort=True, kind="cuda-load")
    doctor = Step("doctor", "ort", _mla(options, "doctor", "--json"), 300, needs_ort=True, kind="doctor")
    pipeline = [s for m in options.models for p in options.precisions for s in pipeline_steps(options, m, p)]
    return [load, doctor, *pipeline]


def decode_steps(options: Options) -> list[Step]:
    """Whole-model decode ms/token of the 4-layer V2-Lite int4 export on the GPU."""
    if "v2lite4-int4" not in options.models:
        return []
    bench_skip = None if options.bench_has_provider else (
        "`mla-deploy bench model` has no --provider option: it times ONNX Runtime on the CPU only, so "
        "transformers beside ONNX Runtime's CUDA provider on the same GPU is not measured")
    bench = Step("bench-whole", "decode",
                 _mla(options, "bench", "model", *MODELS["v2lite4-int4"].export_args[:4], "--weights", "int4",
                      "--context", DECODE_CONTEXTS, "--batch", DECODE_BATCHES, "--provider", "cuda", "--out",
                      str(options.work.root / "bench-whole")), 540, gpu=True, needs_ort=True, skip=bench_skip,
                 kind="bench-whole")
    timing = [Step(f"decode-{p}", "decode",
                   _probe(options, "decode", str(artifact(options, "v2lite4-int4", p)), "--provider", "cuda",
                          "--contexts", DECODE_CONTEXTS, "--batch", DECODE_BATCHES), 540, gpu=True, needs_ort=True,
                   after=(f"export-v2lite4-int4-{p}",), kind="decode")
              for p in options.precisions]
    return [bench, *timing]


def plan(options: Options) -> list[Step]:
    """Every step, in the order it runs."""
    return [*env_steps(options), *kernel_steps(options), *export_steps(options), *ort_steps(options),
            *decode_steps(options)]


GROUPS = ("env", "kernel", "export", "ort", "decode")
