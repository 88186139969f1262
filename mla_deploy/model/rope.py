"""Rotary position embedding as DeepSeek applies it: adjacent pairs, optional YaRN.

DeepSeek's weights rotate the pairs ``(x[2i], x[2i+1])`` of the rope slice (``q_pe``, ``k_pe``) by
the angle ``position * inv_freq[i]``. The rotated vector keeps that interleaved layout, so the
``k_pe`` written to the latent cache is in DeepSeek's own order (as in DeepSeek-V2's HF code; V3's HF
code stores it de-interleaved, which changes no score).

The tables are laid out for that order (:func:`rope_tables`): ``cos`` repeated over each pair and ``sin`` signed
(``-sin`` on a pair's first element), so a rotation is ``x * cos + swap_pairs(x) * sin``: one ``Gather``, two
``Mul`` and one ``Add`` in the exported graph, where rotating the pairs apart and stacking them back takes fourteen
nodes per rotation (two per layer). The arithmetic is the same, product for product (``a + (-b)`` is ``a - b`` and
a sum's order of two terms does not round differently), so the outputs are bit for bit the pairwise form's.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import LongRopeScaling, MLAConfig, YarnScaling


def yarn_inv_freq(dim: int, base: float, yarn: YarnScaling) -> torch.Tensor:
    """YaRN inverse frequencies ``[dim/2]``: interpolated below the ramp, extrapolated above it."""
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (yarn.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1: extrapolate (high frequency), 0: interpolate (low frequency)
    return interpolation * (1.0 - keep) + extrapolation * keep


def inv_freq_for(config: MLAConfig) -> torch.Tensor:
    """The inverse frequencies ``[qk_rope_head_dim / 2]`` for ``config`` (plain, YaRN or static LongRoPE: the plain
    ones each divided by its ``short_factor``)."""
    dim = config.qk_rope_head_dim
    if config.rope_scaling is None:
        return 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if isinstance(config.rope_scaling, LongRopeScaling):
        factors = torch.tensor(config.rope_scaling.short_factor, dtype=torch.float32)
        return 1.0 / (factors * config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    return yarn_inv_freq(dim, config.rope_theta, config.rope_scaling)


def rope_tables(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation tables of ``angles [..., d/2]`` (one per pair) in the pairs' interleaved layout: ``cos [..., d]``
    (``cos(a_i)`` at ``2i`` and ``2i+1``) and ``sin [..., d]`` (``-sin(a_i)`` at ``2i``, ``sin(a_i)`` at ``2i+1``)."""
    cos, sin = angles.cos(), angles.sin()
    return (torch.stack((cos, cos), dim=-1).flatten(-2), torch.stack((-sin, sin), dim=-1).flatten(-2))


class RotaryEmbedding(nn.Module):
    """Maps positions to the rotation tables ``(cos, sin)`` (:func:`rope_tables`), each ``[B, S, qk_rope_head_dim]``
    in float32.

    Under YaRN or LongRoPE, cos and sin carry the amplitude ``config.rope_amplitude`` (1.0 for the published
    DeepSeek and MiniCPM3 configs), as transformers applies it.
    """

    def __init__(self, config: MLAConfig):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq_for(config), persistent=False)
        self.amplitude = config.rope_amplitude
        self.query_beta = config.llama_4_scaling_beta
        self.query_span = None if self.query_beta is None else config.rope_scaling.original_max_position_embeddings

    def query_scale(self, position_ids: torch.Tensor) -> torch.Tensor | None:
        """Mistral 4's query scale ``[B, S]`` float32, ``1 + beta * ln(1 + floor(p / n))`` (as transformers'
        ``get_llama_4_attn_scale``), or None for a model without one."""
        if self.query_beta is None:
            return None
        return 1 + self.query_beta * torch.log(1 + torch.floor(position_ids.to(torch.float32) / self.query_span))

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Args: position_ids ``[B, S]`` int64. Returns: cos, sin ``[B, S, d]`` float32 (:func:`rope_tables`)."""
        angles = position_ids.to(torch.float32).unsqueeze(-1) * self.inv_freq  # [B, S, d/2]
        cos, sin = rope_tables(angles)
        if self.amplitude != 1.0:
            cos, sin = cos * self.amplitude, sin * self.amplitude
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of the last axis: ``(x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos)`` per pair.

    Args:
        x: ``[..., d]`` with ``d`` even; pairs are ``(x[2i], x[2i+1])``.
        cos, sin: :func:`rope_tables`'s, broadcastable to ``[..., d]`` (float32).
    Returns:
        ``[..., d]`` in ``x``'s dtype, pairs still interleaved.
    """
    swap = torch.arange(x.shape[-1], device=x.device) ^ 1  # 1, 0, 3, 2, ...: each pair's other element
    wide = x.float()
    return (wide * cos + wide.index_select(-1, swap) * sin).to(x.dtype)


def half_rotated_rows(rope_dim: int) -> torch.Tensor:
    """The row order that makes a projection written for half-rotated rope (pairs ``(i, i + d/2)``, transformers'
    ``rotate_half``) rotate DeepSeek's interleaved pairs ``(2i, 2i+1)`` instead: ``[0, d/2, 1, d/2 + 1, ...]``.
    Pair ``i`` turns by ``inv_freq[i]`` in both, and the query's and key's rope rows are permuted alike, so every
    score is unchanged (the cache's ``k_pe`` is then in the interleaved order)."""
    half = rope_dim // 2
    return torch.stack((torch.arange(half), torch.arange(half) + half), dim=-1).flatten()


def interleave_rope_rows(key: str, weight: torch.Tensor, config: MLAConfig) -> torch.Tensor:
    """``weight`` (the original form's tensor ``key``) with its rope output rows in the interleaved order when they
    are rope rows written for half-rotated rope (:func:`half_rotated_rows`): each head's ``q_pe`` rows of ``q_proj``
    / ``q_b_proj``, the ``k_pe`` rows of ``kv_a_proj_with_mqa``; any other tensor unchanged."""
    c = config
    order = half_rotated_rows(c.qk_rope_head_dim)
    if key.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
        rows = torch.arange(weight.shape[0]).view(c.num_attention_heads, c.qk_head_dim)
        rows = torch.cat((rows[:, :c.qk_nope_head_dim], rows[:, c.qk_nope_head_dim:][:, order]), dim=-1)
        return weight[rows.flatten()]
    if key.endswith("self_attn.kv_a_proj_with_mqa.weight"):
        return torch.cat((weight[:c.kv_lora_rank], weight[c.kv_lora_rank:][order]))
    return weight

