"""The cache table (``mla_deploy.cache_table``) equals the formulas, for every preset, and the published numbers."""

from __future__ import annotations

import pytest

from mla_deploy import load_recipe, preset_names
from mla_deploy.cache_table import cache_rows, format_inspect


def _rows(name: str) -> dict:
    return {row.kind: row for row in cache_rows(load_recipe(name).model)}


def test_presets_exist():
    """The published models and the tiny test model are built in."""
    assert {"deepseek-v2", "deepseek-v2-lite", "deepseek-v3", "tiny"} <= set(preset_names())


@pytest.mark.parametrize("name", preset_names())
def test_rows_equal_formulas(name):
    """MHA = 2*H*v_head_dim, CD = H*(qk_nope+qk_rope+v), latent = kv_lora_rank+qk_rope, and with sparse attention
    index = index_head_dim (DeepSeek-V3.2, GLM-5: the indexer's keys); ratios to latent."""
    c = load_recipe(name).model
    rows = _rows(name)
    assert list(rows) == ["MHA", "CD", "latent"] + (["index"] if c.is_sparse else [])
    h = c.num_attention_heads
    expected = {
        "MHA": 2 * h * c.v_head_dim,
        "CD": h * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim),
        "latent": c.kv_lora_rank + c.qk_rope_head_dim,
        **({"index": c.index_head_dim} if c.is_sparse else {}),
    }
    for kind, elements in expected.items():
        assert rows[kind].elements == elements
        assert rows[kind].ratio_to_latent == pytest.approx(elements / expected["latent"])
    assert expected["latent"] == c.latent_dim


@pytest.mark.parametrize("name", preset_names())
def test_bytes_per_dtype(name):
    """Bytes per token per layer: fp32 = 4 x elements, bf16 = 2 x elements."""
    for row in cache_rows(load_recipe(name).model):
        assert row.bytes("fp32") == 4 * row.elements
        assert row.bytes("bf16") == 2 * row.elements


def test_sparse_presets_count_the_index_cache():
    """DeepSeek-V3.2 and GLM-5 cache 128 index numbers per token per layer beside the 576 of the latent (+22 %)."""
    for name in ("deepseek-v3.2", "glm-5"):
        rows = _rows(name)
        assert (rows["latent"].elements, rows["index"].elements) == (576, 128)
        assert rows["index"].ratio_to_latent == pytest.approx(128 / 576)


@pytest.mark.parametrize("name, latent, cd, mha", [
    ("deepseek-v3", 576, 40960, 32768),
    ("deepseek-v2", 576, 40960, 32768),
    ("deepseek-v2-lite", 576, 5120, 4096),
])
def test_published_sizes(name, latent, cd, mha):
    """DeepSeek-V3 (and V2): latent 576, CD 40960, MHA 32768; V2-Lite: CD 5120."""
    rows = _rows(name)
    assert (rows["latent"].elements, rows["CD"].elements, rows["MHA"].elements) == (latent, cd, mha)


@pytest.mark.parametrize("name, scale", [
    ("deepseek-v2", 0.11472139), ("deepseek-v2-lite", 0.11472139), ("deepseek-v3", 0.13523378)])
def test_softmax_scale(name, scale):
    """192**-0.5 times mscale(40, mscale_all_dim)**2: V2/V2-Lite (0.707) 0.11472139, V3 (1.0) 0.13523378."""
    assert load_recipe(name).model.softmax_scale == pytest.approx(scale, abs=1e-7)


def test_format_inspect_shows_the_table():
    """The inspect text carries the three rows with their bytes and ratios."""
    text = format_inspect(load_recipe("deepseek-v3").model)
    for token in ("576", "40960", "32768", "81920", "65536", "1152", "71.11", "56.89", "1.00", "0.13523378"):
        assert token in text
