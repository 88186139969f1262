"""What one step of the whole model must read and compute (the whole-model bench's bound), and how much memory
each of its paths needs. The weights' bytes, sorted by how a step reads them, are :mod:`mla_deploy.weight_bytes`'s.

A step of ``n`` tokens per sequence over ``B`` sequences, each holding ``P`` cached rows:

    bytes = always + sum_l distinct_experts_l * expert + lm_head + distinct_ids * embedding_row
            + B * P * C * itemsize * layers                  (the latent cache, read once)
    FLOPs = 2 * B*n * (always matrices + k * expert * MoE layers)          (projections, MLPs, routers)
            + attention_flops(rows attended)                             (absorbed MLA, C-wide scores)
            + 2 * B * lm_head                                            (logits of one token per sequence)

The logits of one token per sequence are what generation needs; a graph that computes the logits of every
prompt token does more than the bound counts.
"""

from __future__ import annotations

import math
from typing import Sequence

from ...cache_layout import cache_elements_per_token
from ...config import MLAConfig
from ...weight_bytes import PROCESS_OVERHEAD, WeightGroups
from ..bound import attention_flops

#: the context is filled with prefill steps whose attention scores and logits stay below this many bytes
CHUNK_BYTES = 256 << 20
#: and no longer than this many tokens per sequence
MAX_CHUNK = 512


def expected_distinct_experts(n_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts ``tokens`` tokens route to in one layer when each picks ``top_k`` of ``n_experts``
    uniformly at random: ``E * (1 - (1 - k/E)^tokens)`` (the fallback when routing cannot be measured)."""
    if not n_experts or not top_k:
        return 0.0
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)


def step_cost(config: MLAConfig, groups: WeightGroups, batch: int, new: int, held: int,
              distinct_experts: Sequence[float], distinct_ids: int, cache_itemsize: int | None = None) -> dict:
    """Bytes and FLOPs of one step (see the module docstring).

    Args:
        batch: sequences B.
        new: new tokens per sequence (1 for decode, the prompt length for a prefill).
        held: cached rows per sequence before the step (P).
        distinct_experts: per MoE layer, the distinct experts the step routes to (measured or expected).
        distinct_ids: distinct token ids among the step's B * new tokens.
        cache_itemsize: bytes per cached value (default: the weights').
    Returns:
        ``{"weight_bytes", "expert_bytes", "cache_bytes", "bytes", "flops", "attention_flops"}``.
    """
    if len(distinct_experts) != len(groups.moe_layers):
        raise ValueError(f"{len(distinct_experts)} expert counts for {len(groups.moe_layers)} MoE layers")
    itemsize = cache_itemsize or groups.itemsize
    experts = sum(distinct_experts) * groups.expert_bytes
    weights = groups.always_bytes + experts + groups.lm_head_bytes + distinct_ids * groups.embedding_row_bytes
    cache = batch * held * cache_elements_per_token(config) * itemsize * config.num_hidden_layers
    tokens = batch * new
    per_token = groups.always_matrix_params + groups.top_k * groups.expert_params * len(groups.moe_layers)
    # token i of a sequence attends to the held rows and the new rows up to itself
    rows = batch * (new * held + new * (new + 1) // 2)
    attention = attention_flops(config, rows) * config.num_hidden_layers
    flops = 2 * tokens * per_token + attention + 2 * batch * groups.lm_head_params
    return {"weight_bytes": int(weights), "expert_bytes": int(experts), "cache_bytes": int(cache),
            "bytes": int(weights + cache), "flops": int(flops), "attention_flops": int(attention)}


def fill_chunk(config: MLAConfig, batch: int, total: int, itemsize: int = 4) -> int:
    """Tokens per sequence per prefill step when filling a context of ``total`` tokens: the largest power of two
    (at most :data:`MAX_CHUNK`) whose logits ``[B, n, V]`` and attention scores ``[B, H, n, total]`` each stay
    below :data:`CHUNK_BYTES`; at least 1."""
    per_token = batch * itemsize * max(config.vocab_size, config.num_attention_heads * max(total, 1))
    n = max(1, min(MAX_CHUNK, CHUNK_BYTES // per_token, max(total, 1)))
    return 1 << int(math.log2(n))


def cache_bytes(config: MLAConfig, batch: int, rows: int, itemsize: int = 4) -> int:
    """The cache of ``batch`` sequences of ``rows`` rows, every layer (the latent rows; with sparse attention the
    index keys too)."""
    return batch * rows * cache_elements_per_token(config) * itemsize * config.num_hidden_layers


def point_bytes(config: MLAConfig, batch: int, rows: int, chunk: int, itemsize: int = 4) -> int:
    """Bytes one point needs beside the weights: the cache of ``batch`` sequences of ``rows`` rows (twice: a
    growing cache is copied by each step), the logits and attention scores of a ``chunk``-token step."""
    transient = batch * chunk * itemsize * (config.vocab_size + 2 * config.num_attention_heads * rows)
    return int(2 * cache_bytes(config, batch, rows, itemsize) + transient)


def memory_estimate(config: MLAConfig, groups: WeightGroups, batch: int, rows: int, chunk: int) -> int:
    """Bytes one path's process needs: its weights, :func:`point_bytes`, the interpreter and runtimes."""
    return int(groups.total_bytes + point_bytes(config, batch, rows, chunk, groups.itemsize) + PROCESS_OVERHEAD)
