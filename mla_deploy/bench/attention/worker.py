"""One attention-bench process: one variant (path), one pass, a list of ``[T, B]`` points. Run by the driver
through the shared harness (:mod:`..harness`) as ``python -m mla_deploy.bench.attention.worker JOB.json``; the
result file is rewritten after every point, so a process killed by the kernel (out of memory) leaves what it
finished and names the point it was on.

Per point: estimate the memory, skip the point when it does not fit; reset the peak-RSS mark; build the
point's inputs (the same tensors in every process); set the path up; ``warmup`` untimed calls; up to
``repeat`` timed back-to-back calls within ``max_seconds`` (at least 3); keep the output of the last call
(pass 0 only) for the numerical comparison; record the peak resident memory. A bandwidth and GEMM probe runs
at the start and at the end of the process.
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

from ... import host

from ..harness import Results, failure, load_job, pin_torch_threads
from .spec import GRAPH_LAYOUTS


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


def _too_big(spec, path: str, context: int, batch: int) -> dict:
    """The point's memory estimate and what is available; with ``status`` "does not fit" when the estimate
    exceeds the allowance (TensorRT's tensors live on the GPU: never refused here)."""
    from .roofline import memory_estimate

    estimate = memory_estimate(spec.config, path, spec.layers, context, batch, context + spec.static_margin)
    available = host.available_memory()
    record = {"memory_estimate_bytes": estimate, "memory_available_bytes": available}
    if path != "trt" and available is not None and estimate > spec.memory_fraction * available:
        record.update(status="does not fit",
                      detail=f"needs about {estimate / 2**30:.1f} GiB, {available / 2**30:.1f} GiB available "
                             f"(limit {spec.memory_fraction:.0%} of it)")
    return record


def _time(timed, spec) -> list[float]:
    """``spec.warmup`` untimed calls (at most a third of ``max_seconds``), then up to ``spec.repeat`` timed ones
    within ``max_seconds`` (at least 3): their times in seconds."""
    begin = time.perf_counter()
    for _ in range(spec.warmup):
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
    return times


def run_point(timed, spec, path: str, context: int, batch: int, outputs_dir: str | None) -> dict:
    """Time one point of ``timed`` (:func:`make_path`'s object); returns its record (``status`` ok / does not
    fit / out of memory / error)."""
    import numpy as np

    from .. import machine
    from .inputs import make_inputs

    record = {"context": context, "batch": batch, **_too_big(spec, path, context, batch)}
    if "status" in record:
        return record
    gc.collect()
    record["peak_is_per_point"] = machine.reset_peak()
    try:
        inputs = make_inputs(spec.config, spec.layers, context, batch, spec.seed)
        timed.setup(inputs)
        del inputs
        gc.collect()
        record.update(status="ok", times_s=_time(timed, spec), warmup_calls=spec.warmup, checks=timed.checks())
        if outputs_dir:
            np.save(Path(outputs_dir) / f"{path}_T{context}_B{batch}.npy", timed.output())
    except (MemoryError, RuntimeError) as exc:  # torch and ONNX Runtime report failures as RuntimeError
        record.update(failure(exc))
    finally:
        timed.teardown()
        gc.collect()
    record["peak_memory_bytes"] = machine.peak_bytes()
    return record


def _probe(spec, at: str) -> dict:
    from .. import machine

    return {"at": at, **machine.probe(spec.threads, spec.probe_mib), "loadavg_1min": machine.load_average()}


def main(job_file: str) -> int:
    job = load_job(job_file)
    pin_torch_threads(job["spec"]["threads"])
    import torch

    from .spec import BenchSpec

    spec = BenchSpec.from_dict(job["spec"])
    path = job["path"]
    result = Results(job, path=path, **{"pass": job["pass"]}, torch_threads=torch.get_num_threads())
    result.data["probes"].append(_probe(spec, "start"))
    result.write()
    timed = make_path(path, spec, job)
    result.data["provider"] = getattr(timed, "provider", None)
    result.run(path, job["points"], lambda p: run_point(timed, spec, path, p[0], p[1], job.get("outputs_dir")))
    del timed
    gc.collect()
    result.data["probes"].append(_probe(spec, "end"))
    return result.finish()


if __name__ == "__main__":  # pragma: no cover - run by the driver
    sys.exit(main(sys.argv[1]))
