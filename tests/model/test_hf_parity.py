"""Our MLAForCausalLM computes what transformers' own DeepSeek-V2 and DeepSeek-V3 compute (float32, CPU).

The HF model is built by transformers itself (``hf_oracle.hf_model``, weights N(0, 0.3)); ours is
``from_hf_config(hf.config.to_dict())`` with the HF state dict loaded ``strict=True``, then rewritten into
each attention form. Agreement is ``max|diff| / max|ref| <= 1e-5``.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

import hf_oracle  # noqa: E402
from helpers import BROKEN, TOL, positions, rel_err, run_chunks  # noqa: E402
from mla_deploy.model import FORMS, ConcatCache  # noqa: E402

VERSIONS = [pytest.param(2, id="V2"), pytest.param(3, id="V3")]
VARIANTS = [pytest.param(q, y, id=f"{'q_lora' if q else 'q_proj'}-{'yarn' if y else 'rope'}")
            for q in (32, None) for y in (True, False)]


@functools.lru_cache(maxsize=None)
def hf(version: int, q_lora_rank: int | None = 32, yarn: bool = True):
    return hf_oracle.hf_model(version, q_lora_rank=q_lora_rank, yarn=yarn)


@functools.lru_cache(maxsize=None)
def ours(version: int, form: str, q_lora_rank: int | None = 32, yarn: bool = True):
    return hf_oracle.ours_from_hf(hf(version, q_lora_rank, yarn), form)


def _ids(batch: int, length: int, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_hf_state_dict_loads_strict_into_every_variant():
    """The HF state dict has exactly our keys and shapes (the load itself is strict), for V2 and V3."""
    for version in (2, 3):
        for q in (32, None):
            model = ours(version, "CC", q)
            assert set(model.state_dict()) == set(hf(version, q).state_dict())
            assert model.config.model_type == f"deepseek_v{version}"


@pytest.mark.parametrize("chunks", [pytest.param([11], id="from_0"), pytest.param([37, 7], id="from_37")])
@pytest.mark.parametrize("q_lora_rank, yarn", VARIANTS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("version", VERSIONS)
def test_logits_match_hf(version, form, q_lora_rank, yarn, chunks):
    """Prefill logits match HF from position 0, and from position 37 after a 37-token prefill into the cache."""
    ids = _ids(2, sum(chunks))
    ref, _ = hf_oracle.hf_run_chunks(hf(version, q_lora_rank, yarn), ids, chunks)
    out, _ = run_chunks(ours(version, form, q_lora_rank, yarn), ids, chunks)
    assert rel_err(out[-1], ref[-1]) <= TOL


@pytest.mark.parametrize("q_lora_rank, yarn", VARIANTS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("version", VERSIONS)
def test_cached_decode_matches_hf(version, form, q_lora_rank, yarn):
    """Prefill 6 tokens, then 8 single-token decode steps through each side's cache: every step matches."""
    chunks = [6] + [1] * 8
    ids = _ids(2, sum(chunks), seed=6)
    ref, _ = hf_oracle.hf_run_chunks(hf(version, q_lora_rank, yarn), ids, chunks)
    out, _ = run_chunks(ours(version, form, q_lora_rank, yarn), ids, chunks)
    for step, (o, r) in enumerate(zip(out, ref)):
        assert rel_err(o, r) <= TOL, step


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``[..., d]`` -> ``[evens | odds]``: the order V3's HF code writes the rotated k_pe in."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("version", VERSIONS)
def test_cache_matches_hf_cache(version, form):
    """After prefill + 4 decode steps our cache holds HF's: c_kv == HF keys [B, 1, S, r]; k_pe == HF values
    as stored (V2, interleaved) or after de-interleaving ours (V3, evens then odds) -- and V3's is not equal as is.
    CD caches per-head keys whose rope part is k_pe for every head."""
    chunks = [7, 1, 1, 1, 1]
    ids = _ids(2, sum(chunks), seed=7)
    _, hf_cache = hf_oracle.hf_run_chunks(hf(version), ids, chunks)
    model = ours(version, form)
    _, present = run_chunks(model, ids, chunks)
    c = model.config
    for i, layer_past in enumerate(present):
        hf_keys, hf_values = hf_cache.layers[i].keys, hf_cache.layers[i].values  # [B, 1, S, r], [B, 1, S, dr]
        assert hf_keys.shape == (2, 1, sum(chunks), c.kv_lora_rank)
        if form == "CD":
            k = layer_past[0]  # [B, H, S, dn+dr]
            k_pe = k[..., c.qk_nope_head_dim:]
            assert torch.equal(k_pe, k_pe[:, :1].expand_as(k_pe))  # one rope key shared by all heads
            k_pe = k_pe[:, :1]
        else:
            assert layer_past.shape == (2, sum(chunks), c.latent_dim)
            c_kv, k_pe = layer_past.unsqueeze(1).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
            assert rel_err(c_kv, hf_keys) <= TOL
        if version == 2:
            assert rel_err(k_pe, hf_values) <= TOL
        else:
            assert rel_err(_deinterleave(k_pe), hf_values) <= TOL
            assert rel_err(k_pe, hf_values) > BROKEN


@pytest.mark.parametrize("start", [0, 37])
@pytest.mark.parametrize("q_lora_rank, yarn", VARIANTS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("version", VERSIONS)
@torch.no_grad()
def test_single_attention_layer_matches_hf(version, form, q_lora_rank, yarn, start):
    """Layer 0's self_attn alone: HF's DeepseekV{2,3}Attention (position_embeddings from its rotary_emb, a causal
    4D mask) and ours (cos/sin from our rotary_emb, the concat cache's mask) give the same output."""
    theirs, mine = hf(version, q_lora_rank, yarn), ours(version, form, q_lora_rank, yarn)
    attn = theirs.model.layers[0].self_attn
    assert type(attn).__name__ == f"DeepseekV{version}Attention"
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(8))
    pos = positions(2, start, 9)
    ref, _ = attn(hidden_states=x, position_embeddings=theirs.model.rotary_emb(x, pos),
                  attention_mask=hf_oracle.causal_mask(2, 9))
    past = mine.empty_cache(2)[0]
    cos, sin = mine.model.rotary_emb(pos)
    first = past[0] if isinstance(past, tuple) else past
    out, _ = mine.model.layers[0].self_attn(x, cos, sin, ConcatCache().mask(9, first), past, ConcatCache())
    assert rel_err(out, ref) <= TOL
