"""Models with random weights, in any attention form (presets, tests and benchmarks)."""

from __future__ import annotations

import torch

from ..config import MLAConfig
from .absorb import convert_form
from .decoder import MLAForCausalLM, init_random_


def build_model(config: MLAConfig, form: str = "CC", std: float = 0.02, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> MLAForCausalLM:
    """An :class:`MLAForCausalLM` with random weights (see :func:`init_random_`), in eval mode.

    The weights are drawn for the original form and rewritten into ``form``, so every form built
    with the same ``seed`` computes the same function.
    """
    model = init_random_(MLAForCausalLM(config, "CC"), std=std, seed=seed)
    return convert_form(model, form).to(dtype).eval()
