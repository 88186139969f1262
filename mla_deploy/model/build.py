"""Models with random weights, in any attention form (presets, tests and benchmarks).

The weights are drawn for the original (``CC``) form with :func:`~mla_deploy.model.decoder.init_random_` and
rewritten into the requested form, so every form built with the same ``seed`` computes the same function.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import MLAConfig
from .absorb import convert_form
from .decoder import AttentionStack, MLAForCausalLM, init_random_


def _random(module: nn.Module, form: str, std: float, seed: int, dtype: torch.dtype) -> nn.Module:
    """``module`` (built in ``CC`` form) filled with random weights, rewritten into ``form``, cast, eval mode."""
    init_random_(module, std=std, seed=seed)
    return convert_form(module, form).to(dtype).eval()


def build_model(config: MLAConfig, form: str = "CC", std: float = 0.02, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> MLAForCausalLM:
    """An :class:`MLAForCausalLM` with random weights (see :func:`init_random_`), in eval mode."""
    return _random(MLAForCausalLM(config, "CC"), form, std, seed, dtype)


def build_stack(config: MLAConfig, layers: int, form: str = "CC", std: float = 0.02, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> AttentionStack:
    """An :class:`~mla_deploy.model.decoder.AttentionStack` of ``layers`` attention sub-layers with random weights:
    the decode step ``x <- x + attn_i(x)`` the bench times (no norms, MLP or MoE)."""
    return _random(AttentionStack(config, layers, "CC"), form, std, seed, dtype)
