"""The presets of real models of the MLA family (export/kimi-k2.toml, glm-4.7-flash.toml, minicpm3-4b.toml,
mistral-small-4.toml, deepseek-v3.2.toml, glm-5.toml): `inspect --preset` shows each one's dimensions and its cache
per token against MHA and decompressed K/V (and, with sparse attention, the indexer's key cache beside the latent), and each preset is the model that `from_hf_config` reads from the default config of
transformers' class for its type (the class defaults are the released checkpoint's, as their docstrings say), so a
preset and `export --hf` of the release describe one model. Kimi K2 has no class in transformers 5.24: its preset
is checked to read back the same through a ``kimi_k2`` config.json."""

from __future__ import annotations

import pytest

from cli_run import cli, ok
from mla_deploy.config import from_hf_config, to_hf_config
from mla_deploy.recipe import load_recipe

#: preset name -> the transformers model_type whose class defaults it holds (None: no class in transformers 5.24)
PRESETS = {"kimi-k2": None, "glm-4.7-flash": "glm4_moe_lite", "minicpm3-4b": "minicpm3",
           "mistral-small-4": "mistral4", "deepseek-v3.2": "deepseek_v32", "glm-5": "glm_moe_dsa"}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_inspect_shows_dimensions_and_cache(name):
    """`inspect --preset NAME`: the MLA dimensions, and the MHA, decompressed K/V (CD) and latent rows of the
    cache per token per layer with their formulas, from the preset's own values."""
    c = load_recipe(name).model
    shown = ok(cli("inspect", "--preset", name))
    assert shown.startswith(f"preset {name} ({c.model_type})")
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                  "qk_rope_head_dim", "v_head_dim"):
        assert any(line.split() == [field, str(getattr(c, field))] for line in shown.splitlines()), (field, shown)
    h = c.num_attention_heads
    rows = {words[0]: words for words in map(str.split, shown.splitlines())
            if words[:1] in (["MHA"], ["CD"], ["latent"], ["index"]) and words[1].isdigit()}
    assert int(rows["MHA"][1]) == 2 * h * c.v_head_dim
    assert int(rows["CD"][1]) == h * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
    assert int(rows["latent"][1]) == c.kv_lora_rank + c.qk_rope_head_dim
    assert f"latent cache, all {c.num_hidden_layers} layers" in shown
    if c.is_sparse:  # DeepSeek-V3.2, GLM-5: the indexer's keys, counted in the cache per token
        assert int(rows["index"][1]) == c.index_head_dim
        per_token = (c.kv_lora_rank + c.qk_rope_head_dim + c.index_head_dim) * 2 * c.num_hidden_layers
        assert f"latent + index cache, all {c.num_hidden_layers} layers: {per_token / 1024:.1f} KiB/token" in shown
    else:
        assert "index" not in rows


@pytest.mark.parametrize("name", [n for n, t in sorted(PRESETS.items()) if t is not None])
def test_preset_is_the_transformers_class_default(name):
    """The preset's MLAConfig equals, field for field (dimensions, routing, schedule, rope, scales), what
    from_hf_config reads from ``AutoConfig.for_model(TYPE).to_dict()``."""
    transformers = pytest.importorskip("transformers")
    default = transformers.AutoConfig.for_model(PRESETS[name]).to_dict()
    assert from_hf_config(default, name=name) == load_recipe(name).model


def test_kimi_k2_preset_reads_back_as_a_kimi_k2_config():
    """No transformers class holds Kimi K2's defaults; its preset written as a ``kimi_k2`` config.json (DeepSeek-V3's
    keys under Kimi K2's name) reads back as the same MLAConfig."""
    c = load_recipe("kimi-k2").model
    assert from_hf_config(to_hf_config(c, model_type="kimi_k2"), name=c.name) == c
