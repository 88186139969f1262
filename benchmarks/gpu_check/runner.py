"""Runs the steps of :mod:`.steps`, one process each, and records each outcome; a failure never stops the run.

The work folder keeps the records between calls: a step that finished (passed, failed, timed out) is not run
again, so the same command, repeated on the GPU machine while it stays warm, goes on where the last call stopped.
A step that could not run yet (its wheels not installed, its export not done, the call's time budget spent) is
PENDING and runs in a later call.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .layout import REPO, Work
from .steps import Options, Step

#: outcomes that are final: the step is not run again in the same work folder
DONE = ("PASS", "FAIL", "XFAIL", "XPASS", "TIMEOUT")
FAILED = ("FAIL", "TIMEOUT")
#: a step is started only with at least this much of the call's budget left
MIN_START = 30.0
DEVICE_STEPS_NOTE = "onnxruntime-gpu and polygraphy are not installed yet: `benchmarks/gpu_check.sh install` once every part is carried"


@dataclass
class Record:
    """The outcome of one step."""

    name: str
    group: str
    status: str
    command: str
    seconds: float = 0.0
    rc: int | None = None
    note: str = ""
    log: str = ""
    kind: str = ""
    finished: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M:%S"))


def display(argv) -> str:
    """A command as it would be typed, with the repository's paths relative and the interpreter as ``python3``."""
    words = ["python3" if i == 0 and Path(a).name.startswith("python") else a for i, a in enumerate(argv)]
    return shlex.join(w.replace(str(REPO) + "/", "") for w in words)


def child_env(work: Work) -> dict:
    """The environment of every step: the carried packages and the repository importable, plus what the CUDA
    provider probe found the later steps need (``env.json``)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [str(work.site)] if work.site.is_dir() else []
    paths += [str(REPO), str(REPO / "benchmarks"), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if work.env_file.is_file():
        env.update(json.loads(work.env_file.read_text()))
    return env


ORT_CHECK = ("import onnxruntime, polygraphy; from onnxruntime.capi import build_and_package_info as b; "
             "print(b.package_name)")


def ort_ready(options: Options) -> bool:
    """onnxruntime and polygraphy import (on the GPU: the onnxruntime-gpu build)."""
    proc = subprocess.run([options.python, "-c", ORT_CHECK], capture_output=True, text=True, cwd=REPO,
                          env=child_env(options.work), timeout=300)
    return proc.returncode == 0 and (options.dry_run or proc.stdout.strip() == "onnxruntime-gpu")


class Runner:
    """Runs a plan's selected steps within an optional time budget (seconds), keeping finished records."""

    #: a step is started only with at least this many seconds of the budget left
    min_start = MIN_START

    def __init__(self, options: Options, selected: set[str] | None = None, budget: float | None = None):
        self.options, self.selected, self.budget = options, selected, budget
        self.deadline = time.monotonic() + budget if budget else None
        self.records: dict[str, Record] = {}
        self._ort: bool | None = None

    def previous(self, step: Step) -> Record | None:
        path = self.options.work.records / f"{step.name}.json"
        if not path.is_file():
            return None
        record = Record(**json.loads(path.read_text()))
        return record if record.status in DONE else None

    def _waiting(self, step: Step) -> Record | None:
        """A SKIPPED or PENDING record if ``step`` cannot run now; None if it can."""
        def hold(status, note):
            return Record(step.name, step.group, status, display(step.argv), note=note, kind=step.kind)

        if self.options.dry_run and step.gpu:
            return hold("SKIPPED", "dry run: needs a CUDA GPU")
        if step.skip:
            return hold("SKIPPED", step.skip)
        if self.selected is not None and not ({step.name, step.group} & self.selected):
            return hold("SKIPPED", "not selected (--steps)")
        for name in step.after:
            before = self.records.get(name)
            if before is None or before.status not in DONE:
                return hold("PENDING", f"waits for {name}")
            if before.status not in ("PASS", "XPASS"):
                return hold("SKIPPED", f"{name} did not pass ({before.status})")
        if step.needs_ort and not self._ort_ready():
            return hold("PENDING", DEVICE_STEPS_NOTE)
        if self.deadline is not None and self.deadline - time.monotonic() < self.min_start:
            return hold("PENDING", "this call's time budget is spent: the next call runs it")
        return None

    def _ort_ready(self) -> bool:
        if self._ort is None:
            self._ort = ort_ready(self.options)
        return self._ort

    def run(self, steps: list[Step]) -> list[Record]:
        """Every step's record, in order: kept from an earlier call, or decided, or run now."""
        self.options.work.records.mkdir(parents=True, exist_ok=True)
        self.options.work.logs.mkdir(parents=True, exist_ok=True)
        for step in steps:
            record = self.previous(step) or self._waiting(step) or self.execute(step)
            self.records[step.name] = record
            (self.options.work.records / f"{step.name}.json").write_text(json.dumps(asdict(record), indent=2) + "\n")
        return [self.records[s.name] for s in steps]

    def _limit(self, step: Step) -> tuple[float, bool]:
        """The seconds ``step`` may run, and whether that is the call's budget rather than its own timeout."""
        if self.deadline is None:
            return float(step.timeout), False
        left = self.deadline - time.monotonic()
        return (left, True) if left < step.timeout else (float(step.timeout), False)

    def execute(self, step: Step) -> Record:
        log = self.options.work.logs / f"{step.name}.log"
        limit, by_budget = self._limit(step)
        print(f"[gpu-check] {step.name}: {display(step.argv)}", flush=True)
        start = time.monotonic()
        with open(log, "w") as out:
            out.write(f"$ {display(step.argv)}\n")
            out.flush()
            proc = subprocess.Popen(step.argv, cwd=REPO, env=child_env(self.options.work), stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the step's own process group, started above
                proc.wait()
                rc = None
        seconds = round(time.monotonic() - start, 1)
        # stopped by the budget although it had (nearly) a whole call's: another call would stop it again
        whole_call = by_budget and self.budget is not None and limit >= 0.9 * self.budget
        status, note = outcome(step, rc, log, by_budget and not whole_call, seconds)
        if whole_call and rc is None:
            note = f"stopped after {seconds} s: it needs more than one call's budget ({self.budget:.0f} s)"
        print(f"[gpu-check] {step.name}: {status} in {seconds} s{': ' + note if note else ''}", flush=True)
        return Record(step.name, step.group, status, display(step.argv), seconds, rc, note,
                      str(log.relative_to(self.options.work.root)), step.kind)


def last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def outcome(step: Step, rc: int | None, log: Path, by_budget: bool, seconds: float) -> tuple[str, str]:
    """The status of a finished step and its note."""
    if rc is None and by_budget:
        return "PENDING", f"stopped after {seconds} s at this call's time budget: the next call runs it again"
    if rc is None:
        return "TIMEOUT", f"stopped at its {step.timeout} s limit"
    if rc == 0 and step.fail_on_skip and re.search(r"\d+ skipped", last_line(log)):
        return "FAIL", f"tests were skipped (on the GPU none should be): {last_line(log)}"
    if rc == 0:
        return ("XPASS", f"passed although {step.expect_fail}") if step.expect_fail else ("PASS", "")
    if step.expect_fail:
        return "XFAIL", f"{last_line(log)} ({step.expect_fail})"
    return "FAIL", f"exit {rc}: {last_line(log)}"


def prepare_work(work: Work, dry_run: bool, fresh: bool) -> str | None:
    """Bind the work folder to the mode (a dry run's records never count for a GPU run); a note if records were
    cleared."""
    mode = {"dry_run": dry_run}
    old = json.loads(work.mode_file.read_text()) if work.mode_file.is_file() else None
    note = None
    if fresh or (old is not None and old != mode):
        for folder in (work.records, work.logs):
            shutil.rmtree(folder, ignore_errors=True)
        work.env_file.unlink(missing_ok=True)
        note = "--fresh: earlier records cleared" if fresh else "the work folder held the other mode's records: cleared"
    work.root.mkdir(parents=True, exist_ok=True)
    work.mode_file.write_text(json.dumps(mode) + "\n")
    return note


def exit_status(records: list[Record]) -> int:
    """2 while a step is pending (run again), else 1 if a step failed or timed out, else 0."""
    if any(r.status == "PENDING" for r in records):
        return 2
    return 1 if any(r.status in FAILED for r in records) else 0
