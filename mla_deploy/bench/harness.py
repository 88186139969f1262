"""The process harness both benches run on: every measurement runs in a fresh worker process, one after the
other, with its thread count pinned, so no runtime's thread pool or allocator is shared between variants.

Driver side, :func:`run_points`: write the job (``JOB.json``, with the points still to run) to a file, run
``python -m WORKER JOB.json`` with ``OMP/MKL/OPENBLAS_NUM_THREADS`` set, read the worker's result file (rewritten
after every point) and, when the process dies at a point (the kernel's OOM killer, a crash), record that point as
out of memory or an error and start a fresh process on the points after it. A ``KeyboardInterrupt`` (Ctrl-C) in
the driver kills the worker before it propagates (:func:`child`).

Worker side, :class:`Results`: the result file (``{"pid", "probes", "points", "current", ...}``), rewritten before
and after every point so that a killed process leaves what it finished and names the point it was on;
:func:`failure` turns a runtime's exception into a record (out of memory or error).

A point is any JSON value (the attention bench's ``[T, B]``, the whole-model bench's ``"decode/T4096/B8"``);
each record the worker writes carries it as ``"point"``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

#: test hook: ``NAME:POINT`` (``torch-absorbed:8:1``, ``ours:decode/T6/B1``) makes the worker of that name SIGKILL
#: itself when it reaches that point, as the kernel's OOM killer would
KILL_AT_ENV = "MLA_DEPLOY_BENCH_KILL_AT"
#: words of a runtime's exception that mean it ran out of memory
OOM_WORDS = ("out of memory", "cannot allocate", "bad_alloc", "not enough memory", "failed to allocate",
             "defaultcpuallocator")


def thread_env(threads: int) -> dict[str, str]:
    """This process's environment with the BLAS/OpenMP thread counts of a worker pinned to ``threads``."""
    n = str(threads)
    return {**os.environ, "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n,
            "PYTHONUNBUFFERED": "1"}


@contextlib.contextmanager
def child(args: list[str], **popen: Any) -> Iterator[subprocess.Popen]:
    """``subprocess.Popen(args, **popen)``, killed and reaped on leaving the block if it still runs (Ctrl-C in
    the driver, or any exception) so that no worker outlives the bench."""
    proc = subprocess.Popen(args, **popen)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@dataclass(frozen=True)
class Exit:
    """How one worker process ended. Attributes: code: its exit status (negative: killed by that signal);
    result: its result file's content ({} when it wrote none); stderr: what it wrote there."""

    code: int
    result: dict
    stderr: str

    @property
    def killed(self) -> bool:
        """Killed by SIGKILL (directly or as a shell reports it): most likely the kernel's OOM killer."""
        return self.code in (-9, 137)

    @property
    def why(self) -> str:
        """What happened to the process, for a record's detail."""
        if self.killed:
            return "was killed by signal 9 (the kernel's OOM killer?)"
        if self.code < 0:
            return f"was killed by signal {-self.code}"
        lines = [ln for ln in self.stderr.splitlines() if ln.strip()]
        return f"failed (exit {self.code}): {lines[-1][:300] if lines else ''}".rstrip(": ")


def spawn(module: str, job: dict, stem: Path, threads: int, echo: Callable[[str], None] | None = None) -> Exit:
    """Run ``python -m module STEM.job.json`` (``job`` written there; its ``result`` file read back) with the
    thread environment pinned; stderr goes to ``STEM.stderr``. ``echo``: called with each stdout line of the
    worker (indented); None discards its stdout."""
    job_file, err_file = stem.with_suffix(".job.json"), stem.with_suffix(".stderr")
    job_file.write_text(json.dumps(job))
    with open(err_file, "w") as err, child([sys.executable, "-m", module, str(job_file)], stderr=err,
                                           stdout=subprocess.PIPE if echo else subprocess.DEVNULL,
                                           env=thread_env(threads), text=True) as proc:
        for line in proc.stdout if echo else ():
            echo(f"  {line.rstrip()}")
        code = proc.wait()
    result_file = Path(job["result"])
    result = json.loads(result_file.read_text()) if result_file.is_file() else {}
    return Exit(code, result, err_file.read_text(errors="replace"))


@dataclass
class Runs:
    """What :func:`run_points` gathered.

    Attributes:
        records: one per point that has one (the workers' own, and the point each killed process was on), in
            the order they finished.
        results: each process's result file, in order.
        stderr: every process's stderr, concatenated.
        restarts: processes started again after one stopped at a point.
        failure: why a process died before its first point (its points then have no record), else None.
        missing: the points without a record (after a failure, or a worker that exited without running them).
    """

    records: list[dict] = field(default_factory=list)
    results: list[dict] = field(default_factory=list)
    stderr: str = ""
    restarts: int = 0
    failure: str | None = None
    missing: list = field(default_factory=list)

    def last(self, key: str) -> Any:
        """The last non-None ``key`` of the result files (None when none has it)."""
        return next((r[key] for r in reversed(self.results) if r.get(key) is not None), None)

    @property
    def probes(self) -> list[dict]:
        return [p for r in self.results for p in r.get("probes", [])]


def run_points(module: str, job: dict, points: list, work: Path, name: str, threads: int,
               echo: Callable[[str], None], stream: bool = False) -> Runs:
    """Run the worker ``module`` on ``job`` over ``points`` in fresh processes until every point has a record
    (see the module docstring). ``name`` names its files under ``work`` and its progress lines; ``stream``:
    echo the worker's stdout lines."""
    runs, remaining = Runs(), list(points)
    stem = work / "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    for attempt in range(len(points) + 1):
        result = str(stem) + f"_{attempt}.result.json"
        end = spawn(module, {**job, "points": remaining, "result": result}, Path(f"{stem}_{attempt}"), threads,
                    echo if stream else None)
        runs.results.append(end.result)
        runs.stderr += end.stderr
        done = end.result.get("points", [])
        runs.records += done
        remaining = [p for p in remaining if all(r.get("point") != p for r in done)]
        current = end.result.get("current")
        if end.code == 0 or not remaining:
            break
        if current is None:
            when = "between two points" if done else "before its first point"
            runs.failure = f"the {name} process {end.why} {when}"
            break
        runs.records.append({"point": current, "status": "out of memory" if end.killed else "error",
                             "detail": f"the process {end.why} at this point"})
        remaining = [p for p in remaining if p != current]
        if not remaining:
            break
        runs.restarts += 1
        echo(f"  {name}: the process stopped at {current}; restarting on {len(remaining)} point(s)")
    runs.missing = remaining
    return runs


# worker side -------------------------------------------------------------------------------------------------------


def load_job(job_file: str) -> dict:
    """The job a worker was given; makes this process the kernel's first choice should memory run out, rather
    than another process of the machine."""
    from .machine import prefer_as_oom_victim

    prefer_as_oom_victim()
    return json.loads(Path(job_file).read_text())


def pin_torch_threads(threads: int) -> None:
    """torch's intra-op threads to ``threads``, one inter-op thread."""
    import torch

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)


def failure(exc: BaseException) -> dict:
    """``{"status": "out of memory" | "error", "detail"}`` of a runtime's exception (torch and ONNX Runtime
    report running out of memory as RuntimeError with one of :data:`OOM_WORDS`)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    oom = isinstance(exc, MemoryError) or any(w in str(exc).lower() for w in OOM_WORDS)
    return {"status": "out of memory" if oom else "error", "detail": f"{type(exc).__name__}: {text[:300]}"}


def _tag(point: Any) -> str:
    return ":".join(map(str, point)) if isinstance(point, (list, tuple)) else str(point)


class Results:
    """A worker's result file (the job's ``result``), written at once and after every change.

    Args:
        job: the job (:func:`load_job`).
        fields: more top-level entries (the variant, the pass, ...).
    """

    def __init__(self, job: dict, **fields: Any):
        self.file = Path(job["result"])
        self.data: dict = {"pid": os.getpid(), "probes": [], "points": [], "current": None, **fields}
        self.write()

    def write(self) -> None:
        from ..artifact import atomic_write_text

        atomic_write_text(self.file, json.dumps(self.data))

    def run(self, name: str, points: list, measure: Callable[[Any], dict],
            report: Callable[[dict], None] | None = None) -> None:
        """``measure(point)`` -> the point's record, for each point in turn; the file names the point while it
        runs. ``report(record)``: called after each point (a progress line)."""
        kill_at = os.environ.get(KILL_AT_ENV)
        for point in points:
            self.data["current"] = point
            self.write()
            if kill_at == f"{name}:{_tag(point)}":
                import signal

                os.kill(os.getpid(), signal.SIGKILL)
            record = {"point": point, **measure(point)}
            self.data["points"].append(record)
            self.data["current"] = None
            self.write()
            if report is not None:
                report(record)

    def finish(self) -> int:
        """Mark the run complete; returns the worker's exit status (0)."""
        self.data["done"] = True
        self.write()
        return 0
