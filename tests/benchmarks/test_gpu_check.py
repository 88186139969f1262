"""benchmarks/gpu_check.sh, the GPU check of docs/gpu-verification.md, on the CPU: its dry run on the tiny preset end to
end (real exports, real ONNX Runtime sessions), a failing step recorded while the next ones still run, the time
budget, the wheel parts packed and joined, and the report's reading of the kernel benchmark."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_check import plan as call_plan  # noqa: E402
from gpu_check import report, steps, wheels  # noqa: E402
from gpu_check import runner as runner_mod  # noqa: E402
from gpu_check.layout import MiB, Work  # noqa: E402


def gpu_check(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, GPU_CHECK_PYTHON=sys.executable, OMP_NUM_THREADS="1")
    env.pop("OUT", None)
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=timeout)


def statuses(out: Path) -> dict[str, str]:
    return {r["name"]: r["status"] for r in json.loads((out / "steps.json").read_text())}


@pytest.mark.slow
def test_dry_run_of_the_tiny_preset(tmp_path):
    """The GPU steps are SKIPPED with the reason; export, run, the in-place cache check, validate and doctor pass on
    the CPU provider; the doc holds their figures and the committed how-to-run section; a second call keeps the
    records instead of running the steps again."""
    work, out = tmp_path / "work", tmp_path / "out"
    args = ("run", "--dry-run", "--models", "tiny", "--precisions", "fp16", "--work", str(work), "--out", str(out))
    proc = gpu_check(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = statuses(out)
    gpu = {"nvidia-smi", "kernel-tests", "plugin-tests", "kernel-bench", "ort-cuda-load", "gpu-engine-tests",
           "gpu-kernel-bench-graphs"}
    assert {name for name, status in found.items() if status == "SKIPPED"} == gpu
    assert set(found.values()) == {"SKIPPED", "PASS"}
    doc = (out / "gpu-verification.md").read_text()
    assert "**Status: dry run on the CPU" in doc and "not a GPU verification" in doc
    assert "**kernel-bench**: SKIPPED. dry run: needs a CUDA GPU" in doc
    assert "`exported tiny to " in doc and "fp16, static cache" in doc
    assert "provider CPUExecutionProvider, fp16, static cache" in doc
    assert "same address after a decode step True, only the new rows changed True" in doc
    assert "`validation passed:" in doc
    assert "- CPUExecutionProvider: loads" in doc  # doctor's findings
    assert "| onnxruntime_package |" in doc  # the versions table
    assert report.how_to_run() in doc
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert {"logs/run-tiny-fp16.log", "validate/tiny-fp16/report.md"} <= set(tar.getnames())
    again = gpu_check(*args)
    assert again.returncode == 0 and "[gpu-check] export-tiny-fp16:" not in again.stdout
    assert statuses(out) == found


def test_a_failing_step_is_recorded_and_the_next_steps_still_run(tmp_path):
    """An export recorded as passed but whose folder holds no artifact: run, the cache check and validate each fail
    with their one-line error, each still runs, and the exit status is 1."""
    work, out = Work(tmp_path / "work"), tmp_path / "out"
    (work.artifacts / "tiny-fp16").mkdir(parents=True)
    work.records.mkdir(parents=True)
    (work.records / "export-tiny-fp16.json").write_text(json.dumps(
        {"name": "export-tiny-fp16", "group": "export", "status": "PASS", "command": "planted", "rc": 0}))
    proc = gpu_check("run", "--dry-run", "--models", "tiny", "--precisions", "fp16", "--work", str(work.root),
                     "--out", str(out), "--steps", "run-tiny-fp16,static-tiny-fp16,validate-tiny-fp16")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    found = statuses(out)
    assert [found[f"{s}-tiny-fp16"] for s in ("run", "static", "validate")] == ["FAIL"] * 3
    assert found["versions"] == "SKIPPED" and found["nvidia-smi"] == "SKIPPED"
    records = {r["name"]: r for r in json.loads((out / "steps.json").read_text())}
    assert records["run-tiny-fp16"]["note"].startswith("exit 1: mla-deploy: error: ")  # the CLI's one line
    assert records["static-tiny-fp16"]["note"].startswith("exit 1: static: ")  # the probe's, not a traceback
    assert "| run-tiny-fp16 | FAIL |" in (out / "gpu-verification.md").read_text()


def test_a_spent_budget_leaves_the_steps_pending(tmp_path):
    proc = gpu_check("run", "--dry-run", "--models", "tiny", "--work", str(tmp_path / "work"), "--out",
                     str(tmp_path / "out"), "--budget", "1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    found = statuses(tmp_path / "out")
    assert found["export-tiny-fp16"] == "PENDING" and found["kernel-bench"] == "SKIPPED"
    assert "PASS" not in found.values()


def test_a_step_the_budget_stops_runs_again_in_the_next_call_unless_it_had_a_whole_call(tmp_path):
    """Started with part of the budget left, a stopped step is PENDING and the next call (same work folder, a
    passed step kept) runs it again; stopped although it had the whole budget, it is a TIMEOUT (another call
    would stop it again)."""
    options = steps.Options(Work(tmp_path / "work"), dry_run=True)
    sleep = lambda s: (sys.executable, "-c", f"import time; time.sleep({s})")  # noqa: E731
    plan = [steps.Step("quick", "env", sleep(1.0), 60), steps.Step("slow", "env", sleep(30), 60)]

    def call():
        runner = runner_mod.Runner(options, budget=4.0)
        runner.min_start = 0.2
        return {r.name: r for r in runner.run(plan)}

    first = call()
    assert first["quick"].status == "PASS" and first["slow"].status == "PENDING"
    assert "time budget" in first["slow"].note
    second = call()
    assert second["quick"].finished == first["quick"].finished  # kept, not run again
    assert second["slow"].status == "TIMEOUT" and "more than one call's budget" in second["slow"].note
    assert runner_mod.exit_status(list(second.values())) == 1


def test_the_plan_of_steps_by_mode():
    """bf16 does not run on the CPU provider in a dry run but does on the GPU; tiny bf16's validation is an
    expected failure; the decode timing waits for its export."""
    work = Work(Path("/nonexistent"))
    dry = {s.name: s for s in steps.plan(steps.Options(work, dry_run=True))}
    gpu = {s.name: s for s in steps.plan(steps.Options(work, dry_run=False))}
    assert dry["run-tiny-bf16"].skip == steps.NO_BF16_ON_CPU and gpu["run-tiny-bf16"].skip is None
    assert "--provider" in gpu["validate-v2lite4-int4-bf16"].argv and "cuda" in gpu["validate-v2lite4-int4-bf16"].argv
    assert gpu["validate-tiny-bf16"].expect_fail and not gpu["validate-tiny-fp16"].expect_fail
    assert gpu["decode-bf16"].after == ("export-v2lite4-int4-bf16",) and gpu["decode-bf16"].gpu
    assert "tests/plugins/test_kernel.py" in gpu["kernel-tests"].argv
    # the TensorRT modules skip whole on a machine without TensorRT, and a skip fails the step (the H200 run of
    # 2026-11-26 failed on exactly that): they are not collected
    assert [a for a in gpu["kernel-tests"].argv if a.startswith("tests/")] == ["tests/plugins/test_kernel.py"]
    assert "bench-whole" not in gpu  # superseded by the gpu-decode group's `bench model --provider cuda`


def _wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("pkg/__init__.py", "x = 1\n" * 5000)
        z.writestr("pkg/data.bin", os.urandom(300_000))  # incompressible, like a CUDA fatbin
        z.writestr("pkg-1.0.dist-info/RECORD", "pkg/__init__.py,,\n")
    return path


def test_wheel_parts_join_into_the_same_wheel_and_damage_is_refused(tmp_path):
    wheel, pack = _wheel(tmp_path / "pkg-1.0-py3-none-any.whl"), tmp_path / "pack"
    packed = wheels.pack_wheel(wheel, pack, limit=100_000)
    assert len(packed["parts"]) == 4 and all(p["bytes"] <= 100_000 for p in packed["parts"])
    manifest = {"id": "test", "packed": packed, "wheels": []}
    joined = wheels.join_parts(manifest, pack, tmp_path / "out")
    with zipfile.ZipFile(wheel) as a, zipfile.ZipFile(joined) as b:
        assert [(i.filename, a.read(i)) for i in a.infolist()] == [(i.filename, b.read(i)) for i in b.infolist()]
        assert {i.compress_type for i in b.infolist()} == {zipfile.ZIP_STORED}
    damaged = pack / packed["parts"][2]["file"]
    data = bytearray(damaged.read_bytes())
    data[100] ^= 1
    damaged.write_bytes(bytes(data))
    with pytest.raises(wheels.PackError, match="part-2.* is damaged"):
        wheels.join_parts(manifest, pack, tmp_path / "out")
    damaged.unlink()
    assert wheels.missing_parts(manifest, pack) == [packed["parts"][2]["file"]]


def test_install_waits_for_the_missing_parts(tmp_path, capsys):
    wheel, pack = _wheel(tmp_path / "pkg-1.0-py3-none-any.whl"), tmp_path / "pack"
    packed = wheels.pack_wheel(wheel, pack, limit=200_000)
    manifest = {"id": "test", "packed": packed, "wheels": []}
    for index in range(len(packed["parts"])):
        (pack / f"part-{index}" / "manifest.json").write_text(json.dumps(manifest))
    (pack / packed["parts"][1]["file"]).unlink()
    assert wheels.install(Work(tmp_path / "work"), pack) == 3
    assert f"waiting for {packed['parts'][1]['file']}" in capsys.readouterr().out


def _bench_log(shares: dict[tuple[int, int], float]) -> str:
    """Lines as plugins/mla_decode/bench.py prints them, at a copy bandwidth of 3000 GB/s."""
    lines = ["GPU NVIDIA H100 80GB HBM3; device-to-device copy 3000 GB/s (read + write)",
             f"{'batch':>5} {'heads':>5} {'length':>7} {'splits':>6} {'us':>9} {'GB/s':>8} {'of copy':>8} {'max rel err':>11}"]
    for (batch, length), share in shares.items():
        lines.append(f"{batch:>5} {128:>5} {length:>7} {4:>6} {12.5:>9.1f} {share * 3000:>8.0f} {share:>8.1%} "
                     f"{float('nan') if batch > 8 else 1e-3:>11.2e}")
    return "\n".join(lines)


def test_the_kernel_benchmark_is_read_against_the_80_percent_target():
    low = report.read_kernel_bench(_bench_log({(1, 4096): 0.3, (32, 4096): 0.79, (64, 32768): 0.9}))
    assert "3000 GB/s" in low[0] and "| 32 | 128 | 4096 | 4 | 12.5 | 2370 | 79.0% | nan |" in low
    assert low[-1].startswith("At batch >= 32 and context >= 4096: 79.0% to 90.0%") and "misses it" in low[-1]
    high = report.read_kernel_bench(_bench_log({(1, 1024): 0.2, (32, 4096): 0.81, (64, 8192): 0.85}))
    assert "meets it" in high[-1]
    assert report.read_kernel_bench("Traceback ...") == ["no table in the log"]


def test_the_plan_keeps_every_call_under_64_mib_and_the_doc_holds_it():
    parts = [{"file": f"part-{i}/ort.whl.xz.{i:02d}", "bytes": 50 * MiB, "sha256": ""} for i in range(4)]
    manifest = {"versions": dict(wheels.WHEELS), "wheels": [{"file": "part-0/polygraphy.whl", "bytes": MiB // 2}],
                "packed": {"parts": parts, "stored_bytes": 330 * MiB, "xz_bytes": 200 * MiB}}
    section = call_plan.markdown(manifest, tree=2 * MiB)
    for i in range(4):
        assert f'`[".whl/gpu-check/part-{i}"]`' in section
    assert "50.5 MiB" in section and "would exceed" not in section
    assert "would exceed 64 MiB" in call_plan.markdown(manifest, tree=14 * MiB)
    committed = (ROOT / "docs" / "gpu-verification.md").read_text()
    assert "**Status: not yet run on a GPU" in committed or "**Status: run on NVIDIA" in committed
    assert report.HOW_TO_RUN[0] in committed and call_plan.COMMAND in report.how_to_run()


def test_the_gpu_decode_group_of_issue_48():
    """On the GPU: the 4-layer V2-Lite int4 in bf16, exported in both expert forms; the branches form profiled with
    its CPU nodes allowed; the fused form validated on CUDA and timed with and without CUDA graphs and fpA_intB,
    then beside the torch.compile peer; the CUDA engine's tests in a step of their own (they need the carried
    onnxruntime-gpu, so the kernel tests leave them out); the kernel bench under CUDA-graph timing. In a dry run:
    the tiny preset in fp16, validated on the CPU, each bench as its --dry-run plan."""
    work = Work(Path("/nonexistent"))
    gpu = {s.name: s for s in steps.plan(steps.Options(work)) if s.group == "gpu-decode"}
    assert list(gpu) == ["gpu-export-branches", "gpu-export-fused", "gpu-profile-branches", "gpu-validate-fused",
                         "gpu-bench-fused", "gpu-peer", "gpu-engine-tests", "gpu-kernel-bench-graphs"]
    export = " ".join(gpu["gpu-export-fused"].argv)
    assert "--preset deepseek-v2-lite --layers 4 --weights int4 --max-cache-length 4352 --precision bf16" in export
    assert "--experts auto" in export and "--experts branches" in " ".join(gpu["gpu-export-branches"].argv)
    profile = " ".join(gpu["gpu-profile-branches"].argv)
    assert "--provider cuda" in profile and "--allow-cpu-nodes" in profile and "--no-transformers" in profile
    fused = " ".join(gpu["gpu-bench-fused"].argv)
    assert "--variants graph,eager,graph-fpa --batch 1,8,32,64 --context 0,1024,4096" in fused
    assert "--no-transformers" not in " ".join(gpu["gpu-peer"].argv) and gpu["gpu-peer"].gpu
    assert "--provider cuda" in " ".join(gpu["gpu-validate-fused"].argv)
    assert [a for a in gpu["gpu-engine-tests"].argv if a.startswith("tests/")] == [
        "tests/ort/test_cuda_engine.py", "tests/serve/test_cuda_serve.py"]
    assert gpu["gpu-engine-tests"].needs_ort and gpu["gpu-engine-tests"].fail_on_skip
    kernel_tests = steps.plan(steps.Options(work))[2]
    assert kernel_tests.name == "kernel-tests" and "gpu and not trt and not ort_cuda" in kernel_tests.argv
    assert "--timing" in gpu["gpu-kernel-bench-graphs"].argv and "cudagraph" in gpu["gpu-kernel-bench-graphs"].argv
    dry = {s.name: s for s in steps.plan(steps.Options(work, dry_run=True, models=("tiny",)))}
    assert "--preset tiny --precision fp16" in " ".join(dry["gpu-export-fused"].argv)
    assert dry["gpu-bench-fused"].argv[-1] == "--dry-run" and not dry["gpu-bench-fused"].gpu
    assert "cpu" in dry["gpu-validate-fused"].argv
    selected = set(steps.GPU_DECODE_SELECTION.split(","))
    assert selected <= set(steps.GROUPS) | set(gpu) | {"ort-cuda-load"}
    assert call_plan.DECODE_COMMAND in (ROOT / "docs" / "gpu-verification.md").read_text()


@pytest.mark.slow
def test_dry_run_of_the_gpu_decode_group(tmp_path):
    """The group's command lines hold on the CPU: both exports, validate on the CPU provider, and every `bench model
    --provider cuda` as its plan; the report has the section and each bench's plan line."""
    work, out = tmp_path / "work", tmp_path / "out"
    proc = gpu_check("run", "--dry-run", "--models", "tiny", "--precisions", "fp16", "--steps", "gpu-decode",
                     "--work", str(work), "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = {k: v for k, v in statuses(out).items() if k.startswith("gpu-")}
    assert found == {**{name: "PASS" for name in ("gpu-export-branches", "gpu-export-fused", "gpu-profile-branches",
                                                   "gpu-validate-fused", "gpu-bench-fused", "gpu-peer")},
                     "gpu-engine-tests": "SKIPPED", "gpu-kernel-bench-graphs": "SKIPPED"}
    doc = (out / "gpu-verification.md").read_text()
    assert "## GPU decode (issue 48)" in doc
    assert "`plan: tiny (2 layers, fp16, float weights) on ONNX Runtime's CUDA provider`" in doc
    assert "`variant graph-fpa: provider options" in doc
