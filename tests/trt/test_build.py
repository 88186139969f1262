"""The engine build without TensorRT: the runtime check, precision handling per TensorRT version, the build
plan, and the build record writer/reader."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
import types

import pytest
import torch

from mla_deploy.errors import ArtifactError, ConfigError, RuntimeMissingError
from mla_deploy.trt.build import (BUILD_RECORD, RECORD_FORMAT, build_engines, build_plan, build_record, role_profiles,
                                  precision_flags, read_build_record, require_tensorrt, trt_major, write_build_record)

TRT_AND_GPU = importlib.util.find_spec("tensorrt") is not None and torch.cuda.is_available()


# the runtime check -------------------------------------------------------------------------------
def test_require_tensorrt_names_both_missing_pieces(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt -> ModuleNotFoundError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeMissingError) as info:
        require_tensorrt()
    message = str(info.value)
    assert "\n" not in message
    assert "TensorRT is not installed" in message and "no CUDA GPU" in message


def test_require_tensorrt_names_only_the_missing_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", types.ModuleType("tensorrt"))  # importable, never used here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeMissingError, match="no CUDA GPU") as info:
        require_tensorrt()
    assert "not installed" not in str(info.value)


def test_require_tensorrt_names_only_the_missing_tensorrt(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeMissingError, match="TensorRT is not installed") as info:
        require_tensorrt()
    assert "GPU is visible" not in str(info.value)


@pytest.mark.skipif(TRT_AND_GPU, reason="TensorRT and a GPU are present: the build would start")
def test_build_checks_the_runtime_before_anything(tmp_path):
    with pytest.raises(RuntimeMissingError, match="TensorRT engines need"):
        build_engines(tmp_path / "no-such-artifact")  # the missing artifact is not what is reported


# precision per TensorRT version ------------------------------------------------------------------
def test_trt_major():
    assert trt_major("10.13.0.35") == 10 and trt_major("11.4.0.106") == 11
    with pytest.raises(RuntimeMissingError):
        trt_major("dev")


@pytest.mark.parametrize("precision,flags", [("fp32", (False, False)), ("fp16", (True, False)),
                                              ("bf16", (False, True))])
def test_tensorrt_10_weak_typing_uses_precision_flags(precision, flags):
    assert precision_flags(precision, "10.13.0") == {"strongly_typed": False, "fp16": flags[0], "bf16": flags[1]}
    assert precision_flags(precision, "10.13.0", strongly_typed=True) == {
        "strongly_typed": True, "fp16": False, "bf16": False}


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_tensorrt_11_is_strongly_typed(precision):
    assert precision_flags(precision, "11.4.0.106") == {"strongly_typed": True, "fp16": False, "bf16": False}
    with pytest.raises(ConfigError, match="strongly typed networks only"):
        precision_flags(precision, "11.4.0.106", strongly_typed=False)


def test_tensorrt_9_is_refused():
    with pytest.raises(ConfigError, match="TensorRT 10 or newer"):
        precision_flags("fp32", "9.3.0")


# plan and record ---------------------------------------------------------------------------------
def test_build_plan(manifest_factory):
    plan = build_plan(manifest_factory("static", "bf16", attention="plugin"), None, "10.16.1")
    assert list(plan) == ["prefill.engine", "decode.engine"]  # two graphs: two engines, one profile each
    decode = plan["decode.engine"]
    assert decode["onnx"] == "decode.onnx" and decode["roles"] == ["decode"]
    assert decode["attention"] == "plugin" and plan["prefill.engine"]["attention"] == "standard"
    assert decode["bf16"] and not decode["fp16"] and not decode["strongly_typed"]
    assert decode["profiles"][0]["input_ids"] == ((1, 1), (2, 1), (4, 1))
    assert role_profiles(plan) == {"prefill": {"engine": "prefill.engine", "profile": 0},
                                   "decode": {"engine": "decode.engine", "profile": 0}}
    assert list(build_plan(manifest_factory(), None, "11.1", roles=("decode",))) == ["decode.engine"]
    with pytest.raises(ConfigError, match="no encoder graph"):
        build_plan(manifest_factory(), None, "11.1", roles=("encoder",))


def test_one_graph_for_both_roles_is_one_engine_with_two_profiles(manifest_factory):
    """model.onnx serves prefill and decode: one engine (the GPU holds its weights once), prefill profile 0 and
    decode profile 1, each with its own ranges."""
    manifest = manifest_factory("static")
    shared = dataclasses.replace(manifest, graphs={role: dataclasses.replace(g, file="model.onnx")
                                                   for role, g in manifest.graphs.items()})
    plan = build_plan(shared, None, "11.1")
    assert list(plan) == ["model.engine"]
    spec = plan["model.engine"]
    assert spec["onnx"] == "model.onnx" and spec["roles"] == ["prefill", "decode"]
    assert spec["profiles"][0]["input_ids"] == ((1, 1), (2, 8), (4, 32))
    assert spec["profiles"][1]["input_ids"] == ((1, 1), (2, 1), (4, 1))
    assert role_profiles(plan) == {"prefill": {"engine": "model.engine", "profile": 0},
                                   "decode": {"engine": "model.engine", "profile": 1}}


def test_build_record_written_and_read_back(manifest_factory, tmp_path):
    manifest = manifest_factory("concat", "fp16")
    plan = build_plan(manifest, None, "10.13.0")
    engines = {file: {"file": file, "roles": spec["roles"], "bytes": 1000, "build_seconds": 1.25,
                      "aliased_outputs": {}} for file, spec in plan.items()}
    record = build_record(manifest, plan, engines, "10.13.0", "NVIDIA H100 80GB HBM3", 4096, "timing.cache")
    folder = tmp_path / "artifact" / "trt"
    folder.mkdir(parents=True)
    path = write_build_record(folder, record)
    assert path.name == BUILD_RECORD and sorted(p.name for p in folder.iterdir()) == [BUILD_RECORD]  # no temp file
    data = json.loads(path.read_text())
    assert data["format"] == RECORD_FORMAT and data["fingerprint"] == manifest.fingerprint
    assert data["tensorrt"] == "10.13.0" and data["gpu"] == "NVIDIA H100 80GB HBM3"
    assert data["precision"] == "fp16" and data["strongly_typed"] is False and data["precision_flags"] == ["fp16"]
    assert data["build_seconds"] == 2.5 and data["workspace_mib"] == 4096 and data["timing_cache"] == "timing.cache"
    assert data["profiles"]["decode"]["past_latent.0"] == {"min": [1, 1, 24], "opt": [2, 32, 24], "max": [4, 64, 24]}
    assert data["roles"]["decode"] == {"engine": "decode.engine", "profile": 0}
    assert data["polygraphy"] and data["created"]
    assert read_build_record(tmp_path / "artifact") == data


def test_read_build_record_errors(tmp_path):
    with pytest.raises(ArtifactError, match="mla-deploy build"):
        read_build_record(tmp_path)
    (tmp_path / "trt").mkdir()
    (tmp_path / "trt" / BUILD_RECORD).write_text('{"format": "other"}')
    with pytest.raises(ArtifactError, match="not an mla-deploy build record"):
        read_build_record(tmp_path)
    (tmp_path / "trt" / BUILD_RECORD).write_text(f'{{"format": "{RECORD_FORMAT}", "format_version": 1}}')
    with pytest.raises(ArtifactError, match="format_version 1.*run `mla-deploy build"):
        read_build_record(tmp_path)
    (tmp_path / "trt" / BUILD_RECORD).write_text("{")
    with pytest.raises(ArtifactError, match="not readable JSON"):
        read_build_record(tmp_path)
