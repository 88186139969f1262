"""The routed experts in ONNX: one static branch per expert, standard ops only, and a graph scan for dense MoE.

:func:`~mla_deploy.model.layers.moe_experts` (``mla_deploy::moe_experts``) becomes, for ``E`` experts,
``T`` tokens and ``k`` choices per token (``idx [T, k]`` distinct within a row):

* ``mask [T, E] = ScatterElements(zeros, idx, ones, axis=1)`` (float32 0/1, no reduction);
* for each expert ``e``: ``tok_e = NonZero(mask[:, e])`` (ascending), ``x_e = Gather(x, tok_e)``,
  ``h = MatMul(x_e, W1_e^T [D, 2I])`` split into gate and up, ``MatMul(silu(gate) * up, W2_e^T [I, D])``;
  ``W1_e^T = Transpose(Gather(gate_up_proj, e, axis=0))`` and likewise for ``down_proj``, a pattern that the
  export folds into one per-expert initializer stored transposed (``fold_weight_views``), or that constant
  folding evaluates when the weights are in the graph: MatMul's second input, which ONNX Runtime pre-packs;
* ``O = Concat(branch outputs)`` expert-major (``[T*k, D]``, tokens ascending within an expert);
* ``row[t, j] = offset[idx[t, j]] + CumSum(mask, axis=0)[t, idx[t, j]] - 1``, ``offset`` the exclusive CumSum
  of the per-expert token counts, and ``y[t] = sum_j weights[t, j] * O[row[t, j]]`` (in ``weights``' dtype).

Decode reads only the routed experts' weights, prefill computes each expert on its own tokens only, and
nothing scatters with a reduction (ScatterND ``add`` races in ONNX Runtime CPU with repeated indices, and
ScatterElements ``add`` is slow). An empty expert (or ``T = 0``) is a branch of 0 rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx

    from ..config import MLAConfig


def moe_experts_onnx(x, weights, idx, gate_up_proj, down_proj):
    """onnxscript translation of :func:`~mla_deploy.model.layers.moe_experts` (standard opset-18 ops).

    Args: x ``[T, D]``; weights ``[T, k]`` float; idx ``[T, k]`` int64; gate_up_proj ``[E, 2I, D]``;
    down_proj ``[E, D, I]``. Returns: ``[T, D]`` in x's dtype.
    """
    from onnxscript import ir
    from onnxscript import opset18 as op

    experts = int(gate_up_proj.shape[0])
    one_row = op.Constant(value_ints=[-1])
    zeros = op.ConstantOfShape(op.Concat(op.Shape(x, start=0, end=1), op.Constant(value_ints=[experts]), axis=0),
                               value=ir.tensor([0.0], dtype=ir.DataType.FLOAT))  # [T, E]
    ones = op.Expand(op.Constant(value_float=1.0), op.Shape(idx))  # [T, k]
    mask = op.ScatterElements(zeros, idx, ones, axis=1)  # [T, E]: 1 where the token is routed to the expert
    columns = op.Split(mask, axis=1, num_outputs=experts) if experts > 1 else [mask]
    branches = []
    for e, column in enumerate(columns):
        tokens = op.Reshape(op.NonZero(op.Reshape(column, one_row)), one_row)  # [n_e] ascending
        branches.append(_expert(op, op.Gather(x, tokens, axis=0), gate_up_proj, down_proj, e))
    out = op.Concat(*branches, axis=0) if experts > 1 else branches[0]  # [T*k, D], expert-major
    rank = op.Sub(op.CumSum(mask, op.Constant(value_int=0)), op.Constant(value_float=1.0))  # [T, E]
    counts = op.ReduceSum(mask, op.Constant(value_ints=[0]), keepdims=0)  # [E]
    offset = op.CumSum(counts, op.Constant(value_int=0), exclusive=1)  # [E]
    row = op.Cast(op.Add(op.GatherElements(rank, idx, axis=1), op.Gather(offset, idx, axis=0)),
                  to=ir.DataType.INT64)  # [T, k]: where choice (t, j) sits in out
    chosen = op.Gather(out, row, axis=0)  # [T, k, D]
    if x.dtype != weights.dtype:
        chosen = op.Cast(chosen, to=weights.dtype)
    y = op.ReduceSum(op.Mul(chosen, op.Unsqueeze(weights, op.Constant(value_ints=[2]))),
                     op.Constant(value_ints=[1]), keepdims=0)  # [T, D]
    return op.Cast(y, to=x.dtype) if x.dtype != weights.dtype else y


def _expert(op, tokens_x, gate_up_proj, down_proj, e: int):
    """One expert's SwiGLU on its tokens ``[n, D]`` -> ``[n, D]``, its weights taken as ``Transpose(Gather(W, e))``."""
    index = op.Constant(value_int=e)
    up_t = op.Transpose(op.Gather(gate_up_proj, index, axis=0), perm=[1, 0])  # [D, 2I]
    down_t = op.Transpose(op.Gather(down_proj, index, axis=0), perm=[1, 0])  # [I, D]
    gate, up = op.Split(op.MatMul(tokens_x, up_t), axis=1, num_outputs=2)  # [n, I] each
    return op.MatMul(op.Mul(op.Mul(gate, op.Sigmoid(gate)), up), down_t)


def translation_table() -> dict:
    """``custom_translation_table`` entries of this module, for ``torch.onnx.export``."""
    import torch

    from ..model import layers  # noqa: F401  (registers mla_deploy::moe_experts)

    return {torch.ops.mla_deploy.moe_experts.default: moe_experts_onnx}


def all_expert_tensors(model: onnx.ModelProto, config: MLAConfig) -> list[str]:
    """Tensors that span all routed experts for every token: the mark of a dense MoE.

    A tensor counts when its shape (after shape inference) has an axis of ``n_routed_experts``, another axis of a
    per-expert width (``moe_intermediate_size`` or twice it) and a dynamic axis (tokens, batch or sequence; named
    or unknown). The sparse graph has none: its branches are ``[n_e, width]`` and its routing mask ``[T, E]``.

    Returns: ``["name [dims]", ...]``; empty for a model without routed experts.
    """
    c = config
    if not c.n_routed_experts:
        return []
    widths = {c.moe_intermediate_size, 2 * c.moe_intermediate_size}
    found = []
    for value in list(model.graph.value_info) + list(model.graph.output):
        dims = [d.dim_param or d.dim_value or "?" for d in value.type.tensor_type.shape.dim]
        experts = [i for i, d in enumerate(dims) if d == c.n_routed_experts]
        wide = [i for i, d in enumerate(dims) if d in widths]
        dynamic = any(isinstance(d, str) for d in dims)
        if dynamic and any(a != b for a in experts for b in wide):
            found.append(f"{value.name} {dims}")
    return found
