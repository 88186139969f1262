"""The baselines beside MLA: rope-free MLA and its folded form, textbook MHA with a cache, Perceiver-style
latent cross-attention."""

from __future__ import annotations

import pytest
import torch

from helpers import TOL, positions, rel_err
from mla_deploy.model import (FoldedRopelessMLA, LatentCrossAttention, MultiHeadAttention, RopelessMLA,
                              fold_ropeless, init_random_)

D, H, DQK, DV, R = 64, 4, 16, 12, 24


def _x(batch: int, length: int, width: int = D, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, length, width, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _run(module, x: torch.Tensor, chunks, past, **kw):
    """Feed ``x [B, N, D]`` chunk by chunk through a module with a concat cache; returns the outputs, the caches."""
    outs, presents, start = [], [], 0
    for n in chunks:
        extra = {"position_ids": positions(x.shape[0], start, n)} if isinstance(module, MultiHeadAttention) else {}
        y, past = module(x[:, start:start + n], past=past, **extra, **kw)
        outs.append(y)
        presents.append(past)
        start += n
    return outs, presents


def _ropeless(seed: int = 0) -> RopelessMLA:
    return init_random_(RopelessMLA(D, H, DQK, DV, R), std=0.2, seed=seed).eval()


def test_fold_ropeless_shapes():
    """The folded projections: q_proj [H*r, D] (one r-wide query per head), o_proj [D, H*r]."""
    folded = fold_ropeless(_ropeless())
    assert isinstance(folded, FoldedRopelessMLA)
    assert folded.q_proj.weight.shape == (H * R, D)
    assert folded.o_proj.weight.shape == (D, H * R)


@pytest.mark.parametrize("seed", [0, 1])
def test_fold_ropeless_matches_original(seed):
    """RopelessMLA and fold_ropeless(model) agree on a prefill and 8 decode steps through the latent cache,
    and both cache the same latent [B, T, r]."""
    model = _ropeless(seed)
    folded = fold_ropeless(model)
    x = _x(2, 14, seed=seed)
    chunks = [6] + [1] * 8
    ref, ref_cache = _run(model, x, chunks, torch.zeros(2, 0, R))
    out, cache = _run(folded, x, chunks, torch.zeros(2, 0, R))
    for o, r in zip(out, ref):
        assert rel_err(o, r) <= TOL
    assert cache[-1].shape == (2, 14, R)
    assert torch.equal(cache[-1], ref_cache[-1])


def test_fold_ropeless_control_wrong_fold_disagrees():
    """Control: folding another model's weights gives a clearly different output, so the agreement is not vacuous."""
    x = _x(2, 6)
    ref, _ = _run(_ropeless(0), x, [6], torch.zeros(2, 0, R))
    out, _ = _run(fold_ropeless(_ropeless(1)), x, [6], torch.zeros(2, 0, R))
    assert rel_err(out[0], ref[0]) > 1e-2


def _mha() -> MultiHeadAttention:
    return init_random_(MultiHeadAttention(D, H, DQK), std=0.2, seed=3).eval()


def test_mha_cache_grows_per_head():
    """MHA's cache is per-head K and V, [B, H, P+S, d_h], growing by S each call."""
    chunks = [5, 1, 1, 3]
    _, presents = _run(_mha(), _x(2, sum(chunks)), chunks, (torch.zeros(2, H, 0, DQK), torch.zeros(2, H, 0, DQK)))
    total = 0
    for n, (k, v) in zip(chunks, presents):
        total += n
        assert k.shape == v.shape == (2, H, total, DQK)


def test_mha_decode_equals_full_recompute():
    """Prefill + 8 decode steps through MHA's cache equal one full-sequence forward (rope positions included)."""
    model, x = _mha(), _x(2, 14, seed=4)
    empty = (torch.zeros(2, H, 0, DQK), torch.zeros(2, H, 0, DQK))
    (full,), _ = _run(model, x, [14], empty)
    out, _ = _run(model, x, [6] + [1] * 8, empty)
    assert rel_err(torch.cat(out, 1), full) <= TOL


@torch.no_grad()
def test_mha_equals_textbook_reference():
    """MHA is textbook attention: rope as complex rotation of adjacent pairs, then causal SDPA (from position 5)."""
    model, x = _mha(), _x(2, 9, seed=5)
    pos = positions(2, 5, 9)

    def heads(w: torch.Tensor) -> torch.Tensor:
        return (x @ w.T).unflatten(-1, (H, DQK)).transpose(1, 2)  # [B, H, S, d]

    angles = pos.float().unsqueeze(-1) * (1e4 ** (-torch.arange(0, DQK, 2).float() / DQK))  # [B, S, d/2]
    rot = torch.polar(torch.ones_like(angles), angles).unsqueeze(1)

    def rope(t: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(torch.view_as_complex(t.unflatten(-1, (-1, 2))) * rot).flatten(-2)

    q, k, v = rope(heads(model.q_proj.weight)), rope(heads(model.k_proj.weight)), heads(model.v_proj.weight)
    ref = model.o_proj(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                       .transpose(1, 2).flatten(2))
    out, _ = model(x, pos, (torch.zeros(2, H, 0, DQK), torch.zeros(2, H, 0, DQK)))
    assert rel_err(out, ref) <= TOL


def _latent_xattn() -> LatentCrossAttention:
    torch.manual_seed(0)
    return init_random_(LatentCrossAttention(d_model=32, num_heads=4, n_latents=6, d_input=20), std=0.3).eval()


def test_latent_cross_attention_shape():
    """M learned latents attend to the input: [B, N, d_in] -> [B, M, d_model], whatever N."""
    model = _latent_xattn()
    with torch.no_grad():
        for n in (1, 7, 33):
            assert model(_x(3, n, 20)).shape == (3, 6, 32)


@pytest.mark.parametrize("seed", range(5))
@torch.no_grad()
def test_latent_cross_attention_is_permutation_invariant(seed):
    """Property: permuting the input sequence leaves the output unchanged (no positions, no mask), while a
    different input changes it."""
    model = _latent_xattn()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 11, 20, generator=gen)
    perm = torch.randperm(11, generator=gen)
    ref = model(x)
    assert rel_err(model(x[:, perm]), ref) <= TOL
    assert rel_err(model(x[:, :10]), ref) > 1e-3


def test_latent_cross_attention_rejects_bad_heads():
    """d_model must split evenly into heads."""
    with pytest.raises(ValueError, match="multiple of num_heads"):
        LatentCrossAttention(d_model=30, num_heads=4, n_latents=2, d_input=8)
