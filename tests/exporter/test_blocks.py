"""The comparison blocks export and run in ONNX Runtime like their PyTorch modules."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from mla_deploy import load_recipe
from mla_deploy.exporter.blocks import build_block, export_block


@pytest.fixture(scope="module")
def config():
    return load_recipe("tiny").model


def test_mha_block_has_its_kv_cache_as_io_and_matches_torch(tmp_path, config):
    manifest = export_block("mha", config, tmp_path / "mha")
    assert [t["name"] for t in manifest["inputs"]] == ["hidden_states", "position_ids", "past_key", "past_value"]
    session = ort.InferenceSession(str(tmp_path / "mha" / "mha.onnx"), providers=["CPUExecutionProvider"])
    block = build_block("mha", config)
    h, d = config.num_attention_heads, config.v_head_dim
    x, past = torch.randn(3, 4, config.hidden_size), (torch.randn(3, h, 6, d), torch.randn(3, h, 6, d))
    pos = torch.arange(6, 10).expand(3, 4)
    with torch.no_grad():
        ref, (k, v) = block(x, pos, past)
    out, pk, pv = session.run(None, {"hidden_states": x.numpy(), "position_ids": pos.numpy(),
                                     "past_key": past[0].numpy(), "past_value": past[1].numpy()})
    assert pk.shape == (3, h, 10, d)
    for got, want in ((out, ref), (pk, k), (pv, v)):
        np.testing.assert_allclose(got, want.numpy(), atol=1e-5, rtol=1e-5)


def test_latent_cross_attention_block_matches_torch(tmp_path, config):
    export_block("latent-cross-attention", config, tmp_path / "lca", n_latents=16)
    session = ort.InferenceSession(str(tmp_path / "lca" / "latent-cross-attention.onnx"),
                                   providers=["CPUExecutionProvider"])
    block = build_block("latent-cross-attention", config, n_latents=16)
    x = torch.randn(2, 9, config.hidden_size)
    (out,) = session.run(None, {"inputs": x.numpy()})
    assert out.shape == (2, 16, config.hidden_size)
    with torch.no_grad():
        np.testing.assert_allclose(out, block(x).numpy(), atol=1e-5, rtol=1e-5)
