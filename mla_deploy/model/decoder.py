"""A DeepSeek-style decoder built from an :class:`~mla_deploy.config.MLAConfig`.

embedding -> [RMSNorm -> MLA -> residual -> RMSNorm -> SwiGLU MLP or MoE -> residual] x L -> RMSNorm -> lm_head.
State-dict keys equal those of Hugging Face's ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM``
(``model.layers.{i}.self_attn.kv_b_proj.weight``, ...), so their weights load without renaming.

:func:`run_layers` is the one layer loop (rope table, mask, each layer with the cache policy); both
:class:`MLAForCausalLM` and :class:`AttentionStack` (the attention sub-layers alone, ``x <- x + attn_i(x)``,
as ``mla-deploy bench`` times them) run through it.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch
from torch import nn

from ..config import MLAConfig
from ..errors import ConfigError
from .cache import ConcatCache
from .layers import MLP, MoE, RMSNorm
from .longcat import LongcatDecoderLayer
from .mla import ABSORBED_FORMS, FORMS, AbsorbedMLAttention, MLABase, MLAttention
from .rope import RotaryEmbedding


def make_attention(config: MLAConfig, form: str) -> nn.Module:
    """The attention module of ``form`` (one of ``CD``, ``CC``, ``A_CC``, ``A_CC_ME``)."""
    if form not in FORMS:
        raise ValueError(f"unknown attention form {form!r}; choose one of {FORMS}")
    return AbsorbedMLAttention(config, form) if form in ABSORBED_FORMS else MLAttention(config, form)


def cache_widths(config: MLAConfig) -> list[int]:
    """The channels of each of the model's caches, in the order the model takes them: the latent row of every MLA
    layer (LongCat's two sub-layers of a layer in turn), then, with sparse attention, every layer's index keys
    (``index_head_dim``)."""
    layers = config.num_hidden_layers
    return [config.latent_dim] * layers + ([config.index_head_dim] * layers if config.is_sparse else [])


def layer_caches(config: MLAConfig, flat: Sequence) -> list:
    """The model's caches (:func:`cache_widths`' order) as one entry per decoder layer: the latent cache, for a
    sparse-attention layer the pair ``(latent, index keys)``, for a LongCat layer the pair of its sub-layers'
    latent caches."""
    layers = config.num_hidden_layers
    if config.attention_per_layer == 2:
        if len(flat) != layers:
            raise ValueError(f"expected {layers} caches (one per MLA sub-layer), got {len(flat)}")
        return [(flat[i], flat[i + 1]) for i in range(0, layers, 2)]
    if not config.is_sparse:
        return list(flat)
    if len(flat) != 2 * layers:
        raise ValueError(f"expected {2 * layers} caches (latent and index keys per layer), got {len(flat)}")
    return list(zip(flat[:layers], flat[layers:]))


def flat_caches(config: MLAConfig, presents: Sequence) -> list:
    """The inverse of :func:`layer_caches`."""
    if config.attention_per_layer == 2:
        return [cache for pair in presents for cache in pair]
    if not config.is_sparse:
        return list(presents)
    return [p[0] for p in presents] + [p[1] for p in presents]


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer."""

    def __init__(self, config: MLAConfig, index: int, form: str):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = make_attention(config, form)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoE(config) if config.is_moe_layer(index) else MLP(config.hidden_size, config.intermediate_size)
        self.residual_scale = config.residual_scale

    def forward(self, x, cos, sin, mask, past, cache, q_scale=None):
        """Args: x ``[B, S, D]`` and the attention's arguments. Returns: ``[B, S, D]`` and the present cache."""
        h, present = self.self_attn(self.input_layernorm(x), cos, sin, mask, past, cache, q_scale)
        x = x + self._scaled(h)
        return x + self._scaled(self.mlp(self.post_attention_layernorm(x))), present

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        """A residual branch times the residual scale (MiniCPM3's; no node when it is 1)."""
        return h if self.residual_scale == 1.0 else h * self.residual_scale


class AttentionSublayer(nn.Module):
    """An attention sub-layer with its residual and nothing else: ``x + self_attn(x)`` (no norm, no MLP).

    Parameter names as in a decoder layer (``self_attn.kv_b_proj.weight``, ...).
    """

    def __init__(self, config: MLAConfig, form: str):
        super().__init__()
        self.self_attn = make_attention(config, form)

    def forward(self, x, cos, sin, mask, past, cache, q_scale=None):
        """Args: x ``[B, S, D]`` and the attention's arguments. Returns: ``[B, S, D]`` and the present cache."""
        h, present = self.self_attn(x, cos, sin, mask, past, cache, q_scale)
        return x + h, present


def run_layers(layers: Sequence[nn.Module], rotary_emb: nn.Module, x: torch.Tensor, position_ids: torch.Tensor,
               past: Sequence, cache) -> tuple[torch.Tensor, list]:
    """The layer loop of one step: one rope table and one mask for the step, then every layer in turn.

    Args:
        layers: modules called as ``layer(x, cos, sin, mask, past, cache) -> (x [B, S, D], present)`` (and
            ``q_scale [B, S]`` last, for a model whose queries are scaled by their position: Mistral 4)
            (:class:`DecoderLayer`, :class:`AttentionSublayer`).
        rotary_emb: the :class:`~mla_deploy.model.rope.RotaryEmbedding` giving ``cos, sin`` of the positions.
        x: ``[B, S, D]``, entering the first layer.
        position_ids: ``[B, S]`` int64, the absolute position of each new token.
        past: one cache per layer in the form's layout (the mask is read from the first one's shape).
        cache: the cache policy (:class:`~mla_deploy.model.cache.ConcatCache` or ``StaticCache``).
    Returns:
        ``[B, S, D]`` leaving the last layer and the list of present caches.
    Raises:
        ValueError: not one cache per layer.
    """
    if len(past) != len(layers):
        raise ValueError(f"expected {len(layers)} layer caches, got {len(past)}")
    cos, sin = rotary_emb(position_ids)
    q_scale = rotary_emb.query_scale(position_ids)
    extra = () if q_scale is None else (q_scale,)
    first = past[0]
    while isinstance(first, (tuple, list)):  # (latent, index keys), LongCat's pair, CD's (k, v): the first tensor
        first = first[0]
    mask = cache.mask(x.shape[1], first)
    presents = []
    for layer, layer_past in zip(layers, past):
        x, present = layer(x, cos, sin, mask, layer_past, cache, *extra)
        presents.append(present)
    return x, presents


class AttentionStack(nn.Module):
    """``N`` attention sub-layers of one form chained with residuals, one rope table: ``x <- x + attn_i(x)``.

    The decoder without embedding, norms, MLP/MoE and lm_head (the unit ``mla-deploy bench`` times), run by
    the same layer loop (:func:`run_layers`).

    Args:
        config: the dimensions (``num_hidden_layers`` is ignored: ``layers`` counts).
        layers: number of attention sub-layers.
        form: their attention form (``CD``, ``CC``, ``A_CC``, ``A_CC_ME``).
    """

    def __init__(self, config: MLAConfig, layers: int, form: str = "CC"):
        super().__init__()
        if config.is_sparse:
            raise ConfigError(f"{config.name}: the attention stack times dense MLA over one latent cache per layer; "
                              "DeepSeek Sparse Attention's indexer and its key cache are not part of it (bench the "
                              "whole model instead)")
        self.config = config
        self.layers = nn.ModuleList(AttentionSublayer(config, form) for _ in range(layers))
        self.rotary_emb = RotaryEmbedding(config)

    @property
    def form(self) -> str:
        """The attention form of the layers."""
        return self.layers[0].self_attn.form

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, past: Sequence, cache=None):
        """Run ``S`` new tokens of each sequence.

        Args:
            x: ``[B, S, D]`` hidden states entering the first sub-layer.
            position_ids: ``[B, S]`` int64, the absolute position of each new token.
            past: one cache per sub-layer, in the form's layout (as :meth:`MLAForCausalLM.empty_cache`).
            cache: a :class:`~mla_deploy.model.cache.ConcatCache` (default) or ``StaticCache`` policy.
        Returns:
            ``[B, S, D]`` and the list of present caches.
        """
        cache = ConcatCache() if cache is None else cache
        return run_layers(self.layers, self.rotary_emb, x, position_ids, past, cache)


class MLAModel(nn.Module):
    """The decoder stack (Hugging Face's ``model.`` prefix)."""

    def __init__(self, config: MLAConfig, form: str):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.attention_per_layer == 2:
            self.layers = nn.ModuleList(LongcatDecoderLayer(config, lambda c: make_attention(c, form))
                                        for _ in range(config.decoder_layers))
        else:
            self.layers = nn.ModuleList(DecoderLayer(config, i, form) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class MLAForCausalLM(nn.Module):
    """DeepSeek-style causal LM with MLA, functional cache.

    Args:
        config: the dimensions.
        form: the attention form of every layer (``CD``, ``CC``, ``A_CC``, ``A_CC_ME``).
    """

    def __init__(self, config: MLAConfig, form: str = "CC"):
        super().__init__()
        self.config = config
        self.model = MLAModel(config, form)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def form(self) -> str:
        """The attention form of the layers."""
        return next(m for m in self.modules() if isinstance(m, MLABase)).form

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, past: Sequence, cache=None,
                logits_index: torch.Tensor | None = None):
        """Run ``S`` new tokens of each sequence.

        Args:
            input_ids: ``[B, S]`` int64.
            position_ids: ``[B, S]`` int64, the absolute position of each new token.
            past: one cache per layer, in the form's layout (see :meth:`empty_cache`); with sparse attention then
                one index-key cache per layer (:func:`layer_caches`).
            cache: a :class:`~mla_deploy.model.cache.ConcatCache` (default) or ``StaticCache`` policy.
            logits_index: ``[B, K]`` int64 positions in ``[0, S)`` whose logits to compute (e.g. each sequence's
                last real token); None: every position (``K = S``).
        Returns:
            logits ``[B, K, vocab_size]`` and the list of present caches.
        """
        cache = ConcatCache() if cache is None else cache
        c = self.config
        x = self.model.embed_tokens(input_ids)
        if c.scale_emb is not None and c.scale_emb != 1:  # MiniCPM3's embedding scale
            x = x * c.scale_emb
        x, presents = run_layers(self.model.layers, self.model.rotary_emb, x, position_ids,
                                 layer_caches(c, past), cache)
        presents = flat_caches(c, presents)
        if logits_index is not None:  # only the rows asked for go through the norm and lm_head
            x = torch.gather(x, 1, logits_index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        x = self.model.norm(x)
        if c.logits_scaling != 1.0:  # MiniCPM3's logit divisor
            x = x / c.logits_scaling
        return self.lm_head(x), presents

    def assign_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Put ``state``'s tensors into this (meta-built) model without copying, rebuild the rope buffer and
        re-tie the embeddings. ``state`` holds every key of :meth:`state_dict` (strict)."""
        self.load_state_dict(state, strict=True, assign=True)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.model.rotary_emb = RotaryEmbedding(self.config).to(self.model.embed_tokens.weight.device)
        assert not any(t.is_meta for t in self.state_dict().values()), "a tensor was left on the meta device"

    def empty_cache(self, batch: int, length: int = 0, layout=None,
                    dtype: torch.dtype | None = None, device=None) -> list:
        """Zero caches for every layer.

        Args:
            batch: B.
            length: rows (``P`` for concat, the capacity ``T_max`` for static).
            layout: a :class:`~mla_deploy.cache_layout.CacheLayout` (e.g. ``STATIC``); None: a growing cache.
        Returns:
            per layer: the latent cache in the layout's shape (concat ``[B, length, C]``, static
            ``[B, 1, length, C]``), then with sparse attention per layer its index-key cache (width
            ``index_head_dim``, :func:`cache_widths`); or for CD ``(k [B, H, length, dn+dr], v [B, H, length, dv])`` (the per-head
            cache has one shape for both layouts).
        """
        c = self.config
        dtype = dtype or self.lm_head.weight.dtype
        device = device or self.lm_head.weight.device
        if self.form == "CD":
            h = c.num_attention_heads
            return [(torch.zeros(batch, h, length, c.qk_head_dim, dtype=dtype, device=device),
                     torch.zeros(batch, h, length, c.v_head_dim, dtype=dtype, device=device))
                    for _ in range(c.num_hidden_layers)]
        out = []
        for width in cache_widths(c):
            if layout is not None:
                out += layout.empty(batch, length, width, 1, dtype=dtype, device=device)
            else:
                out.append(torch.zeros(batch, length, width, dtype=dtype, device=device))
        return out


@torch.no_grad()
def random_tensor(name: str, shape: Sequence[int], std: float = 0.02, seed: int = 0) -> torch.Tensor:
    """The random value :func:`init_random_` gives the tensor ``name``: matrices ``N(0, std)``, 1-D scales
    ``1 + N(0, 0.1)``, 1-D biases ``N(0, 0.1)``; float32.

    Each tensor has its own generator, seeded from ``seed`` and ``name``, so one tensor can be drawn without the
    others (a streamed export) and gets the same values as in a whole model.
    """
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    values = torch.randn(tuple(shape), generator=gen)
    if len(shape) == 1:
        return (0.0 if name.endswith("bias") else 1.0) + 0.1 * values
    return std * values


@torch.no_grad()
def init_random_(model: nn.Module, std: float = 0.02, seed: int = 0) -> nn.Module:
    """Fill every parameter and buffer (rope frequencies excepted) with :func:`random_tensor` values.

    With ``std`` large (e.g. 0.3) mistakes in the attention cannot hide behind small activations.
    """
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if not name.endswith("inv_freq"):
            tensor.copy_(random_tensor(name, tensor.shape, std, seed))
    return model
