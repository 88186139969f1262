"""The process harness both benches run on, with a real worker process (a small module using the harness's
worker side, no torch): a process killed at a point is restarted on the points after it, one that dies before
its first point is a failure, the thread environment is pinned, and an interrupt in the driver kills the child."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time

import pytest

from mla_deploy.bench.harness import KILL_AT_ENV, Results, child, run_points

WORKER = textwrap.dedent('''
    import os, sys
    from mla_deploy.bench.harness import Results, load_job

    job = load_job(sys.argv[1])
    if job.get("crash"):
        raise SystemExit("cannot start: " + job["crash"])
    result = Results(job, threads=os.environ["OMP_NUM_THREADS"])
    print("started", flush=True)
    result.run("fake", job["points"], lambda p: {"status": "ok", "value": p[0] * p[1]})
    sys.exit(result.finish())
''')


@pytest.fixture
def worker(tmp_path, monkeypatch):
    (tmp_path / "fake_bench_worker.py").write_text(WORKER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    work = tmp_path / "work"
    work.mkdir()
    return work


def test_a_killed_process_is_restarted_on_the_points_after_it(worker, monkeypatch):
    monkeypatch.setenv(KILL_AT_ENV, "fake:2:3")
    lines = []
    runs = run_points("fake_bench_worker", {}, [[1, 1], [2, 3], [4, 5]], worker, "fake run", 3, lines.append,
                      stream=True)
    by_point = {tuple(r["point"]): r for r in runs.records}
    assert by_point[(1, 1)] == {"point": [1, 1], "status": "ok", "value": 1}
    assert by_point[(2, 3)]["status"] == "out of memory" and "signal 9" in by_point[(2, 3)]["detail"]
    assert by_point[(4, 5)]["value"] == 20
    assert runs.restarts == 1 and runs.failure is None and runs.missing == []
    assert [r.get("threads") for r in runs.results] == ["3", "3"]  # OMP_NUM_THREADS pinned in every process
    assert "  started" in lines and any("stopped at [2, 3]" in line for line in lines)


def test_a_process_that_dies_before_its_first_point_is_a_failure(worker):
    runs = run_points("fake_bench_worker", {"crash": "no model"}, [[1, 1], [2, 2]], worker, "fake", 1,
                      lambda line: None)
    assert runs.records == [] and runs.missing == [[1, 1], [2, 2]] and runs.restarts == 0
    assert runs.failure == "the fake process failed (exit 1): cannot start: no model before its first point"


def test_an_interrupt_in_the_driver_kills_the_worker():
    with pytest.raises(KeyboardInterrupt):
        with child([sys.executable, "-c", "import time; time.sleep(60)"]) as proc:
            time.sleep(0.2)
            raise KeyboardInterrupt
    assert proc.returncode == -signal.SIGKILL  # killed and reaped, not left running


def test_results_name_the_point_being_run(tmp_path):
    """The result file names the point while it runs, so a process killed there leaves which one it was."""
    seen = []
    result = Results({"result": str(tmp_path / "r.json")})
    result.run("x", ["a", "b"], lambda p: seen.append(result.data["current"]) or {"status": "ok"})
    assert seen == ["a", "b"] and result.data["current"] is None
    assert [r["point"] for r in result.data["points"]] == ["a", "b"]
    assert result.finish() == 0 and '"done": true' in (tmp_path / "r.json").read_text()
