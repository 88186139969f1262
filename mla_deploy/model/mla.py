"""Multi-Head Latent Attention in the forms the literature compares, sharing one set of weights.

Shapes: B batch, S new tokens, T cached + new slots, H heads, D hidden, r ``kv_lora_rank``,
dn ``qk_nope_head_dim``, dr ``qk_rope_head_dim``, dv ``v_head_dim``, C = r + dr (the latent row).

Original (non-absorbed) forms, :class:`MLAttention`, parameters named as Hugging Face's ``self_attn``:

* ``CD``: caches the decompressed per-head keys ``[B, H, T, dn+dr]`` and values ``[B, H, T, dv]``.
* ``CC``: caches the latent row ``[c_kv | k_pe]`` ``[B, T, C]`` and re-expands K/V through ``kv_b_proj``
  on every step (what transformers does).

Absorbed forms, :class:`AbsorbedMLAttention` (``kv_b_proj`` split into ``w_uk``/``w_uv``):

* ``A_CC``: ``q_lat = q_nope . W_UK`` (per head, dn -> r); the 576-wide query ``[q_lat | q_pe]`` scores
  against the latent rows; the output ``P . c_kv`` goes through ``W_UV`` then ``o_proj``.
* ``A_CC_ME``: the same, with the latent and rope score terms summed instead of concatenated.

Every form takes ``(x, cos, sin, mask, past, cache)`` and returns ``(y, present)``; ``cache`` is a
:mod:`~mla_deploy.model.cache` policy (concat or static), so the past is explicit state. A layer with DeepSeek Sparse
Attention (:mod:`~mla_deploy.model.dsa`) takes and returns its two caches as a pair ``(latent, index keys)``, and its
indexer narrows the mask before the latent form attends.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import MLAConfig
from ..errors import ConfigError
from .dsa import Indexer
from .layers import RMSNorm
from .rope import apply_rope

ORIGINAL_FORMS = ("CD", "CC")
ABSORBED_FORMS = ("A_CC", "A_CC_ME")
FORMS = ORIGINAL_FORMS + ABSORBED_FORMS


def split_kv_a(kv_a: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``kv_a_proj_with_mqa``'s output ``[..., r + dr]`` into ``c_kv [..., r]`` (first) and ``k_pe [..., dr]``."""
    return kv_a[..., :kv_lora_rank], kv_a[..., kv_lora_rank:]


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis of float32 ``scores [B, H, S, T]`` where ``mask [B|1, 1, S, T]`` is True."""
    return scores.masked_fill(~mask, torch.finfo(scores.dtype).min).softmax(dim=-1)


def latent_scores(rows, q: torch.Tensor) -> torch.Tensor:
    """``q . rows^T``: ``q [B, N, C]`` against the latent rows ``[B, T, C]``, or a tuple of their column blocks
    ``[B, T, w_j]`` (scored block by block and summed, never concatenated). Returns ``[B, N, T]``.

    The cache is the left operand (``[T, C] x [C, N]``) and the small result is transposed, so no cache-sized
    tensor is transposed or sliced (an ONNX Transpose/Slice would copy it)."""
    if not isinstance(rows, tuple):
        return (rows @ q.transpose(-1, -2)).transpose(-1, -2)
    scores, start = None, 0
    for block in rows:
        width = block.shape[-1]
        part = block @ q[..., start:start + width].transpose(-1, -2)  # [B, T, N]
        scores, start = part if scores is None else scores + part, start + width
    return scores.transpose(-1, -2)


def latent_mix(probs: torch.Tensor, rows) -> torch.Tensor:
    """``probs . rows``: ``probs [B, N, T]`` over the latent rows ``[B, T, C]`` or a tuple of their column blocks
    (each block weighted on its own; only the small results are concatenated). Returns ``[B, N, C]``."""
    if not isinstance(rows, tuple):
        return probs @ rows
    return torch.cat([probs @ block for block in rows], dim=-1)


class MLABase(nn.Module):
    """The projections every form shares: the query path, ``kv_a_proj_with_mqa`` + ``kv_a_layernorm``, ``o_proj``."""

    def __init__(self, config: MLAConfig):
        super().__init__()
        c = config
        self.config = config
        self.num_heads = c.num_attention_heads
        self.softmax_scale = c.softmax_scale
        latent_eps = c.rms_norm_eps if c.latent_norm_eps is None else c.latent_norm_eps
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, latent_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, c.num_attention_heads * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, latent_eps)
        self.o_proj = nn.Linear(c.num_attention_heads * c.v_head_dim, c.hidden_size, bias=False)
        if c.is_sparse:
            self.indexer = Indexer(c)

    def sparse(self, x, cos, sin, mask, past, cache):
        """The compressed query, the mask and the latent past a form attends with: a sparse-attention layer's
        indexer narrows ``mask`` to its chosen slots and writes its own cache (``past`` a pair). Returns ``(q_a,
        mask, latent past, index present)``; ``(None, mask, past, None)`` for a dense layer."""
        if not self.config.is_sparse:
            return None, mask, past, None
        latent_past, index_past = past
        q_a = self.q_a_layernorm(self.q_a_proj(x))
        mask, index_present = self.indexer(x, q_a, cos, sin, mask, index_past, cache)
        return q_a, mask, latent_past, index_present

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                q_scale: torch.Tensor | None = None, q_a: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Args: x ``[B, S, D]``; cos, sin ``[B, S, dr]`` (:func:`~mla_deploy.model.rope.rope_tables`); q_scale
        ``[B, S]`` float32, each query's scale (Mistral 4's, :meth:`~mla_deploy.model.rope.RotaryEmbedding.query_scale`)
        or None; q_a the compressed query when already computed (:meth:`sparse`). Returns: q_nope ``[B, H, S, dn]``,
        q_pe ``[B, H, S, dr]`` (rotated)."""
        c = self.config
        if c.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)) if q_a is None else q_a)
        q = q.unflatten(-1, (self.num_heads, c.qk_head_dim)).transpose(1, 2)  # [B, H, S, dn+dr]
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        q_pe = apply_rope(q_pe, cos.unsqueeze(1), sin.unsqueeze(1))
        if q_scale is not None:
            scale = q_scale[:, None, :, None].to(q.dtype)  # [B, 1, S, 1]
            q_nope, q_pe = q_nope * scale, q_pe * scale
        return q_nope, q_pe

    def latent(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The rows this step adds to the latent cache: ``[B, S, C]`` = ``[kv_a_layernorm(c_kv) | rope(k_pe)]``."""
        c_kv, k_pe = split_kv_a(self.kv_a_proj_with_mqa(x), self.config.kv_lora_rank)
        return torch.cat((self.kv_a_layernorm(c_kv), apply_rope(k_pe, cos, sin)), dim=-1)

    def update_latent(self, past: torch.Tensor, new: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``new [B, S, C]`` into ``past`` as the cache policy lays it out (concat ``[B, P, C]``, static
        ``[B, 1, T_max, C]``). Returns: present (the past's layout) and the rows to attend ``[B, T, C]`` (a tuple of
        column blocks for a block cache)."""
        return cache.write_latent(past, new)


class MLAttention(MLABase):
    """MLA in its original form (``CD`` or ``CC``), with Hugging Face's parameter names."""

    def __init__(self, config: MLAConfig, form: str = "CC"):
        super().__init__(config)
        if form not in ORIGINAL_FORMS:
            raise ValueError(f"MLAttention form must be one of {ORIGINAL_FORMS}, got {form!r}")
        if form == "CD" and config.is_sparse:
            raise ConfigError(f"{config.name}: sparse attention selects latent rows; the CD form (a per-head K/V "
                              "cache) has none")
        self.form = form
        c = config
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)

    def expand(self, c_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decompress latents ``[B, T, r]`` to k_nope ``[B, H, T, dn]`` and v ``[B, H, T, dv]``."""
        c = self.config
        kv = self.kv_b_proj(c_kv).unflatten(-1, (self.num_heads, c.qk_nope_head_dim + c.v_head_dim))
        k_nope, v = kv.transpose(1, 2).split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        return k_nope, v

    def forward(self, x, cos, sin, mask, past, cache, q_scale=None):
        """Args:
            x ``[B, S, D]``; cos, sin ``[B, S, dr]`` (:func:`~mla_deploy.model.rope.rope_tables`);
            mask ``[B|1, 1, S, T]`` bool;
            past: CD ``(k [B, H, P, dn+dr], v [B, H, P, dv])``, CC ``[B, P, C]`` (or the static layouts);
            q_scale: as :meth:`MLABase.queries`.
        Returns: y ``[B, S, D]`` and the present cache in the past's layout.
        """
        c = self.config
        q_a, mask, past, index_present = self.sparse(x, cos, sin, mask, past, cache)
        q_nope, q_pe = self.queries(x, cos, sin, q_scale, q_a)
        q = torch.cat((q_nope, q_pe), dim=-1)  # [B, H, S, dn+dr]
        new = self.latent(x, cos, sin)  # [B, S, C]
        if self.form == "CD":
            c_kv, k_pe = new.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
            k_nope, v = self.expand(c_kv)  # [B, H, S, dn], [B, H, S, dv]
            k = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, self.num_heads, -1, -1)), dim=-1)
            k_all, v_all = cache.update(past[0], k), cache.update(past[1], v)  # [B, H, T, .]
            present = (k_all, v_all)
        else:
            present, rows = self.update_latent(past, new, cache)  # rows [B, T, C]
            c_all, kpe_all = rows.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
            k_nope, v_all = self.expand(c_all)  # re-expanded every step
            k_all = torch.cat((k_nope, kpe_all.unsqueeze(1).expand(-1, self.num_heads, -1, -1)), dim=-1)
        scores = (q @ k_all.transpose(-1, -2)).float() * self.softmax_scale  # [B, H, S, T]
        out = masked_softmax(scores, mask).to(v_all.dtype) @ v_all  # [B, H, S, dv]
        return self.o_proj(out.transpose(1, 2).flatten(2)), present if index_present is None else (present, index_present)


class AbsorbedMLAttention(MLABase):
    """MLA in the absorbed form (``A_CC`` or ``A_CC_ME``): attention runs over the latent cache.

    ``w_uk [H, dn, r]`` and ``w_uv [H, dv, r]`` are the two halves of each head's rows of ``kv_b_proj``.
    """

    def __init__(self, config: MLAConfig, form: str = "A_CC"):
        super().__init__(config)
        if form not in ABSORBED_FORMS:
            raise ValueError(f"AbsorbedMLAttention form must be one of {ABSORBED_FORMS}, got {form!r}")
        self.form = form
        c = config
        self.w_uk = nn.Parameter(torch.empty(c.num_attention_heads, c.qk_nope_head_dim, c.kv_lora_rank))
        self.w_uv = nn.Parameter(torch.empty(c.num_attention_heads, c.v_head_dim, c.kv_lora_rank))

    def forward(self, x, cos, sin, mask, past, cache, q_scale=None):
        """Args:
            x ``[B, S, D]``; cos, sin ``[B, S, dr]`` (:func:`~mla_deploy.model.rope.rope_tables`);
            mask ``[B|1, 1, S, T]`` bool;
            past: the latent cache ``[B, P, C]`` (concat) or ``[B, 1, T_max, C]`` (static);
            q_scale: as :meth:`MLABase.queries`.
        Returns: y ``[B, S, D]`` and the present latent cache in the past's layout.
        """
        q_a, mask, past, index_present = self.sparse(x, cos, sin, mask, past, cache)
        q_nope, q_pe = self.queries(x, cos, sin, q_scale, q_a)  # [B, H, S, dn], [B, H, S, dr]
        o_lat, present = self.attend(self.absorb_query(q_nope), q_pe, self.latent(x, cos, sin), mask, past, cache)
        return self.output(o_lat), present if index_present is None else (present, index_present)

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """W_UK folded into the query: ``[B, H, S, dn] -> [B, H, S, r]``, heads first ([H, B*S, dn] x [H, dn, r]),
        so each head's weights are read once per step."""
        batch, _, steps = q_nope.shape[:3]
        return (q_nope.transpose(0, 1).flatten(1, 2) @ self.w_uk).unflatten(1, (batch, steps)).transpose(0, 1)

    def attend(self, q_lat, q_pe, new, mask, past, cache):
        """Attention over the latent cache after writing this step's rows.

        Args: q_lat ``[B, H, S, r]``; q_pe ``[B, H, S, dr]``; new ``[B, S, C]``; mask, past, cache as in forward.
        Returns: o_lat ``[B, H, S, r]`` (the softmax-weighted sum of ``c_kv``) and the present cache.
        """
        r = self.config.kv_lora_rank
        heads, steps = q_lat.shape[1], q_lat.shape[2]
        present, rows = self.update_latent(past, new, cache)  # rows [B, T, C]
        # The cache-sized products are written so that no cache-sized tensor is transposed or sliced (an ONNX
        # Transpose/Slice copies it) and one product per sequence serves all heads (a [B, H, S, C] x [B, 1, C, T]
        # broadcast runs as B*H matrix-vector products, each reading the whole cache).
        if self.form == "A_CC":
            q = torch.cat((q_lat, q_pe), dim=-1).flatten(1, 2)  # [B, H*S, C]
            scores = latent_scores(rows, q).unflatten(1, (heads, steps))  # [B, H, S, T]
        else:
            rows = torch.cat(rows, dim=-1) if isinstance(rows, tuple) else rows
            kv = rows.unsqueeze(1)  # [B, 1, T, C]: one latent "head" shared by all query heads
            scores = q_lat @ kv[..., :r].transpose(-1, -2) + q_pe @ kv[..., r:].transpose(-1, -2)
        probs = masked_softmax(scores.float() * self.softmax_scale, mask)
        # softmax-weighted sum of whole cache rows [c_kv | k_pe], then keep the c_kv part of the small result
        o_lat = latent_mix(probs.to(q_lat.dtype).flatten(1, 2), rows)[..., :r]  # [B, H*S, r]
        return o_lat.unflatten(1, (heads, steps)), present

    def output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """W_UV per head, heads first, then ``o_proj``: ``[B, H, S, r] -> [B, S, D]``."""
        batch, _, steps = o_lat.shape[:3]
        out = (o_lat.transpose(0, 1).flatten(1, 2) @ self.w_uv.transpose(-1, -2)).transpose(0, 1)  # [B*S, H, dv]
        return self.o_proj(out.reshape(batch, steps, -1))
