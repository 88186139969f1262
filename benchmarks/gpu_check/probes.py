"""Checks that no ``mla-deploy`` command makes, run by the GPU check in processes of their own.

    python -m gpu_check.probes versions
    python -m gpu_check.probes cuda-load --env-file FILE
    python -m gpu_check.probes static ARTIFACT --provider cuda
    python -m gpu_check.probes decode ARTIFACT --provider cuda --contexts 0,1024,4096 --batch 1,32 [--new-tokens 32]

Each prints what it found and ends with one line ``RESULT <json>`` that the report reads; the exit status is 0
when the check holds. They use mla-deploy's public API only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

#: distributions whose versions are read from their metadata (found along sys.path, so a carried one first);
#: torch and onnxruntime are imported instead, for their CUDA facts and because the image's CPU onnxruntime
#: and the carried onnxruntime-gpu install the same module
DISTRIBUTIONS = ("triton", "onnx", "onnxscript", "onnx-ir", "polygraphy", "transformers", "numpy", "tokenizers",
                 "safetensors", "click", "pytest")


def result(payload: dict) -> None:
    print("RESULT " + json.dumps(payload), flush=True)


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _torch_facts() -> dict:
    import torch

    facts = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if facts["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        facts.update(gpu=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                     memory_gib=round(props.total_memory / 2**30, 1), cudnn=torch.backends.cudnn.version())
    return facts


def _onnxruntime_facts() -> dict:
    try:
        import onnxruntime
        from onnxruntime.capi import build_and_package_info as info
    except Exception as exc:
        return {"onnxruntime_error": str(exc)[:200]}
    return {"onnxruntime": onnxruntime.__version__, "onnxruntime_package": info.package_name, "onnxruntime_cuda": getattr(info, "cuda_version", None),
            "onnxruntime_file": onnxruntime.__file__, "onnxruntime_providers": onnxruntime.get_available_providers()}


def versions() -> int:
    """Python, the packages the checks use, torch's CUDA and GPU, which onnxruntime build is imported."""
    facts = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    facts.update(_torch_facts())
    facts.update({name: _version(name) for name in DISTRIBUTIONS})
    facts.update(_onnxruntime_facts())
    for key, value in facts.items():
        print(f"{key}: {value}")
    result(facts)
    return 0


def nvidia_lib_dirs() -> list[str]:
    """The folders of the CUDA libraries that the ``nvidia-*`` wheels (installed with torch) hold."""
    try:
        import nvidia  # the namespace package of the nvidia-* wheels
    except ImportError:
        return []
    return sorted({str(lib.parent) for root in nvidia.__path__ for lib in Path(root).rglob("lib*.so*")})


PROBE = ("import json; {first}from mla_deploy.doctor import probe_providers; "
         "print(json.dumps(probe_providers()['loaded'].get('CUDAExecutionProvider')))")


def _probe(first: str, env: dict) -> dict:
    """Whether a session on ONNX Runtime's CUDA provider loads in a fresh interpreter (mla-deploy doctor's probe)."""
    proc = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], capture_output=True, text=True, env=env,
                          timeout=300)
    lines = proc.stdout.strip().splitlines()
    try:
        found = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        found = None
    if not isinstance(found, dict):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"ok": False, "reason": f"probe failed (exit {proc.returncode}): {tail[:200]}"}
    return {"ok": bool(found.get("ok")), "reason": found.get("reason")}


def cuda_load(env_file: Path) -> int:
    """Does ONNX Runtime's CUDA provider load as `mla-deploy run` opens it (no torch imported), after ``import
    torch``, and with ``LD_LIBRARY_PATH`` naming the nvidia wheels' libraries? Where only the last works, it is
    written to ``env_file`` for the later steps."""
    dirs = nvidia_lib_dirs()
    library_path = ":".join(dirs + [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p])
    ways = {"plain (as `mla-deploy run` opens it)": _probe("", dict(os.environ)),
            "after `import torch`": _probe("import torch; ", dict(os.environ)),
            "with LD_LIBRARY_PATH = the nvidia wheels' lib folders": _probe("", {**os.environ,
                                                                                 "LD_LIBRARY_PATH": library_path})}
    plain, _, with_path = ways.values()
    env = {"LD_LIBRARY_PATH": library_path} if not plain["ok"] and with_path["ok"] else {}
    env_file.write_text(json.dumps(env, indent=2) + "\n")
    for way, found in ways.items():
        print(f"{way}: {'loads' if found['ok'] else 'does not load: ' + str(found['reason'])}")
    if env:
        print(f"the later steps run with LD_LIBRARY_PATH={library_path}")
    result({"ways": ways, "lib_dirs": dirs, "env": env})
    loads = [way for way, found in ways.items() if found["ok"]]
    print(f"the CUDA provider loads: {', '.join(loads)}" if loads else
          f"the CUDA provider loads in none of the {len(ways)} ways ({plain['reason']})")
    return 0 if plain["ok"] or with_path["ok"] else 1


@contextlib.contextmanager
def captured_fds():
    """Everything written to file descriptors 1 and 2 (ONNX Runtime's C++ log included); yields a list that holds
    the text on exit."""
    text: list[str] = []
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield text
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            sink.seek(0)
            text.append(sink.read().decode(errors="replace"))


def static_check(artifact: Path, provider: str) -> int:
    """A static-cache artifact on ``provider``: after a prefill of two prompts (7 and 4 tokens), one decode step
    keeps each layer's cache at the same device address, changes only each sequence's new row, and ONNX Runtime
    does not log that it fell back to copying the cache (the CPU test ``test_static_cache_is_updated_in_place``,
    on any provider)."""
    import numpy as np

    from mla_deploy.engines import OrtEngine

    engine = OrtEngine(artifact, provider=provider, log_severity=1)  # warnings: the copy fallback logs one
    state = engine.new_state(2)
    ids = np.zeros((2, 7), np.int64)
    valid = np.zeros_like(ids)
    for b, prompt in enumerate(([3, 14, 15, 92, 65, 35, 89], [27, 18, 28, 18])):
        ids[b, : len(prompt)] = np.array(prompt) % engine.config.vocab_size
        valid[b, : len(prompt)] = 1
    engine.forward("prefill", ids, np.broadcast_to(np.arange(7), ids.shape), state, valid)
    pointers, before, held = [c.data_ptr() for c in state.caches], [engine.to_host(c) for c in state.caches], \
        state.lengths.copy()
    with captured_fds() as log:
        engine.forward("decode", np.array([[5], [6]]), held[:, None].copy(), state)
    changed = [sorted((int(b), int(r)) for b, _, r in np.argwhere(np.any(engine.to_host(c) != old, axis=-1)))
               for c, old in zip(state.caches, before)]
    found = {"provider": engine.provider, "device": state.caches[0].device_name(), "layers": len(state.caches),
             "same_address": [c.data_ptr() for c in state.caches] == pointers,
             "only_new_rows": all(rows == [(0, int(held[0])), (1, int(held[1]))] for rows in changed),
             "copy_fallback_logged": "in-place optimization not activated" in log[0]}
    print(log[0], end="")
    print(json.dumps(found, indent=2))
    result(found)
    ok = found["same_address"] and found["only_new_rows"] and not found["copy_fallback_logged"]
    print(f"the static cache is {'' if ok else 'NOT '}updated in place on {found['provider']}")
    return 0 if ok else 1


def _decode_point(artifact: Path, provider: str, prompts: list[list[int]], new_tokens: int) -> dict:
    """One ``mla-deploy run --json`` of ``prompts``: its decode figures, or the error's last line."""
    args = [arg for p in prompts for arg in ("--prompt-ids", ",".join(map(str, p)))]
    cmd = [sys.executable, "-m", "mla_deploy", "run", str(artifact), *args, "--max-new-tokens", str(new_tokens),
           "--provider", provider, "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": ((proc.stderr + proc.stdout).strip().splitlines() or ["no output"])[-1][:300]}
    out = json.loads(proc.stdout)
    per_sequence = [s["decode_tokens_per_second"] for s in out["sequences"]]
    mean = sum(per_sequence) / len(per_sequence)
    return {"provider": out["provider"], "ms_per_token": 1000.0 / mean if mean else None,
            "tokens_per_second_batch": out["timings"]["decode_tokens_per_second_batch"],
            "time_to_first_token_s": out["timings"]["time_to_first_token_s"],
            "decode_steps": out["timings"]["decode_steps"]}


def decode_timing(artifact: Path, provider: str, contexts: list[int], batches: list[int], new_tokens: int) -> int:
    """Decode ms/token of ``mla-deploy run --json`` after prompts of each context length (at least one token),
    for each batch size: the figures `run` reports (its own clock around the decode loop, sampling on the host)."""
    import numpy as np

    from mla_deploy.artifact import load_manifest

    vocab = load_manifest(artifact).model.vocab_size
    rng, rows = np.random.default_rng(0), []
    for context in contexts:
        for batch in batches:
            prompts = rng.integers(0, vocab, size=(batch, max(1, context))).tolist()
            row = {"context": context, "batch": batch, **_decode_point(artifact, provider, prompts, new_tokens)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    result({"artifact": artifact.name, "new_tokens": new_tokens, "rows": rows})
    return 0 if all("error" not in r for r in rows) else 1


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_check.probes", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="probe", required=True)
    sub.add_parser("versions")
    load = sub.add_parser("cuda-load")
    load.add_argument("--env-file", type=Path, required=True)
    for name in ("static", "decode"):
        probe = sub.add_parser(name)
        probe.add_argument("artifact", type=Path)
        probe.add_argument("--provider", choices=["cpu", "cuda"], default="cuda")
        if name == "decode":
            probe.add_argument("--contexts", type=_ints, default=[0, 1024, 4096])
            probe.add_argument("--batch", type=_ints, default=[1, 32])
            probe.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    from mla_deploy.errors import MLADeployError

    try:
        if args.probe == "versions":
            return versions()
        if args.probe == "cuda-load":
            return cuda_load(args.env_file)
        if args.probe == "static":
            return static_check(args.artifact, args.provider)
        return decode_timing(args.artifact, args.provider, args.contexts, args.batch, args.new_tokens)
    except MLADeployError as exc:  # mla-deploy's user errors: one line, as its CLI prints them
        print(f"{args.probe}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
