"""TensorRT end to end: build the tiny artifacts' engines with ``mla-deploy build`` and run them with
:class:`~mla_deploy.trt.engine.TrtEngine` against ONNX Runtime (CPU) on the same artifact.

Needs TensorRT and a CUDA GPU; skipped otherwise (the whole module).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

trt = pytest.importorskip("tensorrt", reason="needs TensorRT (pip install tensorrt-cu12 or tensorrt-cu13)")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from mla_deploy import load_recipe  # noqa: E402
from mla_deploy.errors import ArtifactError, CacheCapacityError  # noqa: E402

pytestmark = [pytest.mark.trt, pytest.mark.gpu]
PROMPTS = [[3, 17, 42, 5, 9, 11, 2], [8, 1, 99]]
TRT_ALIASING = hasattr(trt.ICudaEngine, "get_aliased_input_tensor")


def _export(tmp_path_factory, cache_mode: str, precision: str = "fp32", **export):
    from mla_deploy.exporter import export_recipe

    recipe = load_recipe("tiny")
    recipe = recipe.replace(export=dataclasses.replace(recipe.export, cache_mode=cache_mode, precision=precision,
                                                       **export))
    out = tmp_path_factory.mktemp("trt") / f"tiny-{cache_mode}-{precision}-{export.get('decode_attention', 'std')}"
    export_recipe(recipe, out)
    return out


@pytest.fixture(scope="module", params=["static", "concat"])
def built(request, tmp_path_factory):
    from mla_deploy.trt.build import build_engines

    artifact = _export(tmp_path_factory, request.param)
    return artifact, build_engines(artifact)


def test_build_writes_engines_cache_and_record(built):
    artifact, record = built
    folder = artifact / "trt"
    assert sorted(p.name for p in folder.iterdir()) == ["build.json", "decode.engine", "prefill.engine",
                                                        "timing.cache"]
    data = json.loads((folder / "build.json").read_text())
    assert data == record and data["tensorrt"] == trt.__version__
    assert data["gpu"] == torch.cuda.get_device_name(0)
    assert data["strongly_typed"] is (int(trt.__version__.split(".")[0]) >= 11)
    static = json.loads((artifact / "manifest.json").read_text())["cache"]["mode"] == "static"
    if static and TRT_ALIASING:  # TensorScatter -> IKVCacheUpdateLayer, written in place
        assert data["engines"]["decode.engine"]["aliased_outputs"] == {"present_latent.0": "past_latent.0",
                                                               "present_latent.1": "past_latent.1"}


def test_generate_matches_onnx_runtime(built):
    from mla_deploy.ort.engine import OrtEngine
    from mla_deploy.trt.engine import TrtEngine

    artifact, _ = built
    ours = TrtEngine(artifact).generate(PROMPTS, max_new_tokens=8)
    theirs = OrtEngine(artifact, provider="cpu").generate(PROMPTS, max_new_tokens=8)
    assert ours.tokens == theirs.tokens
    assert ours.decode_steps == 7 and ours.provider.startswith("TensorRT")


def test_forward_protocol_matches_onnx_runtime(built):
    from mla_deploy.generate.request import pad_prompts
    from mla_deploy.ort.engine import OrtEngine
    from mla_deploy.trt.engine import TrtEngine

    artifact, _ = built
    engines = TrtEngine(artifact), OrtEngine(artifact, provider="cpu")
    ids, valid, lengths = pad_prompts(PROMPTS, 128)
    states = [e.new_state(len(PROMPTS)) for e in engines]
    pos = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    outs = [e.forward("prefill", ids, pos, s, valid) for e, s in zip(engines, states)]
    for step in range(3):
        for name in outs[1]:
            a, b = np.asarray(outs[0][name], np.float32), np.asarray(outs[1][name], np.float32)
            assert a.shape == b.shape, name
            assert np.abs(a - b).max() <= 1e-3 * max(1.0, np.abs(b).max()), (step, name)
        token = outs[1]["logits"][:, -1].argmax(-1)[:, None]
        outs = [e.forward("decode", token, s.lengths[:, None].copy(), s) for e, s in zip(engines, states)]


def test_profiles_bound_the_cache(built):
    from mla_deploy.trt.engine import TrtEngine

    artifact, _ = built
    engine = TrtEngine(artifact)
    with pytest.raises(CacheCapacityError):
        engine.generate([[1] * 30], max_new_tokens=40)  # 30 + 39 > 64 (static capacity; concat past max 64)


def test_stale_engines_are_refused(built, tmp_path):
    import shutil

    from mla_deploy.trt.engine import TrtEngine

    artifact, _ = built
    copy = tmp_path / "copy"
    shutil.copytree(artifact, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["fingerprint"] = "ffffffffffffffff"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="built for another export"):
        TrtEngine(copy)


def test_one_graph_is_one_engine_with_a_profile_per_role(tmp_path_factory):
    """The default single graph (model.onnx, prefill and decode in the absorbed form) builds one engine whose
    prefill and decode contexts run on profiles 0 and 1, and generates what ONNX Runtime generates."""
    from mla_deploy.ort.engine import OrtEngine
    from mla_deploy.trt.engine import TrtEngine
    from mla_deploy.trt.build import build_engines

    artifact = _export(tmp_path_factory, "static", prefill_form="A_CC")
    record = build_engines(artifact)
    assert list(record["engines"]) == ["model.engine"]
    assert record["roles"] == {"prefill": {"engine": "model.engine", "profile": 0},
                               "decode": {"engine": "model.engine", "profile": 1}}
    engine = TrtEngine(artifact)
    assert engine.engines["prefill"] is engine.engines["decode"]  # deserialised once
    assert engine.generate(PROMPTS, 12).tokens == OrtEngine(artifact, threads=1).generate(PROMPTS, 12).tokens


def test_bf16_engine_builds_and_generates(tmp_path_factory):
    from mla_deploy.trt.engine import TrtEngine
    from mla_deploy.trt.build import build_engines

    artifact = _export(tmp_path_factory, "static", "bf16")
    record = build_engines(artifact)
    assert record["precision"] == "bf16"
    result = TrtEngine(artifact).generate(PROMPTS, max_new_tokens=4)
    assert len(result.tokens) == 2 and all(len(t) == 4 for t in result.tokens)


def test_plugin_decode_attention_gives_the_standard_tokens(tmp_path_factory):
    pytest.importorskip("triton", reason="the MlaDecode plugin runs Triton kernels")
    from mla_deploy.trt.engine import TrtEngine
    from mla_deploy.trt.build import build_engines

    standard = _export(tmp_path_factory, "static")
    plugin = _export(tmp_path_factory, "static", decode_attention="plugin")
    build_engines(standard)
    record = build_engines(plugin)
    assert record["engines"]["decode.engine"]["attention"] == "plugin"
    assert TrtEngine(plugin).generate(PROMPTS, 8).tokens == TrtEngine(standard).generate(PROMPTS, 8).tokens
