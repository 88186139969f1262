"""Export-friendly wrappers: flat, named tensor I/O around the models (see :mod:`mla_deploy.io_spec`)."""

from __future__ import annotations

import torch
from torch import nn

from ..model.baselines import LatentCrossAttention, MultiHeadAttention
from ..model.cache import ConcatCache, StaticCache
from ..model.decoder import MLAForCausalLM


class DecoderGraph(nn.Module):
    """``(input_ids, position_ids, attention_mask | write_indices, *past_latent) -> (logits, *present_latent)``.

    Args:
        model: the decoder (its attention form decides prefill vs decode math).
        cache_mode: ``concat`` or ``static``.
    """

    def __init__(self, model: MLAForCausalLM, cache_mode: str):
        super().__init__()
        self.model = model
        self.cache_mode = cache_mode

    def forward(self, input_ids, position_ids, mask_or_indices, *past):
        """Shapes as in :func:`mla_deploy.io_spec.decoder_io`."""
        cache = ConcatCache(mask_or_indices) if self.cache_mode == "concat" else StaticCache(mask_or_indices)
        logits, presents = self.model(input_ids, position_ids, list(past), cache)
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


def example_decoder_inputs(model: MLAForCausalLM, cache_mode: str, capacity: int, dtype: torch.dtype):
    """Example inputs for tracing, every dynamic axis >= 2 (an axis traced at 1 is frozen to a constant).

    Returns: (args tuple, batch, seq, past) with batch 2, sequence 3, past 5 (static: capacity rows).
    """
    batch, seq, past = 2, 3, 5
    ids = torch.zeros(batch, seq, dtype=torch.long)
    positions = torch.arange(past, past + seq).expand(batch, seq).contiguous()
    if cache_mode == "concat":
        cache = model.empty_cache(batch, past, dtype=dtype)
        mask_or_indices = torch.ones(batch, past + seq, dtype=torch.long)
    else:
        cache = model.empty_cache(batch, capacity, layout="static", dtype=dtype)
        mask_or_indices = torch.full((batch,), past, dtype=torch.long)
    return (ids, positions, mask_or_indices, *cache)
