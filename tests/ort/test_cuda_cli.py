"""The CUDA provider from the command line, on a machine where it does not load: `run`, `validate` and `bench model
--provider cuda` refuse in one line before anything runs; the GPU bench's plan (`--dry-run`) needs no GPU; its
table reads a report as the GPU run writes it."""

from __future__ import annotations

import pytest

from artifacts import tiny_artifact
from cli_run import cli
from mla_deploy.bench.whole_model import gpu
from mla_deploy.errors import ConfigError, RuntimeMissingError


def _cuda_loads() -> bool:
    import onnxruntime as ort

    from mla_deploy.ort.cuda import require_cuda

    try:
        require_cuda(ort)
    except RuntimeMissingError:
        return False
    return True


@pytest.fixture(scope="module")
def artifact():
    return tiny_artifact("static", "fp16")


def test_every_command_refuses_a_cuda_provider_that_does_not_load_in_one_line(artifact, tmp_path):
    if _cuda_loads():
        pytest.skip("ONNX Runtime's CUDA provider loads here: nothing to refuse")
    commands = [("run", artifact, "--prompt-ids", "1,2,3", "--provider", "cuda"),
                ("run", artifact, "--prompt-ids", "1,2,3", "--provider", "cuda", "--no-cuda-graph", "--fpa-intb",
                 "--allow-cpu-nodes"),
                ("validate", artifact, "--provider", "cuda", "--out", tmp_path / "report"),
                ("bench", "model", "--artifact", artifact, "--provider", "cuda", "--context", "0,16", "--repeat", "4",
                 "--out", tmp_path / "bench")]
    for args in commands:
        result = cli(*args)
        assert result.returncode == 1, (args, result.stderr)
        assert result.stderr.strip().splitlines() == [
            "mla-deploy: error: ONNX Runtime could not use CUDAExecutionProvider (it fell back to "
            "CPUExecutionProvider); run `mla-deploy doctor`"], args
    assert not (tmp_path / "bench" / "gpu-bench.json").exists()


def test_serve_refuses_a_cuda_provider_that_does_not_load_in_one_line():
    pytest.importorskip("transformers")
    pytest.importorskip("uvicorn")
    if _cuda_loads():
        pytest.skip("ONNX Runtime's CUDA provider loads here: nothing to refuse")
    from artifacts import text_artifact

    result = cli("serve", text_artifact("static"), "--port", "0", "--provider", "cuda", "--no-cuda-graph")
    assert result.returncode == 1 and result.stderr.strip().splitlines()[-1] == (
        "mla-deploy: error: ONNX Runtime could not use CUDAExecutionProvider (it fell back to CPUExecutionProvider); "
        "run `mla-deploy doctor`"), result.stderr


def test_the_gpu_bench_plan_runs_without_a_gpu(artifact):
    result = cli("bench", "model", "--artifact", artifact, "--provider", "cuda", "--dry-run", "--context", "0,16",
                 "--repeat", "4", "--variants", "graph,eager,graph-fpa")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "plan: tiny (2 layers, fp16, float weights) on ONNX Runtime's CUDA provider"
    assert "  variant graph: provider options {'device_id': '0', 'enable_cuda_graph': '1'}, session entries " \
           "{'session.disable_cpu_ep_fallback': '1'}" in lines
    assert any("variant graph-fpa" in line and "'ep.cuda.fpa_intb_gemm': '1'" in line for line in lines)
    assert sum(line.startswith("  context ") for line in lines) == 2 * 4  # batches 1, 8, 32, 64 by default
    assert "peer: transformers" in result.stdout and "reduce-overhead" in result.stdout


def test_the_plan_bounds_and_refusals(artifact):
    planned = gpu.plan(gpu.GpuBenchSpec(str(artifact), contexts=(0, 16), repeat=4))
    bound = {(p["context"], p["batch"]): p["bound_bytes"] for p in planned["points"]}
    assert bound[(0, 1)] > 0 and bound[(16, 64)] > bound[(16, 1)] > bound[(0, 1)]  # the cache's rows count
    with pytest.raises(ConfigError, match="--variants takes"):
        gpu.GpuBenchSpec(str(artifact), variants=("graphs",))
    with pytest.raises(ConfigError, match="needs 4125"):
        gpu.plan(gpu.GpuBenchSpec(str(artifact)))  # context 4096 does not fit the tiny export's 64 rows
    assert gpu.GpuBenchSpec(str(artifact), allow_cpu_nodes=True).options("eager").strict_placement is False


def test_the_gpu_bench_table():
    report = {"plan": {"model": "m", "precision": "bf16", "weights": "int4",
                       "points": [{"context": 0, "batch": 1, "bound_bytes": 4_000_000_000}]},
              "gpu": "NVIDIA H200", "copy_gbps": 4000.0,
              "variants": [{"variant": "graph", "cuda_graph": "on, 1 captured", "token_choice": "device", "cuda": {},
                            "rows": [{"context": 0, "batch": 1, "ms_per_token": 2.0, "kernels_per_step": 310.0,
                                      "busy_fraction": 0.9}]},
                           {"variant": "eager", "cuda_graph": "off", "token_choice": "device", "cuda": {},
                            "rows": [{"context": 0, "batch": 1, "error": "out of memory"}]}],
              "peer": {"rows": [{"context": 0, "batch": 1, "ms_per_token": 3.0}]}}
    table = gpu.format_table(report)
    assert "| 0 | 1 | 2.000 | 310 | 90% | error: out of memory |  |  | 3.000 | 1.000 | 2.0x |" in table
    assert "graph: CUDA graphs on, 1 captured; tokens chosen on the device" in table
