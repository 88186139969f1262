"""The inputs of one point, identical for every path: they are drawn from a generator seeded by the point.

* ``hidden [B, 1, D]`` ~ N(0, 1): the hidden state entering the first attention layer.
* ``latent``: per layer ``[B, T, C]`` ~ N(0, 1): the cached rows ``[c_kv | k_pe]`` of the ``T`` earlier tokens
  (k_pe in DeepSeek's interleaved rope layout; V3's transformers code stores it de-interleaved, which the
  transformers path does when it fills its cache).
* The new token's position (= write slot) is ``T`` for every sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import MLAConfig


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
