"""Run a bench: export the graphs once, run every variant in its own process per pass (interleaved: odd
passes reverse the order of variants and points), then merge, derive and write the report.

Nothing here is timed in the driver's own process: each worker (:mod:`.worker`) owns one variant, so ONNX
Runtime pools, torch's OpenMP pool and the allocators of different variants never share a process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from .spec import GRAPH_LAYOUTS, PATHS, BenchSpec


def path_availability(paths) -> dict[str, dict]:
    """For each path: ``{"available": bool, "reason": str | None}`` (what is missing, without running anything)."""
    out = {}
    for path in paths:
        ok, reason = True, None
        if path.startswith("hf-"):
            from .hf_path import transformers_version

            if transformers_version() is None:
                ok, reason = False, "transformers is not installed"
        elif path.startswith("ort-"):
            try:
                import onnxruntime  # noqa: F401
            except ImportError:
                ok, reason = False, "onnxruntime is not installed"
        elif path == "trt":
            from .trt_path import availability

            ok, reason = availability()
        out[path] = {"available": ok, "reason": reason}
    return out


def _export_graphs(spec: BenchSpec, work: Path, paths, status: dict, echo) -> dict[str, str]:
    """Export the graphs the requested paths need, one per cache layout (:data:`~.spec.GRAPH_LAYOUTS`), keyed by
    the layout's mode; a failure marks the paths of that graph unavailable. TensorRT's engine is keyed ``trt``."""
    modes = {p: layout.mode for p, layout in GRAPH_LAYOUTS.items()}
    wanted = sorted({modes[p] for p in paths if p in modes and status[p]["available"]})
    graphs = {}
    if not wanted:
        return graphs
    # one process per graph, side by side: the exporter is mostly single-threaded Python
    start = time.perf_counter()
    procs = {}
    for mode in wanted:
        job = work / f"export_{mode}.json"
        job.write_text(json.dumps({"spec": spec.to_dict(), "mode": mode,
                                   "path": str(work / f"attention_stack_{mode}.onnx")}))
        err = open(work / f"export_{mode}.stderr", "w")
        procs[mode] = (subprocess.Popen([sys.executable, "-m", "mla_deploy.bench.graph", str(job)],
                                        stdout=subprocess.DEVNULL, stderr=err), err)
    for mode, (proc, err) in procs.items():
        proc.wait()
        err.close()
        path = work / f"attention_stack_{mode}.onnx"
        if proc.returncode == 0 and path.is_file():
            graphs[mode] = str(path)
            echo(f"exported the {mode} attention-stack graph ({time.perf_counter() - start:.1f} s)")
            continue
        lines = [ln for ln in (work / f"export_{mode}.stderr").read_text(errors="replace").splitlines() if ln.strip()]
        reason = f"export failed: {lines[-1][:300] if lines else f'exit {proc.returncode}'}"
        for p, m in modes.items():
            if m == mode and p in status:
                status[p] = {"available": False, "reason": reason}
    if "trt" in paths and status["trt"]["available"] and modes["trt"] in graphs:
        from .trt_path import build_engine

        try:
            start = time.perf_counter()
            engine = build_engine(graphs[modes["trt"]], work / f"attention_stack_{modes['trt']}.engine", spec,
                                  GRAPH_LAYOUTS["trt"])
            graphs["trt"] = str(engine)
            echo(f"built the TensorRT engine in {time.perf_counter() - start:.1f} s")
        except Exception as exc:  # TensorRT/Polygraphy raise many types; the row then says why
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            status["trt"] = {"available": False, "reason": f"engine build failed: {first}"}
    return graphs


def _graph_of(path: str, graphs: dict[str, str]) -> str | None:
    """The file ``path`` runs: TensorRT its engine, ONNX Runtime the graph of its layout, the others none."""
    if path == "trt":
        return graphs.get("trt")
    return graphs.get(GRAPH_LAYOUTS[path].mode) if path in GRAPH_LAYOUTS else None


def _run_worker(spec: BenchSpec, path: str, points, pass_index: int, work: Path, graph: str | None,
                echo) -> tuple[list[dict], list[dict], dict]:
    """Run ``path`` over ``points`` in fresh processes until every point has a record (a killed process is
    restarted on the points it had not reached). Returns (point records, probes, info)."""
    records, probes, info = [], [], {"stderr_copy_warnings": 0, "provider": None, "restarts": 0}
    remaining = [list(p) for p in points]
    outputs_dir = work / "outputs"
    outputs_dir.mkdir(exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(spec.threads), "MKL_NUM_THREADS": str(spec.threads),
           "OPENBLAS_NUM_THREADS": str(spec.threads), "PYTHONUNBUFFERED": "1"}
    attempt = 0
    while remaining:
        tag = f"{path}_pass{pass_index}_{attempt}"
        job = {"spec": spec.to_dict(), "path": path, "pass": pass_index, "points": remaining, "graph": graph,
               "outputs_dir": str(outputs_dir) if pass_index == 0 else None, "result": str(work / f"{tag}.result.json")}
        job_file = work / f"{tag}.job.json"
        job_file.write_text(json.dumps(job))
        err_file = work / f"{tag}.stderr"
        with open(err_file, "w") as err:
            proc = subprocess.run([sys.executable, "-m", "mla_deploy.bench.worker", str(job_file)],
                                  stdout=subprocess.DEVNULL, stderr=err, env=env)
        stderr = err_file.read_text(errors="replace")
        from .ort_path import COPY_WARNING

        info["stderr_copy_warnings"] += stderr.count(COPY_WARNING)
        result = {}
        if Path(job["result"]).is_file():
            result = json.loads(Path(job["result"]).read_text())
        info["provider"] = result.get("provider") or info["provider"]
        probes += [dict(p, path=path, **{"pass": pass_index}) for p in result.get("probes", [])]
        done = result.get("points", [])
        records += done
        finished = {(r["context"], r["batch"]) for r in done}
        remaining = [p for p in remaining if tuple(p) not in finished]
        if proc.returncode != 0 and remaining:
            current = result.get("current")
            lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
            last = lines[-1] if lines else ""
            if current is None:  # died before its first point: every remaining point fails the same way
                why = "killed" if proc.returncode < 0 else "failed"
                for t, b in remaining:
                    records.append({"context": t, "batch": b, "status": "error",
                                    "detail": f"worker {why} before the point (exit {proc.returncode}): {last[:300]}"})
                break
            killed = proc.returncode in (-9, 137)
            records.append({"context": current[0], "batch": current[1],
                            "status": "out of memory" if killed else "error",
                            "detail": (f"worker killed by signal 9 (the kernel's OOM killer?) at this point"
                                       if killed else f"worker exit {proc.returncode}: {last[:300]}")})
            remaining = [p for p in remaining if p != current]
            info["restarts"] += 1
            echo(f"  {path}: the worker stopped at T={current[0]} B={current[1]} ({records[-1]['status']}); "
                 f"continuing with {len(remaining)} point(s)")
        elif remaining:  # exit 0 without finishing (should not happen): do not loop
            for t, b in remaining:
                records.append({"context": t, "batch": b, "status": "error",
                                "detail": "the worker exited without running this point"})
            break
        elif proc.returncode != 0:
            info["restarts"] += 1
        attempt += 1
    return records, probes, info


def run_bench(spec: BenchSpec, out_dir: str | Path, echo: Callable[[str], None] | None = None,
              command: str | None = None) -> dict:
    """Run ``spec``, write ``bench.json``, ``bench.md`` and ``bench.png`` into ``out_dir`` (each written to a
    temporary name, then renamed) and return the report dict."""
    from .output import write_outputs
    from .report import build_report

    echo = echo or (lambda line: None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".bench-work-", dir=out))
    started = time.time()
    from .machine import describe

    described = describe()  # CPU, memory, load average at the start
    try:
        status = path_availability(spec.paths)
        for path, s in status.items():
            if not s["available"]:
                echo(f"{path}: not available ({s['reason']})")
        graphs = _export_graphs(spec, work, spec.paths, status, echo)
        runs = []
        for p in range(spec.passes):
            order = [x for x in spec.paths if status[x]["available"]]
            points = spec.points
            if p % 2:
                order, points = order[::-1], points[::-1]
            for path in order:
                start = time.perf_counter()
                graph = _graph_of(path, graphs)
                records, probes, info = _run_worker(spec, path, points, p, work, graph, echo)
                runs.append({"path": path, "pass": p, "records": records, "probes": probes, "info": info,
                             "seconds": time.perf_counter() - start})
                echo(f"pass {p + 1}/{spec.passes} {path:<15} {len(records)} point(s) in "
                     f"{time.perf_counter() - start:.1f} s")
        report = build_report(spec, status, runs, work / "outputs", started, command, described)
        write_outputs(report, out)
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)


__all__ = ["run_bench", "path_availability", "PATHS"]
