"""``mla-deploy build`` and ``mla-deploy doctor``: exit codes and output, through click's CliRunner and a real process."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from mla_deploy.cli import main

TRT_AND_GPU = importlib.util.find_spec("tensorrt") is not None and torch.cuda.is_available()
no_trt = pytest.mark.skipif(TRT_AND_GPU, reason="TensorRT and a GPU are present: `build` would build")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mla_deploy", *args], capture_output=True, text=True, env=ENV,
                          timeout=300)


@no_trt
def test_build_without_tensorrt_is_one_line_and_exit_1(tmp_path):
    result = CliRunner().invoke(main, ["build", str(tmp_path / "artifact")])
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mla-deploy: error: TensorRT engines need TensorRT")
    assert result.stdout == ""


@no_trt
def test_build_without_tensorrt_in_a_real_process(tmp_path):
    proc = _cli("build", str(tmp_path))
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    missing = [m for m, absent in (("TensorRT is not installed", importlib.util.find_spec("tensorrt") is None),
                                   ("no CUDA GPU", not torch.cuda.is_available())) if absent]
    assert all(m in lines[0] for m in missing) and "Traceback" not in proc.stderr and proc.stdout == ""


def test_build_help_lists_its_options():
    result = CliRunner().invoke(main, ["build", "--help"])
    assert result.exit_code == 0
    for option in ("--workspace-mib", "--strongly-typed / --weakly-typed", "--no-timing-cache", "--opt-level"):
        assert option in result.stdout


def test_doctor_reports_versions_providers_and_commands():
    result = CliRunner().invoke(main, ["doctor"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert f"torch        {torch.__version__}" in out
    assert "CPUExecutionProvider         loads" in out  # really created a session on it
    assert "polygraphy   " in out and "tensorrt     " in out
    build_line = next(line for line in out.splitlines() if line.strip().startswith("build (TensorRT)"))
    cpu_line = next(line for line in out.splitlines() if line.strip().startswith("build --target cpu"))
    assert cpu_line.split()[3] == "yes,"  # the CPU engine builds wherever ONNX Runtime runs
    for command in ("inspect", "export", "run", "serve", "validate", "bench"):  # every command is listed
        assert any(line.split()[:1] == [command] for line in out.splitlines()), command
    if TRT_AND_GPU:
        assert build_line.split()[-1] == "yes"
    else:
        assert "no: needs" in build_line
    if not torch.cuda.is_available():
        assert "CUDAExecutionProvider        does not load" in out  # listed by onnxruntime-gpu, yet unusable
        assert "GPU          none" in out


def test_doctor_json_in_a_real_process():
    proc = _cli("doctor", "--json", "--no-providers")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["torch"] == torch.__version__ and info["cuda_available"] == torch.cuda.is_available()
    assert info["onnxruntime"]["loaded"] is None and "CPUExecutionProvider" in info["onnxruntime"]["listed"]
    assert set(info["commands"]) >= {"inspect", "export", "run", "serve", "validate", "bench", "build --target cpu",
                                      "build (TensorRT)"}
    assert info["commands"]["export"] == "yes"


def test_a_dense_model_is_not_refused_for_experts_it_does_not_have():
    """The tiny preset is dense: its graphs' entries record an experts form, but it has no routed experts, so the
    TensorRT check has nothing to refuse (a MoE artifact with fused experts is refused: tests/exporter/
    test_moe_graph.py)."""
    from artifacts import tiny_artifact
    from mla_deploy.artifact import load_manifest
    from mla_deploy.trt.build import check_buildable

    artifact = tiny_artifact()
    manifest = load_manifest(artifact)
    assert not manifest.config.is_moe and {e.experts for e in manifest.graphs.values()} == {"fused"}
    check_buildable(manifest, artifact)  # raises nothing
