"""One bench process: one variant (path), one pass, a list of points. Run by the driver as
``python -m mla_deploy.bench.worker JOB.json``; writes ``JOB.json``'s ``result`` file after every point, so a
process killed by the kernel (out of memory) leaves what it finished and names the point it was on.

Per point: estimate the memory, skip the point when it does not fit; reset the peak-RSS mark; build the
point's inputs (the same tensors in every process); set the path up; ``warmup`` untimed calls; up to
``repeat`` timed back-to-back calls within ``max_seconds`` (at least 3); keep the output of the last call
(pass 0 only) for the numerical comparison; record the peak resident memory. A bandwidth and GEMM probe runs
at the start and at the end of the process.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
from pathlib import Path

from .spec import GRAPH_LAYOUTS

#: test hook: ``path:T:B`` makes the worker SIGKILL itself when it reaches that point
KILL_AT_ENV = "MLA_DEPLOY_BENCH_KILL_AT"
OOM_WORDS = ("out of memory", "cannot allocate", "bad_alloc", "not enough memory", "failed to allocate",
             "defaultcpuallocator")


def _write(path: Path, data: dict) -> None:
    from ..artifact import atomic_write_text

    atomic_write_text(path, json.dumps(data))


def make_path(path: str, spec, job: dict):
    """The object that times ``path``: ``setup(inputs)``, ``step()``, ``output()``, ``checks()``, ``teardown()``
    (see :mod:`.torch_paths`, :mod:`.hf_path`, :mod:`.ort_path`, :mod:`.trt_path`)."""
    if path in ("hf-eager", "hf-sdpa"):
        from .hf_path import HFPath

        return HFPath(spec.config, spec.layers, spec.seed, path.split("-", 1)[1])
    if path in ("torch-cd", "torch-absorbed"):
        from .torch_paths import TorchPath

        return TorchPath(spec.config, spec.layers, spec.seed, "CD" if path == "torch-cd" else "A_CC")
    if path == "trt":
        from .trt_path import TrtPath

        return TrtPath(job["graph"], GRAPH_LAYOUTS[path], spec.static_margin)
    if path in GRAPH_LAYOUTS:
        from .ort_path import OrtPath

        return OrtPath(job["graph"], GRAPH_LAYOUTS[path], spec.threads, spec.static_margin)
    raise ValueError(f"unknown path {path!r}")


def run_point(timed, spec, path: str, context: int, batch: int, outputs_dir: str | None) -> dict:
    """Time one point of ``timed`` (:func:`make_path`'s object); returns its record (``status`` ok / does not
    fit / out of memory / error)."""
    import numpy as np

    from . import machine
    from .inputs import make_inputs
    from .roofline import memory_estimate

    record = {"context": context, "batch": batch}
    capacity = context + spec.static_margin
    estimate = memory_estimate(spec.config, path, spec.layers, context, batch, capacity)
    available = machine.available_bytes()
    record.update(memory_estimate_bytes=estimate, memory_available_bytes=available)
    if path != "trt" and available is not None and estimate > spec.memory_fraction * available:
        record.update(status="does not fit",
                      detail=f"needs about {estimate / 2**30:.1f} GiB, {available / 2**30:.1f} GiB available "
                             f"(limit {spec.memory_fraction:.0%} of it)")
        return record
    gc.collect()
    record["peak_is_per_point"] = machine.reset_peak()
    try:
        inputs = make_inputs(spec.config, spec.layers, context, batch, spec.seed)
        timed.setup(inputs)
        del inputs
        gc.collect()
        begin = time.perf_counter()
        for i in range(spec.warmup):
            timed.step()
            if time.perf_counter() - begin > spec.max_seconds / 3:
                break
        times = []
        timed_start = time.perf_counter()
        for _ in range(spec.repeat):
            start = time.perf_counter()
            timed.step()
            times.append(time.perf_counter() - start)
            if len(times) >= 3 and time.perf_counter() - timed_start > spec.max_seconds:
                break
        record.update(status="ok", times_s=times, warmup_calls=spec.warmup, checks=timed.checks())
        if outputs_dir:
            np.save(Path(outputs_dir) / f"{path}_T{context}_B{batch}.npy", timed.output())
    except (MemoryError, RuntimeError) as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        oom = isinstance(exc, MemoryError) or any(w in str(exc).lower() for w in OOM_WORDS)
        record.update(status="out of memory" if oom else "error", detail=f"{type(exc).__name__}: {text[:300]}")
    finally:
        timed.teardown()
        gc.collect()
    record["peak_memory_bytes"] = machine.peak_bytes()
    return record


def main(job_file: str) -> int:
    from . import machine

    machine.prefer_as_oom_victim()
    job = json.loads(Path(job_file).read_text())
    threads = job["spec"]["threads"]
    import torch

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    from .spec import BenchSpec

    spec = BenchSpec.from_dict(job["spec"])
    result_path = Path(job["result"])
    result = {"path": job["path"], "pass": job["pass"], "pid": os.getpid(), "probes": [], "points": [],
              "current": None, "torch_threads": torch.get_num_threads()}
    result["probes"].append({"at": "start", **machine.probe(threads, spec.probe_mib), "loadavg_1min": machine.load_average()})
    _write(result_path, result)
    timed = make_path(job["path"], spec, job)
    result["provider"] = getattr(timed, "provider", None)
    kill_at = os.environ.get(KILL_AT_ENV)  # test hook: die like the kernel's OOM killer would, at this point
    for context, batch in job["points"]:
        result["current"] = [context, batch]
        _write(result_path, result)
        if kill_at == f"{job['path']}:{context}:{batch}":
            os.kill(os.getpid(), signal.SIGKILL)
        record = run_point(timed, spec, job["path"], context, batch, job.get("outputs_dir"))
        result["points"].append(record)
        result["current"] = None
        _write(result_path, result)
    del timed
    gc.collect()
    result["probes"].append({"at": "end", **machine.probe(threads, spec.probe_mib), "loadavg_1min": machine.load_average()})
    result["done"] = True
    _write(result_path, result)
    return 0


if __name__ == "__main__":  # pragma: no cover - run by the driver
    sys.exit(main(sys.argv[1]))
