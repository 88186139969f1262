"""Export-friendly wrappers: flat, named tensor I/O around the models (see :mod:`mla_deploy.io_spec` and
:mod:`mla_deploy.cache_layout`)."""

from __future__ import annotations

import torch
from torch import nn

from ..cache_layout import CacheLayout, get_layout
from ..model.baselines import LatentCrossAttention, MultiHeadAttention
from ..model.decoder import MLAForCausalLM


class DecoderGraph(nn.Module):
    """``(input_ids, position_ids, control, *past_latent) -> (logits, *present_latent)``, the control input being
    the layout's (``attention_mask`` or ``write_indices``).

    Any module called as ``model(x, position_ids, past: list, cache_policy) -> (out, presents)`` fits (the
    decoder, or an attention stack whose ``x`` is ``hidden_states``).

    Args:
        model: the decoder (its attention form decides prefill vs decode math).
        layout: the cache layout (a :class:`~mla_deploy.cache_layout.CacheLayout` or its mode name).
    """

    def __init__(self, model: nn.Module, layout: CacheLayout | str):
        super().__init__()
        self.model = model
        self.layout = get_layout(layout)

    def forward(self, input_ids, position_ids, control, *past):
        """Shapes as :meth:`CacheLayout.io <mla_deploy.cache_layout.CacheLayout.io>` gives them: ids and positions
        ``[B, S]``, ``control`` the layout's, ``past`` one cache per layer."""
        logits, presents = self.model(input_ids, position_ids, list(past), self.layout.policy(control))
        return (logits, *presents)


class CausalLMGraph(nn.Module):
    """The language model's graph: ``(input_ids, position_ids, logits_index, control, *past_latent) -> (logits,
    *present_latent)`` (:meth:`CacheLayout.io <mla_deploy.cache_layout.CacheLayout.io>`'s default I/O).

    Args:
        model: the decoder (its attention form decides prefill vs decode math).
        layout: the cache layout (a :class:`~mla_deploy.cache_layout.CacheLayout` or its mode name).
    """

    def __init__(self, model: MLAForCausalLM, layout: CacheLayout | str):
        super().__init__()
        self.model = model
        self.layout = get_layout(layout)

    def forward(self, input_ids, position_ids, logits_index, control, *past):
        """ids and positions ``[B, S]``; ``logits_index [B, K]`` (positions whose logits are computed);
        ``control`` the layout's; ``past`` one cache per layer. Returns logits ``[B, K, V]`` and the presents."""
        logits, presents = self.model(input_ids, position_ids, list(past), self.layout.policy(control), logits_index)
        return (logits, *presents)


class MHAGraph(nn.Module):
    """Textbook MHA block: ``(hidden_states, position_ids, past_key, past_value) -> (output, present_key, present_value)``."""

    def __init__(self, block: MultiHeadAttention):
        super().__init__()
        self.block = block

    def forward(self, hidden_states, position_ids, past_key, past_value):
        """hidden_states ``[B, S, D]``; position_ids ``[B, S]``; past ``[B, H, P, d_h]``."""
        out, (k, v) = self.block(hidden_states, position_ids, (past_key, past_value))
        return out, k, v


class LatentCrossAttentionGraph(nn.Module):
    """Perceiver-style block: ``(inputs [B, N, d_in]) -> (latents [B, M, d_model])``; no cache."""

    def __init__(self, block: LatentCrossAttention):
        super().__init__()
        self.block = block

    def forward(self, inputs):
        return self.block(inputs)


def example_decoder_inputs(model: MLAForCausalLM, layout: CacheLayout | str, capacity: int, dtype: torch.dtype):
    """Example inputs for tracing :class:`CausalLMGraph`, every dynamic axis >= 2 (an axis traced at 1 is frozen).

    Args:
        model: the decoder (its config gives the cache width and layer count).
        layout: the cache layout.
        capacity: the cache slots of a fixed-capacity layout (unused by a growing one).
        dtype: the caches' dtype.
    Returns:
        ``(input_ids [2, 3], position_ids [2, 3], logits_index [2, 2], control, *caches)``: batch 2, 3 new tokens
        after 5 cached ones, logits for 2 of them (an axis of its own, traced at a size unlike the others).
    """
    batch, seq, past = 2, 3, 5
    config = model.config
    ids = torch.zeros(batch, seq, dtype=torch.long)
    positions = torch.arange(past, past + seq).expand(batch, seq).contiguous()
    logits_index = torch.tensor([[2, 0], [1, 2]], dtype=torch.long)
    control, caches = get_layout(layout).example_caches(config, batch, past, seq, capacity, dtype)
    return (ids, positions, logits_index, control, *caches)
