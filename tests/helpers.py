"""Torch-only helpers shared by the model tests: the error measure, tiny configs, and drivers of the cache."""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from mla_deploy.cache_layout import STATIC
from mla_deploy import MLAConfig, load_recipe
from mla_deploy.model import ConcatCache, StaticCache, build_model

TOL = 1e-5  # max|diff| / max|ref|, float32 on CPU: the acceptance bound
BROKEN = 1e-2  # a deliberate mistake must exceed this


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|out - ref| / max|ref|``: the error relative to the reference's scale."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max())


def tiny_config(q_lora: bool = True, yarn: bool = True) -> MLAConfig:
    """The ``tiny`` preset (q compression and YaRN with mscale on), optionally without either."""
    config = load_recipe("tiny").model
    if not q_lora:
        config = config.replace(q_lora_rank=None)
    if not yarn:
        config = config.replace(rope_scaling=None)
    return config


@functools.lru_cache(maxsize=None)
def tiny_model(form: str, q_lora: bool = True, yarn: bool = True, seed: int = 0):
    """``build_model(tiny_config(...), form, std=0.3, seed)``: same seed, same function in every form."""
    return build_model(tiny_config(q_lora, yarn), form, std=0.3, seed=seed)


def positions(batch: int, start: int, length: int) -> torch.Tensor:
    """``[batch, length]`` int64 positions ``start .. start+length-1``."""
    return torch.arange(start, start + length).expand(batch, length)


@torch.no_grad()
def run_chunks(model, ids: torch.Tensor, chunks: Sequence[int]) -> tuple[list[torch.Tensor], list]:
    """Feed ``ids [B, N]`` through ``model`` chunk by chunk from position 0, through a concat cache.

    Returns: the logits of each chunk and the final present caches.
    """
    batch = ids.shape[0]
    past, outs, start = model.empty_cache(batch), [], 0
    for n in chunks:
        logits, past = model(ids[:, start:start + n], positions(batch, start, n), past)
        outs.append(logits)
        start += n
    assert start == ids.shape[1]
    return outs, past


@torch.no_grad()
def run_padded_batch(model, prompt: torch.Tensor, lengths: torch.Tensor, steps: torch.Tensor,
                     static: bool, capacity: int = 32) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Prefill a right-padded batch, then decode ``steps [B, K]`` one token at a time.

    Args:
        prompt: ``[B, P]`` right-padded prompts; lengths ``[B]``: the real length of each.
        static: True: ``StaticCache`` of ``capacity`` slots; False: ``ConcatCache`` with the attention mask.
    Returns: prefill logits ``[B, P, V]`` and the decode logits of each step ``[B, 1, V]``.
    """
    batch, width = prompt.shape
    if static:
        past = model.empty_cache(batch, capacity, layout=STATIC)
        cache = StaticCache(torch.zeros(batch, dtype=torch.long))
    else:
        past = model.empty_cache(batch)
        valid = (torch.arange(width) < lengths.unsqueeze(1)).long()  # HF attention_mask
        cache = ConcatCache(key_valid=valid)
    prefill, past = model(prompt, positions(batch, 0, width), past, cache)
    decoded = []
    for t in range(steps.shape[1]):
        pos = (lengths + t).unsqueeze(1)  # [B, 1]
        if static:
            cache = StaticCache(lengths + t)
        else:
            valid = torch.cat((valid, torch.ones(batch, 1, dtype=torch.long)), dim=1)
            cache = ConcatCache(key_valid=valid)
        logits, past = model(steps[:, t:t + 1], pos, past, cache)
        decoded.append(logits)
    return prefill, decoded
