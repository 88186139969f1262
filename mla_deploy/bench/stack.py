"""The benched unit: the decode step of ``N`` MLA attention sub-layers, chained with residuals.

``x <- x + attn_i(x)`` for ``i = 0 .. N-1``, one rope table for the step, one latent cache per layer.
No RMSNorm, MLP/MoE, embedding or lm_head: the issue's targets are for DeepSeek attention shapes, and the
naive transformers path is timed as the same unit (its ``DeepseekV2Attention`` / ``DeepseekV3Attention``
layers with their cache). Every path gets the same weights (drawn once for the original form, then
rewritten) and the same inputs.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import MLAConfig
from ..model.absorb import convert_form
from ..model.decoder import init_random_
from ..model.mla import MLAttention
from ..model.rope import RotaryEmbedding


class AttentionStack(nn.Module):
    """``N`` attention sub-layers of one form sharing a rope table.

    Args:
        config: the model's dimensions (``num_hidden_layers`` is ignored; ``layers`` counts).
        layers: the attention modules (:class:`~mla_deploy.model.mla.MLAttention` or ``AbsorbedMLAttention``).
    """

    def __init__(self, config: MLAConfig, layers: list[nn.Module]):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(layers)
        self.rotary_emb = RotaryEmbedding(config)

    @property
    def form(self) -> str:
        return self.layers[0].form

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, past: list, cache):
        """Args:
            x ``[B, S, D]``; position_ids ``[B, S]`` int64; past: one cache per layer in the form's layout;
            cache: a :class:`~mla_deploy.model.cache.ConcatCache` or ``StaticCache`` policy.
        Returns: ``[B, S, D]`` and the present caches.
        """
        cos, sin = self.rotary_emb(position_ids)
        first = past[0][0] if isinstance(past[0], (tuple, list)) else past[0]
        mask = cache.mask(x.shape[1], first)
        presents = []
        for layer, layer_past in zip(self.layers, past):
            h, present = layer(x, cos, sin, mask, layer_past, cache)
            x = x + h
            presents.append(present)
        return x, presents


def build_stack(config: MLAConfig, layers: int, form: str, std: float = 0.02, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> AttentionStack:
    """An :class:`AttentionStack` of ``layers`` attention sub-layers in ``form``, eval mode.

    The weights are drawn for the original (``CC``) form with :func:`~mla_deploy.model.decoder.init_random_`
    and rewritten into ``form``, so every form built with the same ``seed`` computes the same function.
    """
    stack = AttentionStack(config, [MLAttention(config, "CC") for _ in range(layers)])
    init_random_(stack, std=std, seed=seed)
    if form != "CC":
        convert_form(stack, form)
    return stack.to(dtype).eval()
