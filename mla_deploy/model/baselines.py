"""Attention beside DeepSeek's MLA: the baselines and relatives the cache and speed comparisons use.

* :class:`MultiHeadAttention`: textbook MHA with rope; caches per-head K and V (``2*H*d_h`` per token).
* :class:`RopelessMLA` and :class:`FoldedRopelessMLA`: MLA without decoupled rope. Without rope,
  ``W_UK`` folds fully into the query projection and ``W_UV`` into the output projection, offline:
  ``W~_Q[h] = W_UK[h]^T W_Q[h]`` ``[r, D]`` and ``W~_O[:, h] = W_O[:, h] W_UV[h]`` ``[D, r]``
  (:func:`fold_ropeless`). The cache is the latent ``c`` alone.
* :class:`LatentCrossAttention`: the Perceiver-style "latent attention": a learned latent array of
  ``M`` queries attends to the input sequence; there is no cache.
"""

from __future__ import annotations

import torch
from torch import nn

from .cache import ConcatCache
from .mla import masked_softmax
from .rope import apply_rope, rope_tables


class MultiHeadAttention(nn.Module):
    """Textbook multi-head attention with interleaved rope on the whole head.

    Args:
        hidden_size: D. num_heads: H. head_dim: d_h. rope_theta: rope base.
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, rope_theta: float = 10000.0):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, past: tuple, cache=None):
        """Args: x ``[B, S, D]``; position_ids ``[B, S]``; past ``(k, v)`` each ``[B, H, P, d_h]``.
        Returns: y ``[B, S, D]`` and present ``(k, v)`` each ``[B, H, P+S, d_h]`` (or the static layout).
        """
        cache = ConcatCache() if cache is None else cache
        angles = position_ids.to(torch.float32).unsqueeze(-1) * self.inv_freq  # [B, S, d_h/2]
        cos, sin = (t.unsqueeze(1) for t in rope_tables(angles))

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)  # [B, H, S, d_h]

        q = apply_rope(heads(self.q_proj(x)), cos, sin)
        k = cache.update(past[0], apply_rope(heads(self.k_proj(x)), cos, sin))
        v = cache.update(past[1], heads(self.v_proj(x)))
        scores = (q @ k.transpose(-1, -2)).float() * self.head_dim ** -0.5
        out = masked_softmax(scores, cache.mask(x.shape[1], past[0])).to(v.dtype) @ v
        return self.o_proj(out.transpose(1, 2).flatten(2)), (k, v)


class RopelessMLA(nn.Module):
    """MLA without rope, in its original form: the cache is the latent ``c = kv_a_proj(x)`` ``[B, T, r]``.

    Args:
        hidden_size: D. num_heads: H. qk_head_dim: d_qk. v_head_dim: d_v. kv_lora_rank: r.
    """

    def __init__(self, hidden_size: int, num_heads: int, qk_head_dim: int, v_head_dim: int, kv_lora_rank: int):
        super().__init__()
        self.num_heads, self.qk_head_dim, self.v_head_dim, self.kv_lora_rank = (
            num_heads, qk_head_dim, v_head_dim, kv_lora_rank)
        self.q_proj = nn.Linear(hidden_size, num_heads * qk_head_dim, bias=False)
        self.kv_a_proj = nn.Linear(hidden_size, kv_lora_rank, bias=False)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, past: torch.Tensor, cache=None):
        """Args: x ``[B, S, D]``; past ``[B, P, r]``. Returns: y ``[B, S, D]``, present ``[B, P+S, r]``."""
        cache = ConcatCache() if cache is None else cache
        latent = cache.update(past, self.kv_a_proj(x))  # [B, T, r]
        kv = self.kv_b_proj(latent).unflatten(-1, (self.num_heads, -1)).transpose(1, 2)
        k, v = kv.split([self.qk_head_dim, self.v_head_dim], dim=-1)  # [B, H, T, .]
        q = self.q_proj(x).unflatten(-1, (self.num_heads, -1)).transpose(1, 2)  # [B, H, S, d_qk]
        scores = (q @ k.transpose(-1, -2)).float() * self.qk_head_dim ** -0.5
        out = masked_softmax(scores, cache.mask(x.shape[1], past)).to(v.dtype) @ v
        return self.o_proj(out.transpose(1, 2).flatten(2)), latent


class FoldedRopelessMLA(nn.Module):
    """Rope-free MLA with ``W_UK`` folded into ``q_proj`` and ``W_UV`` into ``o_proj``.

    ``q_proj [H*r, D]`` yields one r-wide query per head that scores directly against the latent;
    ``o_proj [D, H*r]`` maps each head's softmax-weighted latent straight to the output.
    """

    def __init__(self, hidden_size: int, num_heads: int, qk_head_dim: int, kv_lora_rank: int):
        super().__init__()
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.softmax_scale = qk_head_dim ** -0.5
        self.q_proj = nn.Linear(hidden_size, num_heads * kv_lora_rank, bias=False)
        self.kv_a_proj = nn.Linear(hidden_size, kv_lora_rank, bias=False)
        self.o_proj = nn.Linear(num_heads * kv_lora_rank, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, past: torch.Tensor, cache=None):
        """Args: x ``[B, S, D]``; past ``[B, P, r]``. Returns: y ``[B, S, D]``, present ``[B, P+S, r]``."""
        cache = ConcatCache() if cache is None else cache
        latent = cache.update(past, self.kv_a_proj(x))  # [B, T, r]
        q = self.q_proj(x).unflatten(-1, (self.num_heads, -1)).transpose(1, 2)  # [B, H, S, r]
        c = latent.unsqueeze(1)  # [B, 1, T, r]
        scores = (q @ c.transpose(-1, -2)).float() * self.softmax_scale
        out = masked_softmax(scores, cache.mask(x.shape[1], past)).to(c.dtype) @ c  # [B, H, S, r]
        return self.o_proj(out.transpose(1, 2).flatten(2)), latent


@torch.no_grad()
def fold_ropeless(model: RopelessMLA) -> FoldedRopelessMLA:
    """The folded equivalent of ``model`` (a pure weight transform into a new module)."""
    h, dqk, dv, r = model.num_heads, model.qk_head_dim, model.v_head_dim, model.kv_lora_rank
    d = model.q_proj.in_features
    w_kv = model.kv_b_proj.weight.view(h, dqk + dv, r)
    w_uk, w_uv = w_kv[:, :dqk], w_kv[:, dqk:]  # [H, dqk, r], [H, dv, r]
    w_q = model.q_proj.weight.view(h, dqk, d)  # [H, dqk, D]
    w_o = model.o_proj.weight.view(d, h, dv)  # [D, H, dv]
    folded = FoldedRopelessMLA(d, h, dqk, r).to(model.q_proj.weight.dtype)
    folded.q_proj.weight.copy_((w_uk.transpose(1, 2) @ w_q).reshape(h * r, d))  # [H, r, D]
    folded.o_proj.weight.copy_(torch.einsum("dhv,hvr->dhr", w_o, w_uv).reshape(d, h * r))
    folded.kv_a_proj.weight.copy_(model.kv_a_proj.weight)
    return folded


class LatentCrossAttention(nn.Module):
    """Perceiver-style latent attention: ``M`` learned latent queries attend to the input ``[B, N, d_in]``.

    Args:
        d_model: width of the latents and the output. num_heads: H. n_latents: M. d_input: width of the input.
    """

    def __init__(self, d_model: int, num_heads: int, n_latents: int, d_input: int):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of num_heads ({num_heads})")
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.latents = nn.Parameter(torch.randn(n_latents, d_model))
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_input, d_model)
        self.v_proj = nn.Linear(d_input, d_model)
        self.o_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x ``[B, N, d_in]``. Returns: the updated latents ``[B, M, d_model]``."""

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

        q = heads(self.q_proj(self.latents).unsqueeze(0))  # [1, H, M, d]
        k, v = heads(self.k_proj(x)), heads(self.v_proj(x))  # [B, H, N, d]
        probs = ((q @ k.transpose(-1, -2)).float() * self.head_dim ** -0.5).softmax(-1)
        out = probs.to(v.dtype) @ v  # [B, H, M, d]
        return self.o_proj(out.transpose(1, 2).flatten(2))
