"""LongCat-Flash's decoder layer (transformers' ``LongcatFlashDecoderLayer``), parameters named as transformers'.

One layer holds two MLA sub-layers, each with its own latent cache, two dense MLPs and a shortcut MoE::

    x = x + attn_0(ln_in_0(x));  h = ln_post_0(x);  m = moe(h);  x = x + mlp_0(h)
    x = x + attn_1(ln_in_1(x));  x = x + mlp_1(ln_post_1(x)) + m

The MoE routes by softmax over ``n_routed_experts + zero_expert_num`` logits (``e_score_correction_bias`` added for
the choice only), weights not renormalised, times ``routed_scaling_factor``. A zero expert is the identity: the
token, times its weight. The routed experts run as the sparse :func:`~mla_deploy.model.layers.moe_experts` over the
``k`` best *real* experts, those outside the token's top ``k`` weighted 0 (the top ``k`` over all experts holds the
best of the real ones, so the real experts chosen are among them): the operator keeps its contract (``k`` distinct
experts in ``[0, E)``) and the graph's export forms stay as they are; the zero experts add their weights times the
token. Exact, at the cost of running ``k`` real experts for every token.

transformers scales the query and the cached ``kv_a_layernorm`` output by ``sqrt(hidden_size / q_lora_rank)`` and
``sqrt(hidden_size / kv_lora_rank)``; :func:`fold_latent_scales` folds them into ``q_b_proj`` and
``kv_a_layernorm`` when weights are loaded, so the attention is DeepSeek's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import MLAConfig
from .layers import MLP, Experts, RMSNorm


class LongcatRouter(nn.Module):
    """Softmax scores over the real then the zero experts; the choice adds ``e_score_correction_bias``."""

    def __init__(self, config: MLAConfig):
        super().__init__()
        self.config = config
        total = config.n_routed_experts + config.zero_expert_num
        self.classifier = nn.Linear(config.hidden_size, total, bias=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(total))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Args: x ``[T, D]``. Returns: the real experts' weights ``[T, k]`` float32 (0 where not chosen), their
        indices ``[T, k]`` int64 (distinct, in ``[0, E)``) and the zero experts' summed weight ``[T, 1]`` float32."""
        c = self.config
        scores = F.linear(x.float(), self.classifier.weight.float()).softmax(-1)  # [T, E + Z]
        choice = scores + self.e_score_correction_bias
        chosen = torch.zeros_like(scores).scatter(-1, choice.topk(c.num_experts_per_tok, dim=-1).indices, 1.0)
        kept = scores * chosen * c.routed_scaling_factor  # [T, E + Z]: the weight of each chosen expert, else 0
        real = choice[:, : c.n_routed_experts].topk(c.num_experts_per_tok, dim=-1).indices  # [T, k]
        return kept.gather(-1, real), real, kept[:, c.n_routed_experts:].sum(-1, keepdim=True)


class LongcatMoE(nn.Module):
    """The shortcut MoE: routed experts (``experts.gate_up_proj [E, 2I, D]``, ``experts.down_proj [E, D, I]``) and
    zero experts; no shared experts."""

    def __init__(self, config: MLAConfig):
        super().__init__()
        self.router = LongcatRouter(config)
        self.experts = Experts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x ``[B, S, D]``. Returns: ``[B, S, D]``."""
        flat = x.flatten(0, -2)
        weights, idx, identity = self.router(flat)
        out = self.experts(flat, weights, idx)
        if self.router.config.zero_expert_num:  # no node without zero experts
            out = out + (identity * flat.float()).to(flat.dtype)
        return out.view_as(x)


class LongcatDecoderLayer(nn.Module):
    """One LongCat-Flash layer: two MLA sub-layers, two dense MLPs, the shortcut MoE (module docstring).

    Args:
        config: the dimensions (``model_type`` ``longcat_flash``).
        make_attention: ``make_attention(config)`` -> one MLA module of the model's form.
    """

    def __init__(self, config: MLAConfig, make_attention):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = nn.ModuleList(make_attention(config) for _ in range(2))
        self.mlps = nn.ModuleList(MLP(d, config.intermediate_size) for _ in range(2))
        self.input_layernorm = nn.ModuleList(RMSNorm(d, eps) for _ in range(2))
        self.post_attention_layernorm = nn.ModuleList(RMSNorm(d, eps) for _ in range(2))
        self.mlp = LongcatMoE(config)

    def forward(self, x, cos, sin, mask, past, cache, q_scale=None):
        """Args: x ``[B, S, D]``, ``past`` the pair of the sub-layers' caches, the rest as
        :class:`~mla_deploy.model.decoder.DecoderLayer`'s. Returns: ``[B, S, D]`` and the pair of present caches."""
        h, present_0 = self.self_attn[0](self.input_layernorm[0](x), cos, sin, mask, past[0], cache, q_scale)
        x = x + h
        h = self.post_attention_layernorm[0](x)
        shortcut = self.mlp(h)
        x = x + self.mlps[0](h)
        h, present_1 = self.self_attn[1](self.input_layernorm[1](x), cos, sin, mask, past[1], cache, q_scale)
        x = x + h
        x = x + self.mlps[1](self.post_attention_layernorm[1](x)) + shortcut
        return x, (present_0, present_1)


def fold_latent_scales(key: str, tensor: torch.Tensor, config: MLAConfig) -> torch.Tensor:
    """``tensor`` (our state-dict entry ``key``) with LongCat's latent scales folded in: ``q_b_proj.weight`` times
    ``sqrt(hidden_size / q_lora_rank)`` (the scale of every query channel), ``kv_a_layernorm.weight`` times
    ``sqrt(hidden_size / kv_lora_rank)`` (the cached latent's). Other keys and other model types: unchanged."""
    if config.model_type != "longcat_flash":
        return tensor
    if key.endswith("self_attn.0.q_b_proj.weight") or key.endswith("self_attn.1.q_b_proj.weight"):
        return tensor * math.sqrt(config.hidden_size / config.q_lora_rank)
    if key.endswith("self_attn.0.kv_a_layernorm.weight") or key.endswith("self_attn.1.kv_a_layernorm.weight"):
        return tensor * math.sqrt(config.hidden_size / config.kv_lora_rank)
    return tensor
