"""Run a bench: export the graphs once, run every variant in its own process per pass (interleaved: odd
passes reverse the order of variants and points), then merge, derive and write the report.

Nothing here is timed in the driver's own process: each worker (:mod:`.worker`, run by the shared harness
:mod:`..harness`) owns one variant, so ONNX Runtime pools, torch's OpenMP pool and the allocators of different
variants never share a process.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from ..harness import child, run_points
from ..machine import package_version
from .spec import GRAPH_LAYOUTS, PATHS, BenchSpec


def path_availability(paths) -> dict[str, dict]:
    """For each path: ``{"available": bool, "reason": str | None}`` (what is missing, without running anything)."""
    out = {}
    for path in paths:
        ok, reason = True, None
        if path.startswith("hf-") and package_version("transformers") is None:
            ok, reason = False, "transformers is not installed"
        elif path.startswith("ort-") and package_version("onnxruntime") is None:
            ok, reason = False, "onnxruntime is not installed"
        elif path == "trt":
            from .trt_path import availability

            ok, reason = availability()
        out[path] = {"available": ok, "reason": reason}
    return out


def _export_onnx(spec: BenchSpec, work: Path, modes: list[str], echo) -> tuple[dict[str, str], dict[str, str]]:
    """Export the attention-stack graph of each cache layout in ``modes``, one process per graph, side by side
    (the exporter is mostly single-threaded Python). Returns ``{mode: graph}`` and ``{mode: why it failed}``."""
    start = time.perf_counter()
    graphs, failed = {}, {}
    with contextlib.ExitStack() as stack:
        procs = {}
        for mode in modes:
            job = work / f"export_{mode}.json"
            job.write_text(json.dumps({"spec": spec.to_dict(), "mode": mode,
                                       "path": str(work / f"attention_stack_{mode}.onnx")}))
            err = stack.enter_context(open(work / f"export_{mode}.stderr", "w"))
            procs[mode] = stack.enter_context(child([sys.executable, "-m", f"{__package__}.graph", str(job)],
                                                    stdout=subprocess.DEVNULL, stderr=err))
        for mode, proc in procs.items():
            code, path = proc.wait(), work / f"attention_stack_{mode}.onnx"
            if code == 0 and path.is_file():
                graphs[mode] = str(path)
                echo(f"exported the {mode} attention-stack graph ({time.perf_counter() - start:.1f} s)")
                continue
            lines = [ln for ln in (work / f"export_{mode}.stderr").read_text(errors="replace").splitlines()
                     if ln.strip()]
            failed[mode] = f"export failed: {lines[-1][:300] if lines else f'exit {code}'}"
    return graphs, failed


def _build_trt(spec: BenchSpec, onnx: str, work: Path, echo) -> tuple[str | None, str | None]:
    """The TensorRT engine of the ``onnx`` graph: (its file, None) or (None, why the build failed)."""
    from .trt_path import build_engine

    layout = GRAPH_LAYOUTS["trt"]
    try:
        start = time.perf_counter()
        engine = build_engine(onnx, work / f"attention_stack_{layout.mode}.engine", spec, layout)
        echo(f"built the TensorRT engine in {time.perf_counter() - start:.1f} s")
        return str(engine), None
    except Exception as exc:  # TensorRT/Polygraphy raise many types; the row then says why
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None, f"engine build failed: {first}"


def _export_graphs(spec: BenchSpec, work: Path, status: dict, echo) -> dict[str, str]:
    """Export the graphs the available paths need, one per cache layout (:data:`~.spec.GRAPH_LAYOUTS`), keyed by
    the layout's mode; a failure marks the paths of that graph unavailable. TensorRT's engine is keyed ``trt``."""
    modes = {p: layout.mode for p, layout in GRAPH_LAYOUTS.items()}
    wanted = sorted({modes[p] for p in spec.paths if p in modes and status[p]["available"]})
    graphs, failed = _export_onnx(spec, work, wanted, echo) if wanted else ({}, {})
    for path, mode in modes.items():
        if mode in failed and path in status:
            status[path] = {"available": False, "reason": failed[mode]}
    if "trt" in spec.paths and status["trt"]["available"] and modes["trt"] in graphs:
        engine, reason = _build_trt(spec, graphs[modes["trt"]], work, echo)
        if engine:
            graphs["trt"] = engine
        else:
            status["trt"] = {"available": False, "reason": reason}
    return graphs


def _graph_of(path: str, graphs: dict[str, str]) -> str | None:
    """The file ``path`` runs: TensorRT its engine, ONNX Runtime the graph of its layout, the others none."""
    if path == "trt":
        return graphs.get("trt")
    return graphs.get(GRAPH_LAYOUTS[path].mode) if path in GRAPH_LAYOUTS else None


def _run_worker(spec: BenchSpec, path: str, points, pass_index: int, work: Path, graph: str | None,
                echo) -> tuple[list[dict], list[dict], dict]:
    """Run ``path`` over ``points`` in fresh processes until every point has a record (:func:`~..harness.run_points`:
    a killed process is restarted on the points it had not reached). Returns (point records, probes, info)."""
    from .ort_path import COPY_WARNING

    outputs_dir = work / "outputs"
    outputs_dir.mkdir(exist_ok=True)
    job = {"spec": spec.to_dict(), "path": path, "pass": pass_index, "graph": graph,
           "outputs_dir": str(outputs_dir) if pass_index == 0 else None}
    runs = run_points(f"{__package__}.worker", job, [list(p) for p in points], work, f"{path} pass {pass_index}",
                      spec.threads, echo)
    detail = runs.failure or "the worker exited without running this point"
    records = runs.records + [{"point": p, "status": "error", "detail": detail} for p in runs.missing]
    records = [{"context": r["point"][0], "batch": r["point"][1], **r} for r in records]
    probes = [dict(p, path=path, **{"pass": pass_index}) for p in runs.probes]
    info = {"stderr_copy_warnings": runs.stderr.count(COPY_WARNING), "provider": runs.last("provider"),
            "restarts": runs.restarts}
    return records, probes, info


def _run_passes(spec: BenchSpec, status: dict, graphs: dict[str, str], work: Path, echo) -> list[dict]:
    """Every available path over every point, ``spec.passes`` times (odd passes in reverse order); one entry per
    path and pass: ``{"path", "pass", "records", "probes", "info", "seconds"}``."""
    runs = []
    for p in range(spec.passes):
        order = [x for x in spec.paths if status[x]["available"]]
        points = spec.points
        if p % 2:
            order, points = order[::-1], points[::-1]
        for path in order:
            start = time.perf_counter()
            records, probes, info = _run_worker(spec, path, points, p, work, _graph_of(path, graphs), echo)
            runs.append({"path": path, "pass": p, "records": records, "probes": probes, "info": info,
                         "seconds": time.perf_counter() - start})
            echo(f"pass {p + 1}/{spec.passes} {path:<15} {len(records)} point(s) in "
                 f"{time.perf_counter() - start:.1f} s")
    return runs


def run_bench(spec: BenchSpec, out_dir: str | Path, echo: Callable[[str], None] | None = None,
              command: str | None = None) -> dict:
    """Run ``spec``, write ``bench.json``, ``bench.md`` and ``bench.png`` into ``out_dir`` (each written to a
    temporary name, then renamed) and return the report dict."""
    from ...host import describe
    from ..reporting import write_outputs
    from .output import markdown, plot
    from .report import build_report

    echo = echo or (lambda line: None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".bench-work-", dir=out))
    started = time.time()
    described = describe()  # CPU, memory, load average at the start
    try:
        status = path_availability(spec.paths)
        for path, s in status.items():
            if not s["available"]:
                echo(f"{path}: not available ({s['reason']})")
        graphs = _export_graphs(spec, work, status, echo)
        runs = _run_passes(spec, status, graphs, work, echo)
        report = build_report(spec, status, runs, work / "outputs", started, command, described)
        write_outputs(report, out, markdown, plot)
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)


__all__ = ["run_bench", "path_availability", "PATHS"]
