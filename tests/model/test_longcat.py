"""LongCat-Flash (``longcat_flash``) beyond the family tests (tests/model/test_family.py runs its tiny checkpoint
through export, ONNX Runtime against transformers' `generate` and logits, `validate` and `inspect`): that each of its
switches matters on that checkpoint, that its graph carries one latent cache per MLA sub-layer (two per layer), and
that a bad checkpoint of the type is refused in one line.
"""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

import family_checkpoints  # noqa: E402
from cli_run import cli, fails, ok  # noqa: E402

PROMPTS = [[5, 17, 99, 3, 42, 7], [64, 2, 11]]
E = family_checkpoints.LONGCAT["n_routed_experts"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``(transformers model, checkpoint folder)`` of the family tests' tiny LongCat-Flash."""
    folder = tmp_path_factory.mktemp("longcat") / "ckpt"
    return family_checkpoints.write("longcat_flash", folder), folder


def _routes(hf, ids):
    """Each router's input and its chosen experts, over the prompt ``ids`` (transformers' own routers)."""
    seen = []

    def hook(module, args, output):
        seen.append((args[0].reshape(-1, args[0].shape[-1]), output[2]))

    handles = [layer.mlp.router.register_forward_hook(hook) for layer in hf.model.layers]
    try:
        hf(ids)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def test_each_switch_matters(checkpoint):
    """On the test prompts, transformers' routers choose zero experts for some tokens and real ones for others; the
    routing bias changes some choices; routed_scaling_factor is not 1; the two MLA sub-layers of a layer differ. And
    the comparison sees a missing bias or latent scale: our model without them leaves transformers' logits."""
    import torch

    from mla_deploy.checkpoint import load_checkpoint

    hf, folder = checkpoint
    zero = real = bias_changes = 0
    with torch.no_grad():
        for prompt in PROMPTS:
            for layer, (x, chosen) in zip(hf.model.layers, _routes(hf, torch.tensor([prompt]))):
                zero += int((chosen >= E).sum())
                real += int((chosen < E).sum())
                scores = torch.nn.functional.linear(x.float(), layer.mlp.router.classifier.weight.float()).softmax(-1)
                unbiased = scores.topk(chosen.shape[-1], dim=-1).indices
                bias_changes += int((unbiased.sort(-1).values != chosen.sort(-1).values).any(-1).sum())
    assert zero > 0 and real > 0 and bias_changes > 0, (zero, real, bias_changes)
    assert hf.config.routed_scaling_factor != 1

    model = load_checkpoint(folder)
    ids = torch.tensor([PROMPTS[0]])
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        expected = hf(ids).logits
        logits, presents = model(ids, positions, model.empty_cache(1))
        assert (logits - expected).abs().max() <= 1e-4
        assert len(presents) == 2 * hf.config.num_layers
        assert (presents[0] - presents[1]).abs().max() > 1e-2  # sub-layers 0 and 1 of layer 0
        layer = model.model.layers[0]
        for tensor, change in ((layer.mlp.router.e_score_correction_bias, lambda t: t.zero_()),
                               (layer.self_attn[1].q_b_proj.weight, lambda t: t.div_(2 ** 0.5))):
            kept = tensor.clone()
            change(tensor)
            changed, _ = model(ids, positions, model.empty_cache(1))
            tensor.copy_(kept)
            assert (changed - expected).abs().max() > 1e-3


@pytest.mark.slow
def test_graph_has_a_latent_cache_per_sublayer(checkpoint, tmp_path):
    """The exported graph's cache I/O is one latent per MLA sub-layer (4 for 2 layers), the manifest says which
    layer and sub-layer each belongs to, `inspect --hf` counts the cache over the sub-layers, and a batch's cache
    memory counts every one."""
    import onnx

    from mla_deploy.cache_layout import cache_elements_per_token, cache_tensors
    from mla_deploy.config import from_hf_config

    hf, folder = checkpoint
    ok(cli("export", "--hf", folder, "--out", tmp_path / "onnx"))
    graph = onnx.load(str(tmp_path / "onnx" / "model.onnx"), load_external_data=False)
    latents = [i.name for i in graph.graph.input if i.name.startswith("past_latent.")]
    assert latents == [f"past_latent.{i}" for i in range(4)]
    assert [o.name for o in graph.graph.output if o.name.startswith("present_latent.")] == \
        [f"present_latent.{i}" for i in range(4)]
    manifest = json.loads((tmp_path / "onnx" / "manifest.json").read_text())
    assert [(entry["layer"], entry["sublayer"]) for entry in manifest["cache"]["layers"]] == \
        [(0, 0), (0, 1), (1, 0), (1, 1)]
    config = from_hf_config(folder)
    assert (config.num_hidden_layers, config.decoder_layers) == (4, 2)
    assert len(cache_tensors(config)) == 4 and cache_elements_per_token(config) == 16 + 8
    shown = ok(cli("inspect", "--hf", folder))
    assert "4 MLA sub-layers (2 layers x 2)" in shown
    assert "latent cache, all 4 MLA sub-layers: 0.2 KiB/token" in shown  # 4 x 24 x 2 B = 192 B
    assert "8 routed experts of 32 + 4 zero (identity) experts, top-3" in shown


@pytest.mark.slow
def test_without_zero_experts(tmp_path):
    """``zero_expert_num`` 0 (transformers allows it): exported, ONNX Runtime's greedy tokens and logits are
    transformers'."""
    from hf_oracle import assert_engine_matches_hf
    from mla_deploy.ort.engine import OrtEngine

    hf = family_checkpoints.write("longcat_flash-no-zero", tmp_path / "ckpt")
    ok(cli("export", "--hf", tmp_path / "ckpt", "--out", tmp_path / "onnx"))
    assert_engine_matches_hf(OrtEngine(tmp_path / "onnx", threads=1, capacity=32), hf, PROMPTS, 8)


@pytest.mark.slow
def test_int4_keeps_the_router_float(checkpoint, tmp_path):
    """`export --weights int4`: the routed experts and the dense MLPs are quantized, the router's classifier is not
    (the choice of experts is a top-k of its scores, not continuous in them)."""
    hf, folder = checkpoint
    ok(cli("export", "--hf", folder, "--out", tmp_path / "int4", "--weights", "int4"))
    keys = json.loads((tmp_path / "int4" / "manifest.json").read_text())["quantization"]["keys"]
    for layer in (0, 1):
        assert f"model.layers.{layer}.mlp.experts.gate_up_proj" in keys
        assert f"model.layers.{layer}.mlps.1.down_proj.weight" in keys
    assert not [k for k in keys if "router" in k]


def _broken(folder, config=None, drop=None):
    """The tiny LongCat-Flash checkpoint with its config.json changed by ``config`` or the tensor ``drop`` removed."""
    from safetensors.torch import load_file, save_file

    family_checkpoints.write("longcat_flash", folder)
    if config is not None:
        family_checkpoints.edit_json(folder / "config.json", config)
    if drop is not None:
        state = load_file(str(folder / "model.safetensors"))
        del state[drop]
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("config, drop, message", [
    (lambda d: d.update(num_hidden_layers=6), None,
     "contradictory layer counts: num_hidden_layers (6) must be 2 x num_layers (2)"),
    (lambda d: (d.pop("num_layers"), d.update(num_hidden_layers=3)), None, "num_hidden_layers (3) of longcat_flash "
                                                                           "must be even"),
    (lambda d: d.update(num_layers=3), None, "the checkpoint lacks"),
    (lambda d: d.update(router_bias=True), None, "router_bias=true is not supported"),
    (lambda d: d.update(zero_expert_type="linear"), None, "only identity zero experts are supported"),
    (lambda d: d.update(n_shared_experts=1), None, "longcat_flash does not use n_shared_experts"),
    (None, "model.layers.1.self_attn.1.kv_b_proj.weight", "lacks 1 tensor(s) the model needs: "
                                                           "model.layers.1.self_attn.1.kv_b_proj.weight"),
    (None, "model.layers.0.mlp.experts.7.down_proj.weight", "model.layers.0.mlp.experts.7.down_proj.weight"),
], ids=["contradictory_layer_counts", "odd_sublayers", "layers_beyond_the_tensors", "router_bias",
        "non_identity_zero_experts", "shared_experts", "missing_attention_tensor", "missing_expert_tensor"])
def test_bad_checkpoint_is_one_line(tmp_path, config, drop, message):
    """A malformed LongCat-Flash checkpoint: `export --hf` exits 1 with one line naming what is wrong."""
    ckpt = _broken(tmp_path / "ckpt", config, drop)
    fails(cli("export", "--hf", ckpt, "--out", tmp_path / "out"), message)
    assert not (tmp_path / "out").exists()
