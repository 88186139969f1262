"""The MLA model types mla-deploy reads besides plain DeepSeek-V2/V3, each as a tiny checkpoint written by
transformers' own class (:mod:`family_checkpoints`): `mla-deploy export --hf` exports it, and ONNX Runtime's greedy
tokens equal transformers' `generate`, its logits within 1e-4 of transformers' at the prefill and every decode
step; `validate` passes and `inspect --hf` reads it. A type still refused names the mechanism it lacks, in one line.
"""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

import family_checkpoints  # noqa: E402
from cli_run import cli, fails, ok  # noqa: E402
from hf_oracle import assert_engine_matches_hf  # noqa: E402
from mla_deploy.ort.engine import OrtEngine  # noqa: E402

PROMPTS = [[5, 17, 99, 3, 42, 7], [64, 2, 11]]
NEW = 8


@pytest.fixture(scope="module", params=family_checkpoints.CASES)
def exported(request, tmp_path_factory):
    """``(case, transformers model, checkpoint folder, artifact folder)``, exported through the CLI."""
    case = request.param
    root = tmp_path_factory.mktemp(case)
    hf = family_checkpoints.write(case, root / "ckpt")
    ok(cli("export", "--hf", root / "ckpt", "--out", root / "onnx"))
    return case, hf, root / "ckpt", root / "onnx"


@pytest.mark.slow
def test_tokens_and_logits_match_transformers(exported):
    case, hf, _, out = exported
    assert_engine_matches_hf(OrtEngine(out, threads=1, capacity=32), hf, PROMPTS, NEW)


@pytest.mark.slow
def test_validate_and_inspect(exported, tmp_path):
    """`validate` (the reference rebuilt from the checkpoint) passes; `inspect --hf` shows the model's cache."""
    case, hf, ckpt, out = exported
    assert "validation passed" in ok(cli("validate", out, "--steps", 2, "--threads", 1, "--out", tmp_path / "report"))
    shown = ok(cli("inspect", "--hf", ckpt))
    assert "latent" in shown.lower()


@pytest.mark.slow
def test_loader_reads_what_transformers_reads(exported):
    """What the load report says was skipped, per type: the MTP layer (GLM-4.7-Flash, LongCat-Flash's
    ``model.mtp.*``), A.X-K1's dense-layer norm and its absent routing bias, the Kimi K2.5 wrapper's vision tensors,
    the unused projections of LongCat's zero experts; and the schedule read (dense layers where transformers has
    them; LongCat's shortcut MoE in every layer)."""
    from mla_deploy.checkpoint import load_checkpoint

    case, hf, ckpt, _ = exported
    model = load_checkpoint(ckpt)
    text = hf.model.language_model if case == "kimi_k25" else hf.model
    dense = [type(layer.mlp).__name__.endswith("MLP") for layer in text.layers]
    assert [not model.config.is_moe_layer(i) for i in range(model.config.decoder_layers)] == dense
    skipped = model.load_report.summary()
    expected = {"glm4_moe_lite": ["MTP layer tensors"],
                "axk1": ["1 post_mlp_layernorm of dense layers", "1 absent, zero as transformers makes it"],
                "kimi_k25": ["kimi_k25 tensors outside the text model"],
                "longcat_flash": ["59 MTP layer tensors", "16 gate/up projections of zero (identity) experts"]}
    for reason in expected.get(case, []):
        assert reason in skipped


@pytest.mark.slow
def test_norm_epsilons_are_transformers(exported):
    """Each RMSNorm of a decoder layer has the epsilon transformers builds it with, found by its name (ours mirror
    transformers'): ``rms_norm_eps`` for the layer norms, 1e-6 for the latent norms (``q_a_layernorm``,
    ``kv_a_layernorm``) whatever ``rms_norm_eps`` says. The gap between 1e-5 and 1e-6 fits inside the logit tolerance,
    so only this sees it (GLM-4.7-Flash, MiniCPM3, GLM-5 and LongCat-Flash default to 1e-5)."""
    from mla_deploy.checkpoint import load_checkpoint

    case, hf, ckpt, _ = exported
    ours = load_checkpoint(ckpt).model.layers
    text = hf.model.language_model if case == "kimi_k25" else hf.model
    theirs = {f"{i}.{name}": module.variance_epsilon for i in range(len(text.layers))
              for name, module in text.layers[i].named_modules() if hasattr(module, "variance_epsilon")}
    assert any(name.endswith("kv_a_layernorm") for name in theirs)
    assert {name: ours.get_submodule(name).eps for name in theirs} == theirs


@pytest.mark.parametrize("case", ["kimi_k25", "sarvam_mla", "axk1"])
def test_checkpoint_as_transformers_saves_it(tmp_path, case):
    """The same types as transformers 5.24 itself saves them, where that differs from the release (Kimi K2.5's text
    layers as ``language_model.model.blocks.*``, Sarvam's and A.X-K1's configs in transformers' spelling): loaded,
    they compute transformers' logits."""
    import torch

    from mla_deploy.checkpoint import load_checkpoint

    hf = family_checkpoints.write(case, tmp_path / "ckpt", released=False)
    model = load_checkpoint(tmp_path / "ckpt")
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        logits, _ = model(ids, torch.arange(ids.shape[1])[None], model.empty_cache(1))
        assert (logits - hf(ids).logits).abs().max() <= 1e-4


@pytest.mark.parametrize("case", ["deepseek_v3-half-rope", "glm4_moe_lite", "minicpm3", "mistral4", "longcat_flash"])
def test_in_memory_transformers_model(tmp_path, case):
    """``from_hf_model`` on the transformers model itself (no checkpoint folder): the half-rotated rope rows permuted
    into new tensors, the rest shared; the logits are transformers'."""
    import torch

    from mla_deploy.model.hf import from_hf_model

    hf = family_checkpoints.write(case, tmp_path / "ckpt")
    model = from_hf_model(hf).eval()
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        logits, _ = model(ids, torch.arange(ids.shape[1])[None], model.empty_cache(1))
        assert (logits - hf(ids).logits).abs().max() <= 1e-4


@pytest.mark.parametrize("model_type, mechanism", [
    ("kimi_linear", "linear-attention layers (KDA) are not supported"),
    ("mistral_large4", "DeepSeek Sparse Attention, cross-layer latent sharing (kv_source_layers), NoPE layers and "
                       "the final logit softcap are not supported"),
    ("bailing_hybrid", "linear-attention layers (KDA) and the gated MLA output (g_proj) are not supported"),
])
def test_refused_type_names_the_missing_mechanism(tmp_path, model_type, mechanism):
    """A config written by transformers' own config class of a type mla-deploy refuses: `export --hf` exits 1
    with one line naming the mechanism, nothing written."""
    cfg = transformers.AutoConfig.for_model(model_type)
    cfg.save_pretrained(tmp_path / "ckpt")
    done = cli("export", "--hf", tmp_path / "ckpt", "--out", tmp_path / "out")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert f"{model_type}: {mechanism}" in lines[0]
    assert not (tmp_path / "out").exists()


def _bad(folder, change_config=None, index=None):
    """The tiny youtu checkpoint, its config.json changed, or an index.json written beside it."""
    family_checkpoints.write("youtu", folder)
    if change_config is not None:
        family_checkpoints.edit_json(folder / "config.json", change_config)
    if index is not None:
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


@pytest.mark.parametrize("change, index, message", [
    (lambda d: d.update(model_type="kimi_k25"), None, "holds its text model's config in text_config, which is missing"),
    (lambda d: d.update(rope_scaling=5), None, "rope_scaling must be a JSON object, got 5"),
    (lambda d: d.update(quantization_config="x"), None, 'quantization_config must be a JSON object, got "x"'),
    (lambda d: d["rope_parameters"].update(rope_theta="big"), None, 'rope_theta must be a number, got "big"'),
    (lambda d: d.update(quantization_config={"weight_block_size": {}}), None,
     "weight_block_size must be two positive integers, got {}"),
    (lambda d: d.update(mlp_layer_types=["dense"] * 3, n_routed_experts=8, moe_intermediate_size=32,
                        first_k_dense_replace=1), None, "contradictory MoE schedules: mlp_layer_types makes layer 1"),
    (None, {"weight_map": ["model.safetensors"]}, "weight_map must map tensor names to shard file names"),
], ids=["wrapper_without_text_config", "rope_scaling_number", "quantization_config_string", "rope_theta_string",
        "block_size_object", "contradictory_schedules", "weight_map_list"])
def test_bad_checkpoint_is_one_line(tmp_path, change, index, message):
    """A malformed checkpoint of the new types: `export --hf` exits 1 with one line, never a traceback."""
    ckpt = _bad(tmp_path / "ckpt", change, index)
    fails(cli("export", "--hf", ckpt, "--out", tmp_path / "out"), message)
