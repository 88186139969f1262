"""The inputs of one point, identical for every path: they are drawn from a generator seeded by the point.

* ``hidden [B, 1, D]`` ~ N(0, 1): the hidden state entering the first attention layer.
* ``latent``: per layer ``[B, T, C]`` ~ N(0, 1): the cached rows ``[c_kv | k_pe]`` of the ``T`` earlier tokens
  (k_pe in DeepSeek's interleaved rope layout; V3's transformers code stores it de-interleaved, which the
  transformers path does when it fills its cache).
* The new token's position (= write slot) is ``T`` for every sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ...cache_layout import CacheLayout, CacheState
from ...config import MLAConfig


@dataclass
class PointInputs:
    """Attributes: hidden ``[B, 1, D]``; latent: per layer ``[B, T, C]``; context T; batch B."""

    hidden: torch.Tensor
    latent: list
    context: int
    batch: int

    @property
    def positions(self) -> torch.Tensor:
        """``[B, 1]`` int64: the new token's position."""
        return torch.full((self.batch, 1), self.context, dtype=torch.long)


def point_seed(seed: int, context: int, batch: int, layer: int = -1) -> int:
    return (seed * 1_000_003 + context * 101 + batch * 7 + layer + 1) % (1 << 62)


def make_inputs(config: MLAConfig, layers: int, context: int, batch: int, seed: int = 0) -> PointInputs:
    """The inputs of the point ``(context, batch)``: the same tensors in every process."""
    gen = torch.Generator().manual_seed(point_seed(seed, context, batch))
    hidden = torch.randn(batch, 1, config.hidden_size, generator=gen)
    latent = []
    for i in range(layers):
        gen = torch.Generator().manual_seed(point_seed(seed, context, batch, i))
        latent.append(torch.randn(batch, context, config.latent_dim, generator=gen))
    return PointInputs(hidden, latent, context, batch)


def held_rows(layout: CacheLayout, cache, rows: int):
    """The first ``rows`` slots of one layer's cache in ``layout``, ``[B, rows, C]`` (a view of ``cache``, for
    NumPy arrays and torch tensors alike; a growing layout's cache is returned whole)."""
    return layout.held(cache, CacheState(np.array([rows], dtype=np.int64), []))


def point_state(layout: CacheLayout, inputs: PointInputs, margin: int, allocate: Callable[[tuple[int, ...]], Any],
                adopt: Callable[[torch.Tensor], Any]) -> CacheState:
    """The point's cache as ``layout`` holds it: ``T`` rows per sequence, every one a real token.

    Args:
        layout: the cache layout of the graph.
        inputs: the point (its ``latent`` rows go in).
        margin: a fixed-capacity layout gets ``T + margin`` slots per sequence; a growing one holds ``T`` rows.
        allocate: ``allocate(shape)`` makes one zeroed array of the caller's kind (NumPy, a CUDA tensor).
        adopt: ``adopt(rows)`` is a CPU tensor as an array of that kind (NumPy: the same memory). A cache that is
            exactly the ``T`` rows (a growing layout) is the adopted rows, no copy; otherwise they are copied in.
    Returns:
        the state: ``lengths [B] = T``, ``key_valid [B, T]`` all ones, one cache per layer in the layout's shape
        (:meth:`~mla_deploy.cache_layout.CacheLayout.cache_shape`).
    """
    b, t = inputs.batch, inputs.context
    slots = t + margin if layout.has_capacity else t
    caches = []
    for rows in inputs.latent:
        shape = tuple(layout.cache_shape(b, slots, rows.shape[-1]))
        if tuple(rows.shape) == shape:
            caches.append(adopt(rows))
            continue
        cache = allocate(shape)
        held_rows(layout, cache, t)[...] = adopt(rows)
        caches.append(cache)
    return CacheState(np.full(b, t, dtype=np.int64), caches, np.ones((b, t), dtype=np.int64))
