"""`mla-deploy bench attention`: an end-to-end smoke run on the tiny preset (every path, one timed call; no timing
assertion) whose bench.json has every field the issue asks for; user errors are one line; the cost model."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from mla_deploy.cli import main

SMOKE = ["bench", "attention", "--preset", "tiny", "--context", "16", "--batch", "1,2", "--repeat", "1", "--warmup", "0",
         "--passes", "1", "--probe-mib", "16"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    result = CliRunner().invoke(main, SMOKE + ["--out", str(out)])
    assert result.exit_code == 0, result.output + (result.stderr or "")
    return result, out, json.loads((out / "bench.json").read_text())


def test_smoke_writes_every_output(smoke):
    """bench.json, bench.md and bench.png exist (no temporary leftovers) and the table is printed."""
    result, out, _ = smoke
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench.md", "bench.png"]
    assert (out / "bench.png").stat().st_size > 1000
    assert "ort-static" in result.stdout and "achieved/bound" in result.stdout
    assert "| path |" in (out / "bench.md").read_text()
    # the decode targets are defined for DeepSeek-V2-Lite only: none on tiny, no "1.5x target" line, no issue numbers
    assert json.loads((out / "bench.json").read_text())["targets"] == []
    assert "target" not in result.stdout + (out / "bench.md").read_text() and "issue" not in result.stdout


def test_smoke_json_has_every_field(smoke):
    """Every row: latency (median, spread), tokens/s, cache bytes per token and in total, peak memory, the
    roofline (bytes, FLOPs, both times, the bound, both fractions), the ratio to the naive path; the machine's
    measured bandwidth and GEMM rate and the thread count; each path's availability."""
    _, _, report = smoke
    assert report["format"] == "mla-deploy-bench"
    assert report["command"].startswith("mla-deploy bench attention --preset tiny --context 16 --batch 1,2 ")
    assert "attention sub-layer" in report["unit"]
    machine = report["machine"]
    assert machine["threads"] == 2
    for key in ("read_gbps", "gemm_gflops"):
        assert machine[key]["median"] > 0 and machine[key]["n"] >= 2
    paths = report["paths"]
    assert set(paths) == {"hf-eager", "hf-sdpa", "torch-cd", "torch-absorbed", "ort-concat", "ort-static", "trt"}
    for name, info in paths.items():
        assert isinstance(info["available"], bool)
        assert info["available"] or info["reason"]
    available = [p for p, info in paths.items() if info["available"]]
    assert {"torch-cd", "torch-absorbed", "ort-concat", "ort-static"} <= set(available)
    rows = report["rows"]
    assert {(r["path"], r["context"], r["batch"]) for r in rows} == {(p, 16, b) for p in available for b in (1, 2)}
    for row in rows:
        assert row["status"] == "ok", row
        lat = row["latency_ms"]
        assert lat["median"] > 0 and lat["p10"] <= lat["p90"] and len(lat["pass_medians"]) == 1
        assert math.isfinite(lat["pass_spread"])
        assert row["tokens_per_s"] == pytest.approx(row["batch"] * 1e3 / lat["median"])
        assert row["cache_bytes_per_token"] > 0 and row["cache_bytes_total"] > 0
        assert row["peak_memory_bytes"] > 0
        roof = row["roofline"]
        for key in ("bytes", "flops", "t_mem_ms", "t_flop_ms", "bound_ms", "bound_over_achieved",
                    "achieved_over_bound", "implemented_flops"):
            assert roof[key] > 0, key
        assert roof["bound_ms"] == pytest.approx(max(roof["t_mem_ms"], roof["t_flop_ms"]))
        assert roof["bound_over_achieved"] * roof["achieved_over_bound"] == pytest.approx(1.0)
        assert row["max_abs_diff"] is not None and row["max_abs_diff"] < 1e-4, row  # same function everywhere
    latent = report["model"]["latent_dim"] * 4 * report["model"]["layers_benched"]
    by_path = {(r["path"], r["batch"]): r for r in rows}
    assert by_path[("ort-static", 1)]["cache_bytes_per_token"] == latent
    assert by_path[("torch-cd", 1)]["cache_bytes_per_token"] > latent  # per-head K and V
    assert by_path[("ort-static", 2)]["cache_bytes_total"] == latent * 2 * (16 + 64)  # capacity T + 64
    assert by_path[("ort-static", 1)]["checks"]["in_place"] is True
    assert by_path[("ort-static", 1)]["static_speedup_over_concat"] > 0
    if paths["hf-eager"]["available"]:
        assert all(r["naive_path"] in ("hf-eager", "hf-sdpa") and r["speedup_vs_naive"] > 0 for r in rows)
    assert paths["ort-static"]["ort_copy_warnings"] == 0


@pytest.mark.parametrize("args, words", [
    pytest.param(["--context", "abc"], "--context", id="context_not_int"),
    pytest.param(["--context", "0"], "--context", id="context_zero"),
    pytest.param(["--batch", "1,,2"], "--batch", id="batch_empty_item"),
    pytest.param(["--paths", "ort-static,nope"], "--paths", id="unknown_path"),
    pytest.param(["--threads", "0"], "--threads", id="threads_zero"),
    pytest.param(["--repeat", "x"], "--repeat", id="repeat_not_int"),
    pytest.param(["--warmup", "-1"], "--warmup", id="warmup_negative"),
    pytest.param(["--passes", "0"], "--passes", id="passes_zero"),
    pytest.param(["--layers", "0"], "--layers", id="layers_zero"),
    pytest.param(["--max-seconds", "0"], "--max-seconds", id="max_seconds_zero"),
])
def test_invalid_option_is_one_line(tmp_path, args, words):
    """A bad value exits 1 with one `mla-deploy: error:` line naming the option, and writes nothing; the spelling
    from before the subcommands (`bench --preset ...`) reaches the same command and says the same."""
    said = []
    for bench in (["bench", "attention"], ["bench"]):
        result = CliRunner().invoke(main, [*bench, "--preset", "tiny", "--out", str(tmp_path / "o"), *args])
        assert result.exit_code == 1
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("mla-deploy: error: ") and words in lines[0], result.stderr
        assert not (tmp_path / "o").exists()
        said.append(lines[0])
    assert said[0] == said[1]


@pytest.mark.parametrize("args", [
    pytest.param([], id="no_source"),
    pytest.param(["--preset", "tiny", "--recipe", "x.toml"], id="two_sources"),
    pytest.param(["--preset", "no-such-model"], id="unknown_preset"),
])
def test_bad_source_is_one_line(tmp_path, args):
    result = CliRunner().invoke(main, ["bench", "attention", "--out", str(tmp_path / "o"), *args])
    assert result.exit_code == 1
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("mla-deploy: error: ")


def test_point_that_does_not_fit_is_reported_not_run():
    """A point whose estimated memory exceeds the allowance is reported as such before anything is allocated."""
    from mla_deploy.bench.attention.spec import BenchSpec
    from mla_deploy.bench.attention.worker import run_point
    from mla_deploy.recipe import load_recipe

    class Untouchable:
        def setup(self, inputs):  # pragma: no cover - must not be reached
            raise AssertionError("setup ran")

        teardown = step = setup

    spec = BenchSpec(config=load_recipe("deepseek-v2-lite").model, contexts=(1 << 30,), batches=(64,))
    record = run_point(Untouchable(), spec, "hf-eager", 1 << 30, 64, None)
    assert record["status"] == "does not fit"
    assert "GiB" in record["detail"] and record["memory_estimate_bytes"] > record["memory_available_bytes"]


def test_cost_model_for_v2_lite():
    """V2-Lite attention: 55,050,240 weight bytes per layer (q_proj + kv_a + kv_b + o_proj, fp32), a 576-wide
    latent row (2304 B per token per layer) against 20480 B of per-head K/V; FLOPs and bytes grow with B*T."""
    from mla_deploy.bench.attention.roofline import cache_bytes_per_token, matrix_params, step_cost
    from mla_deploy.recipe import load_recipe

    c = load_recipe("deepseek-v2-lite").model
    assert matrix_params(c) * 4 == 55_050_240
    assert cache_bytes_per_token(c, "ort-static") == 2304
    assert cache_bytes_per_token(c, "torch-cd") == 16 * (192 + 128) * 4
    one, big = step_cost(c, 1, 4096, 1), step_cost(c, 2, 4096, 8)
    assert one["cache_bytes"] == 4096 * 576 * 4
    assert big["bytes"] == 2 * (one["weight_bytes"] + 8 * one["cache_bytes"])
    assert one["flops"] == 2 * matrix_params(c) + 2 * 16 * 4097 * (576 + 512)


def test_killed_worker_is_reported_and_the_run_goes_on(tmp_path, monkeypatch):
    """A worker killed at a point (as the OOM killer would) leaves that point reported as out of memory;
    the driver restarts the variant on the points it had not reached and the run completes."""
    from mla_deploy.bench.attention.spec import BenchSpec
    from mla_deploy.bench.harness import KILL_AT_ENV
    from mla_deploy.bench.attention.driver import run_bench
    from mla_deploy.recipe import load_recipe

    monkeypatch.setenv(KILL_AT_ENV, "torch-absorbed:8:1")
    spec = BenchSpec(config=load_recipe("tiny").model, contexts=(8, 16), batches=(1,), repeat=1, warmup=0,
                     passes=1, paths=("torch-absorbed",), probe_mib=16)
    report = run_bench(spec, tmp_path)
    rows = {(r["context"], r["batch"]): r for r in report["rows"]}
    assert rows[(8, 1)]["status"] == "out of memory" and "signal 9" in rows[(8, 1)]["detail"]
    assert rows[(16, 1)]["status"] == "ok"
    assert report["paths"]["torch-absorbed"]["worker_restarts"] == 1
    assert "out of memory" in (tmp_path / "bench.md").read_text()


def test_bandwidth_probe_takes_the_fastest_read_kernel():
    """The read bandwidth is the best of several kernels (one kernel alone underestimates the memory), each
    counted by its fastest call, and the probe records which one it was and what each read."""
    from mla_deploy.bench.machine import probe

    result = probe(1, probe_mib=16, reps=3)
    by_kernel = result["read_gbps_by_kernel"]
    assert set(by_kernel) == set(result["read_kernels"]) == set(result["read_median_gbps_by_kernel"])
    assert {"torch.sum", "torch.amax", "torch.mv", "numpy.sum", "torch.copy_"} == set(by_kernel)  # 1 thread: no split
    assert result["read_kernel"] == max(by_kernel, key=by_kernel.get)
    assert result["read_gbps"] == pytest.approx(max(by_kernel.values()), abs=0.01)
    for name, fastest in by_kernel.items():
        assert fastest >= result["read_median_gbps_by_kernel"][name]
    assert result["gemm_gflops"] > 0 and result["read_mib"] == 16 and not result["pinned_threads"]
    assert isinstance(result["huge_pages"], bool)


def test_bandwidth_probe_splits_the_read_over_pinned_threads():
    """With 2 threads the sum and the matrix-vector product also run split over 2 threads, each pinned to its own
    CPU (Linux), and the threads' CPUs are the ones this process may use."""
    import os
    import threading

    from mla_deploy.bench.machine import PinnedThreads, read_bandwidth

    result = read_bandwidth(2, probe_mib=16, reps=2)
    assert {"torch.sum x2 pinned", "torch.mv x2 pinned"} <= set(result["read_gbps_by_kernel"])
    assert result["pinned_threads"]
    if not hasattr(os, "sched_getaffinity"):
        return
    allowed, seen = sorted(os.sched_getaffinity(0)), []
    pool = PinnedThreads(2)
    lock = threading.Lock()

    def record():
        with lock:
            seen.append(sorted(os.sched_getaffinity(0)))

    pool.run([record, record])
    pool.close()
    assert sorted(seen) == sorted([[allowed[0]], [allowed[1 % len(allowed)]]])
    assert sorted(os.sched_getaffinity(0)) == allowed  # the caller's own affinity is untouched


def test_a_failing_call_on_a_pinned_thread_reaches_the_caller():
    from mla_deploy.bench.machine import PinnedThreads

    pool = PinnedThreads(2)

    def fail():
        raise ValueError("planted")

    with pytest.raises(ValueError, match="planted"):
        pool.run([lambda: None, fail])
    pool.run([lambda: None, lambda: None])  # the threads still serve
    pool.close()


def test_the_bound_check_names_an_engine_faster_than_the_bound():
    """A step streaming more bytes (or FLOPs) per second than measured means the measurement is no bound: the
    line says so plainly; below it, the line names the fastest step."""
    from mla_deploy.bench.bound import bound_check_line, check_bound

    held = check_bound({"ours decode": (20.0, 5.0), "llama.cpp F32": (30.0, 0.0)}, 31.0, 40.0)
    assert held["holds"] and held["fastest"] == "llama.cpp F32" and held["fastest_gbps"] == 30.0
    assert bound_check_line(held).startswith("bound check: the measured read bandwidth 31.0 GB/s and GEMM rate 40")
    broken = check_bound({"ours decode": (20.0, 5.0), "llama.cpp F32": (34.0, 0.0)}, 26.9, None)
    assert not broken["holds"] and [b["label"] for b in broken["beaten_by"]] == ["llama.cpp F32"]
    line = bound_check_line(broken)
    assert line.startswith("THE BOUND DID NOT HOLD in this run: 1 measured step(s)")
    assert "llama.cpp F32 streamed 34.0 GB/s against the measured 26.9 GB/s" in line and "GEMM" not in line
    compute = check_bound({"ours prefill": (1.0, 90.0)}, 30.0, 80.0)
    assert not compute["holds"]


def test_report_names_the_read_kernels(smoke):
    _, _, report = smoke
    probe = report["machine"]["read_probe"]
    assert probe.startswith("the fastest call of the fastest of torch.sum, torch.amax, torch.mv, numpy.sum, "
                            "torch.copy_, torch.sum x2 pinned, torch.mv x2 pinned over 16 MiB")
    assert "the bound takes the best probe (max)" in probe
    assert "at the start and the end of every worker process" in probe
