"""The absorbed rewrite: a pure weight transform plus a module swap (gpt-fast style).

* :func:`absorb_state_dict` maps an original-form state dict to the absorbed one: each layer's
  ``kv_b_proj.weight [H*(dn+dv), r]`` becomes ``w_uk [H, dn, r]`` and ``w_uv [H, dv, r]``; every other
  tensor is unchanged.
* :func:`convert_form` rewrites every MLA attention module into any form (original <-> absorbed moves
  ``kv_b_proj`` <-> ``w_uk``/``w_uv``), in place: the module swap.
* :func:`absorb` is the user-facing entry: ``convert_form`` into an absorbed form; given a transformers
  DeepSeek-V2/V3 model it returns an absorbed :class:`~mla_deploy.model.decoder.MLAForCausalLM` sharing
  that model's tensors.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from ..config import MLAConfig
from .mla import ABSORBED_FORMS, FORMS, AbsorbedMLAttention, MLABase, MLAttention

_KV_B = "kv_b_proj.weight"


def split_kv_b(weight: torch.Tensor, config: MLAConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``kv_b_proj.weight [H*(dn+dv), r]`` into ``W_UK [H, dn, r]`` and ``W_UV [H, dv, r]``."""
    c = config
    expected = (c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
    if tuple(weight.shape) != expected:
        raise ValueError(f"kv_b_proj.weight has shape {tuple(weight.shape)}, expected {expected}")
    per_head = weight.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
    return per_head[:, : c.qk_nope_head_dim].clone(), per_head[:, c.qk_nope_head_dim :].clone()


def absorb_state_dict(state_dict: Mapping[str, torch.Tensor], config: MLAConfig) -> dict[str, torch.Tensor]:
    """The absorbed form's state dict: every ``*.kv_b_proj.weight`` replaced by ``*.w_uk`` and ``*.w_uv``."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key == _KV_B or key.endswith("." + _KV_B):
            prefix = key[: -len(_KV_B)]
            out[prefix + "w_uk"], out[prefix + "w_uv"] = split_kv_b(value, config)
        else:
            out[key] = value
    return out


def unabsorb_state_dict(state_dict: Mapping[str, torch.Tensor], config: MLAConfig) -> dict[str, torch.Tensor]:
    """The inverse of :func:`absorb_state_dict` (``w_uk``/``w_uv`` back into ``kv_b_proj.weight``)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key.endswith("w_uv"):
            continue
        if key == "w_uk" or key.endswith(".w_uk"):
            prefix = key[: -len("w_uk")]
            w = torch.cat((value, state_dict[prefix + "w_uv"]), dim=1)  # [H, dn+dv, r]
            out[prefix + _KV_B] = w.reshape(-1, config.kv_lora_rank).clone()
        else:
            out[key] = value
    return out


def _swap(model: nn.Module, make) -> int:
    """Replace every MLA attention module ``m`` (at any depth) by ``make(m)``; returns how many."""
    count = 0
    for name, child in list(model.named_children()):
        if isinstance(child, MLABase):
            setattr(model, name, make(child))
            count += 1
        else:
            count += _swap(child, make)
    return count


def convert_form(model: nn.Module, form: str = "A_CC") -> nn.Module:
    """Rewrite every MLA attention of ``model`` into ``form`` in place, outputs unchanged; returns ``model``.

    Original <-> absorbed moves ``kv_b_proj`` <-> ``w_uk``/``w_uv``; CD <-> CC and A_CC <-> A_CC_ME share
    their parameters and only change how attention is computed and what is cached.
    """
    if form not in FORMS:
        raise ValueError(f"unknown attention form {form!r}; choose one of {FORMS}")

    def make(old: MLABase) -> MLABase:
        config = old.config
        target = AbsorbedMLAttention if form in ABSORBED_FORMS else MLAttention
        state = old.state_dict()
        if isinstance(old, MLAttention) and target is AbsorbedMLAttention:
            state = absorb_state_dict(state, config)
        elif isinstance(old, AbsorbedMLAttention) and target is MLAttention:
            state = unabsorb_state_dict(state, config)
        with torch.device("meta"):
            new = target(config, form)
        new.load_state_dict(state, strict=True, assign=True)
        return new.train(old.training)

    if _swap(model, make) == 0:
        raise ValueError("the model holds no MLA attention module to rewrite")
    return model


def absorb(model: nn.Module, form: str = "A_CC") -> nn.Module:
    """The absorbed form of ``model`` (outputs unchanged up to rounding).

    Args:
        model: an :class:`~mla_deploy.model.decoder.MLAForCausalLM` (or any module holding MLA attention),
            rewritten in place and returned; or a transformers ``DeepseekV2ForCausalLM`` /
            ``DeepseekV3ForCausalLM``, left untouched: a new ``MLAForCausalLM`` is returned that shares the
            HF model's tensors (same storage; only ``kv_b_proj.weight [H*(dn+dv), r]`` is split into new
            ``w_uk [H, dn, r]`` and ``w_uv [H, dv, r]``), so an in-place change to one is seen by the other.
            It computes the same logits as the HF model.
        form: ``A_CC`` (concatenated 576-wide scores) or ``A_CC_ME`` (summed score terms).
    """
    if form not in ABSORBED_FORMS:
        raise ValueError(f"absorbed form must be one of {ABSORBED_FORMS}, got {form!r}")
    from .hf import from_hf_model, is_hf_deepseek

    if is_hf_deepseek(model):
        model = from_hf_model(model)
    return convert_form(model, form)
