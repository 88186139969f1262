"""Recipes (TOML presets under export/): the built-ins carry the published numbers; every mistake is a ConfigError."""

from __future__ import annotations

import pytest

from pathlib import Path

from mla_deploy import load_recipe, preset_names
from mla_deploy.recipe import presets_dir
from mla_deploy.errors import ConfigError, MLADeployError

# the published config.json values of each model
PUBLISHED = {
    "deepseek-v3": dict(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, rope_theta=10000.0, max_position_embeddings=163840,
        moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
        first_k_dense_replace=3, n_group=8, topk_group=4, topk_method="noaux_tc", scoring_func="sigmoid",
        routed_scaling_factor=2.5, norm_topk_prob=True),
    "deepseek-v2": dict(
        model_type="deepseek_v2", vocab_size=102400, hidden_size=5120, intermediate_size=12288,
        num_hidden_layers=60, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, rope_theta=10000.0, max_position_embeddings=163840,
        moe_intermediate_size=1536, n_routed_experts=160, n_shared_experts=2, num_experts_per_tok=6,
        first_k_dense_replace=1, n_group=8, topk_group=3, topk_method="group_limited_greedy",
        scoring_func="softmax", routed_scaling_factor=16.0, norm_topk_prob=False),
    "deepseek-v2-lite": dict(
        model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
        num_hidden_layers=27, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, rope_theta=10000.0, max_position_embeddings=163840,
        moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        first_k_dense_replace=1, n_group=1, topk_group=1, topk_method="greedy", scoring_func="softmax",
        routed_scaling_factor=1.0, norm_topk_prob=False),
}
YARN = {"deepseek-v3": (1.0, 1.0), "deepseek-v2": (0.707, 0.707), "deepseek-v2-lite": (0.707, 0.707)}

TINY_MODEL = """
[model]
name = "t"
vocab_size = 128
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_attention_heads = 4
kv_lora_rank = 16
qk_nope_head_dim = 8
qk_rope_head_dim = 8
v_head_dim = 8
"""


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_has_published_numbers(name):
    """Every field of the published config.json, and YaRN factor 40 over 4096 with its mscale pair."""
    c = load_recipe(name).model
    assert c.name == name
    for field, value in PUBLISHED[name].items():
        assert getattr(c, field) == value, field
    y = c.rope_scaling
    assert (y.factor, y.original_max_position_embeddings, y.beta_fast, y.beta_slow) == (40.0, 4096, 32.0, 1.0)
    assert (y.mscale, y.mscale_all_dim) == YARN[name]


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_loads_by_name_and_by_path(name):
    """A preset loads by name and from its file path to the same config."""
    recipe = load_recipe(name)
    assert load_recipe(recipe.source).model == recipe.model


def _write(tmp_path, text: str):
    path = tmp_path / "r.toml"
    path.write_text(text)
    return path


def test_minimal_recipe_loads(tmp_path):
    """A [model] table with only the required fields loads (defaults fill the rest); the control for the errors."""
    c = load_recipe(_write(tmp_path, TINY_MODEL)).model
    assert (c.name, c.latent_dim, c.q_lora_rank, c.rope_scaling) == ("t", 24, None, None)


@pytest.mark.parametrize("text, message", [
    pytest.param(TINY_MODEL + "kv_lora_rnak = 16\n", r"\[model\]: unknown field\(s\) kv_lora_rnak", id="unknown_field"),
    pytest.param(TINY_MODEL + "\n[exprot]\nopset = 18\n", r"unknown section\(s\) exprot", id="unknown_section"),
    pytest.param(TINY_MODEL.replace("v_head_dim = 8\n", ""), r"missing field\(s\) v_head_dim", id="missing_field"),
    pytest.param(TINY_MODEL + "\n[model.rope_scaling]\ntype = \"yarn\"\nfactor = 4.0\n"
                 "original_max_position_embeddings = 64\nbeta_fsat = 32.0\n",
                 r"unknown rope_scaling field\(s\) beta_fsat", id="unknown_rope_field"),
    pytest.param("[model\n", "not a readable TOML recipe", id="bad_toml"),
    pytest.param("[build]\n", r"no \[model\] section", id="no_model_section"),
])
def test_recipe_structure_errors(tmp_path, text, message):
    """A misspelt or missing key or section is a ConfigError naming the file and the key, never ignored."""
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as info:
        load_recipe(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, MLADeployError)


@pytest.mark.parametrize("old, new, message", [
    ("qk_rope_head_dim = 8", "qk_rope_head_dim = 7", "qk_rope_head_dim must be even"),
    ("hidden_size = 64", "hidden_size = \"64\"", "hidden_size must be a positive integer"),
    ("num_attention_heads = 4", "num_attention_heads = 0", "num_attention_heads must be a positive integer"),
], ids=["odd_rope_dim", "wrong_type", "zero_heads"])
def test_recipe_value_errors(tmp_path, old, new, message):
    """A bad value in [model] is a ConfigError naming the model and the field."""
    with pytest.raises(ConfigError, match=message):
        load_recipe(_write(tmp_path, TINY_MODEL.replace(old, new)))


def test_unknown_preset_lists_the_known_ones():
    """An unknown preset name is a ConfigError that lists the built-in presets."""
    with pytest.raises(ConfigError, match="unknown preset 'deepseek-v4'") as info:
        load_recipe("deepseek-v4")
    assert all(name in str(info.value) for name in preset_names())


def test_a_bad_model_value_names_the_recipe_file(tmp_path):
    from mla_deploy.errors import ConfigError

    text = (Path(presets_dir()) / "tiny.toml").read_text().replace("qk_rope_head_dim = 8", "qk_rope_head_dim = 7")
    path = tmp_path / "odd.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"odd\.toml \[model\].*qk_rope_head_dim must be even"):
        load_recipe(path)


def test_the_experts_form_is_checked_and_auto_follows_the_runtime():
    """``[export] experts``: fused, branches or auto; auto is fused for ONNX Runtime settings, fp32 (the CPU
    layout) and fp16/bf16 (the CUDA layout) alike, and branches for TensorRT's (plugin attention, the qdq format) and
    where ``QMoE`` cannot hold the quantized experts (blocks wider than the experts; on CUDA, widths not multiples
    of 64); fused asked for where it cannot run is refused in one line."""
    import dataclasses

    from mla_deploy.expert_forms import fused_layout

    recipe = load_recipe("tiny")
    moe = recipe.model.replace(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                               first_k_dense_replace=1)
    wide = moe.replace(moe_intermediate_size=64)

    def form(config=moe, **export):
        return dataclasses.replace(recipe.export, **export).expert_form(config)

    assert form() == "fused" and form(weights="int4") == "fused" and form(experts="branches") == "branches"
    assert form(precision="fp16") == form(precision="bf16") == "fused" and form(decode_attention="plugin") == "branches"
    assert form(wide, precision="fp16", weights="int4") == form(wide, precision="bf16", weights="int8") == "fused"
    assert [fused_layout(p) for p in ("fp32", "fp16", "bf16")] == ["cpu", "cuda", "cuda"]
    assert form(weights="int8", quant_format="qdq") == form(weights="int4", block_size=64) == "branches"
    assert form(precision="fp16", weights="int4") == "branches"  # 32 wide: CUDA's QMoE tiles K by 64
    assert form(experts="fused", weights="int8", quant_format="qdq") == "fused"
    with pytest.raises(ConfigError, match="experts must be auto, fused, branches, got 'dense'"):
        form(experts="dense")
    with pytest.raises(ConfigError, match="moe_intermediate_size 32 is not a multiple of 64; use branches"):
        form(experts="fused", precision="fp16", weights="int4")
    with pytest.raises(ConfigError, match="moe_intermediate_size 32 is not a multiple of 64; use branches"):
        form(experts="fused", weights="int4", block_size=64)
