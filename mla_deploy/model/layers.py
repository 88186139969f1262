"""The non-attention parts of a DeepSeek decoder layer: RMSNorm, SwiGLU MLP, MoE with shared experts.

Parameter names match Hugging Face transformers' DeepSeek-V2/V3 modules (its in-memory MoE layout:
``experts.gate_up_proj [E, 2*I, D]`` and ``experts.down_proj [E, D, I]``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import MLAConfig


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, the statistics in float32 (as DeepSeek and transformers).

    Written as a division by the square root (transformers multiplies by ``rsqrt``; the two differ by a rounding):
    ONNX Runtime fuses this form of the exported graph into one ``SimplifiedLayerNormalization`` node, where the
    ``rsqrt`` form stays seven nodes (``Pow``, ``ReduceMean``, ``Add``, ``Sqrt``, ``Reciprocal``, ``Mul``, ``Mul``),
    each a kernel launch in every decode step."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x ``[..., dim]``. Returns: ``[..., dim]`` in x's dtype."""
        h = x.float()
        h = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x ``[..., D]``. Returns: ``[..., D]``."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Top-k expert choice: DeepSeek-V2's (softmax; greedy or group-limited by each group's best expert), DeepSeek-V3's
    (``noaux_tc``: sigmoid plus ``e_score_correction_bias`` for the choice, groups ranked by their best two experts)
    and Mistral 4's (``noaux_tc`` over softmax scores, no correction bias). ``norm_topk_prob`` renormalises the
    chosen weights of ``noaux_tc`` (V2 never renormalises)."""

    def __init__(self, config: MLAConfig):
        super().__init__()
        assert config.n_routed_experts is not None
        self.config = config
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        if config.scoring_func == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Args: x ``[T, D]``. Returns: weights ``[T, k]`` float32 and expert indices ``[T, k]`` int64."""
        c = self.config
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        groups = (c.n_group, c.n_routed_experts // c.n_group)
        if c.topk_method == "noaux_tc":
            if c.scoring_func == "sigmoid":
                scores = logits.sigmoid()
                choice = scores + self.e_score_correction_bias
            else:
                scores = choice = logits.softmax(-1)
            group_scores = choice.unflatten(-1, groups).topk(2, dim=-1).values.sum(-1)  # [T, G]
            choice = _keep_groups(choice, group_scores, c.topk_group, groups, float("-inf"))
            idx = choice.topk(c.num_experts_per_tok, dim=-1).indices
            weights = scores.gather(-1, idx)
            if c.norm_topk_prob:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        else:
            scores = logits.softmax(-1)
            if c.topk_method == "group_limited_greedy":
                group_scores = scores.unflatten(-1, groups).amax(-1)  # [T, G]
                scores = _keep_groups(scores, group_scores, c.topk_group, groups, 0.0)
            weights, idx = scores.topk(c.num_experts_per_tok, dim=-1)
        return weights * c.routed_scaling_factor, idx


def _keep_groups(scores: torch.Tensor, group_scores: torch.Tensor, keep: int, groups: tuple[int, int],
                 fill: float) -> torch.Tensor:
    """Set the scores of experts outside the ``keep`` best groups to ``fill``. scores ``[T, E]``."""
    top = group_scores.topk(keep, dim=-1).indices  # [T, keep]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(-1, top, True)  # [T, G]
    expert_mask = group_mask.unsqueeze(-1).expand(-1, *groups).flatten(-2)  # [T, E]
    return scores.masked_fill(~expert_mask, fill)


@torch.library.custom_op("mla_deploy::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, gate_up_proj: torch.Tensor,
                down_proj: torch.Tensor) -> torch.Tensor:
    """The routed experts, sparse: each expert runs only on the tokens routed to it (DeepSeek's ``moe_infer``).

    ``y[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))`` with ``e = idx[t, j]``; each expert's
    output is in ``x``'s dtype, weighted and summed in ``weights``' dtype (float32), the sum cast to ``x``'s dtype.
    At ONNX export it becomes one static branch per expert (:mod:`mla_deploy.exporter.moe_onnx`).

    Args:
        x: ``[T, D]``.
        weights: ``[T, k]`` routing weights (float32).
        idx: ``[T, k]`` int64 expert of each choice, distinct within a row, in ``[0, E)``.
        gate_up_proj: ``[E, 2*I, D]``, the gate rows first.
        down_proj: ``[E, D, I]``.
    Returns:
        ``[T, D]`` in ``x``'s dtype.
    """
    out = torch.zeros(x.shape[0], x.shape[1], dtype=weights.dtype, device=x.device)
    for e in torch.bincount(idx.flatten(), minlength=gate_up_proj.shape[0]).nonzero().flatten().tolist():
        tok, pos = torch.where(idx == e)  # [n] each: the tokens routed to e and which of their k choices it is
        gate, up = F.linear(x.index_select(0, tok), gate_up_proj[e]).chunk(2, dim=-1)  # [n, I] each
        h = F.linear(F.silu(gate) * up, down_proj[e])  # [n, D]
        out.index_add_(0, tok, h.to(weights.dtype) * weights[tok, pos, None])
    return out.to(x.dtype)


@moe_experts.register_fake
def _moe_experts_fake(x, weights, idx, gate_up_proj, down_proj):
    return torch.empty_like(x)


def dense_experts_reference(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, gate_up_proj: torch.Tensor,
                            down_proj: torch.Tensor) -> torch.Tensor:
    """:func:`moe_experts` computed densely, every expert on every token (standard ops, no loop): a numerical
    reference for tests, and a formulation the export's check
    (:func:`~mla_deploy.exporter.moe_onnx.dense_expert_products`) must refuse.

    Args and returns as :func:`moe_experts`.
    """
    dense = torch.zeros(x.shape[0], gate_up_proj.shape[0], dtype=weights.dtype, device=x.device)
    dense = dense.scatter_add(-1, idx, weights)  # [T, E]
    gate, up = torch.einsum("td,eid->tei", x, gate_up_proj).chunk(2, dim=-1)  # [T, E, I] each
    h = torch.einsum("tei,edi->ted", F.silu(gate) * up, down_proj)  # [T, E, D]
    return torch.einsum("te,ted->td", dense, h.to(weights.dtype)).to(x.dtype)


class Experts(nn.Module):
    """The routed experts, stored stacked: ``gate_up_proj [E, 2*I, D]`` (gate rows first), ``down_proj [E, D, I]``."""

    def __init__(self, config: MLAConfig):
        super().__init__()
        e, i, d = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Each token through its routed experts only (:func:`moe_experts`), combined with the routing weights.

        Args: x ``[T, D]``; weights ``[T, k]`` float32; idx ``[T, k]`` int64. Returns: ``[T, D]`` in x's dtype.
        """
        return moe_experts(x, weights, idx, self.gate_up_proj, self.down_proj)


def routed_expert_parameters(module: nn.Module) -> set[str]:
    """The names (as ``module.named_parameters()`` gives them) of the routed experts' weights anywhere in
    ``module``: the parameters of its :class:`Experts`. What the export's dense-MoE check follows."""
    return {f"{path}.{name}" if path else name for path, sub in module.named_modules() if isinstance(sub, Experts)
            for name, _ in sub.named_parameters(recurse=False)}


class MoE(nn.Module):
    """Routed experts plus shared experts (``moe_intermediate_size * n_shared_experts`` wide), their sum
    RMS-normed when ``config.post_mlp_layernorm`` (A.X-K1)."""

    def __init__(self, config: MLAConfig):
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config)
        self.shared_experts = (MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
                               if config.n_shared_experts else None)
        self.post_mlp_layernorm = (RMSNorm(config.hidden_size, config.rms_norm_eps)
                                   if config.post_mlp_layernorm else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x ``[B, S, D]``. Returns: ``[B, S, D]``."""
        flat = x.flatten(0, -2)  # [T, D]
        weights, idx = self.gate(flat)
        out = self.experts(flat, weights, idx).view_as(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out if self.post_mlp_layernorm is None else self.post_mlp_layernorm(out)
