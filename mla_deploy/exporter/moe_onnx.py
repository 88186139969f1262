"""The routed experts in ONNX, in either graph form of :mod:`mla_deploy.expert_forms`, and a graph scan for dense MoE.

**fused** (:func:`moe_experts_fused_onnx`): one ONNX Runtime ``com.microsoft`` ``MoE`` node per layer (float
weights; the weight quantization turns it into ``QMoE``, :mod:`mla_deploy.quant.formats`). The routing stays ours
(greedy, group-limited, ``noaux_tc``: the op receives ``weights [T, k]`` and ``idx [T, k]``). ONNX Runtime's CPU
``MoE`` has no separate routing-weights input: it takes the top ``k`` of ``softmax(router_probs)`` and, with
``normalize_routing_weights=1``, weighs expert ``j`` by its softmax value over those ``k``. So the node is given
``router_probs [T, E] = ScatterElements(-1e30, idx, log(weights))`` (the chosen experts are exactly ``idx``; their
normalized softmax is ``weights / sum(weights)``) and its output is multiplied by ``sum(weights)`` per token: exact
to float32 rounding for any positive weights (a weight is floored at 1e-30 before the log; a zero weight adds
nothing either way). The expert weights: ``down_proj [E, D, I]`` as stored, ``gate_up_proj [E, 2I, D]`` with its
gate and up rows interleaved (the only SwiGLU layout of the CPU kernels, ``swiglu_fusion=1``), written as
``Reshape -> Transpose -> Reshape`` of the stacked weight that the export folds into one stored tensor
(:func:`~.onnx_export.fold_weight_views`).

The fused form has two layouts (:data:`~mla_deploy.expert_forms.FUSED_LAYOUTS`), the same node and weights, their
routing hand-off apart. ``cpu`` (fp32) is the one above, which the CPU engine's operators recognise
(:mod:`mla_deploy.ort.swaps`). ``cuda`` (fp16/bf16: ONNX Runtime's CUDA ``QMoE`` has no fp32 kernel) computes the
hand-off in float32 before any cast: the weights divided by their row's largest (softmax does not change under a
shift, and the logs then lie near 0, where float16/bfloat16 are finest), floored at ``e^-60`` so that the log is
finite and >= -60 (a 1e-30 floor is 0 in float16, its log -inf, and a chosen expert would tie with the others), the
experts not chosen given -1e4 (finite in float16, ``exp`` of it 0), the whole cast to the activations' type; the sum
of the weights is cast likewise before the product. ONNX Runtime's CUDA kernel ignores ``QMoE``'s ``router_weights``
input (onnxruntime-cuda-facts.md), so this encoding is the hand-off there too.

**branches** (:func:`moe_experts_onnx`): one static branch of standard ONNX ops per expert. For ``E`` experts,
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

from typing import TYPE_CHECKING, Collection

from ..expert_forms import BRANCHES, CPU_LAYOUT, CUDA_LAYOUT, FORMS, FUSED, FUSED_LAYOUTS

if TYPE_CHECKING:
    import onnx


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


MS_DOMAIN = "com.microsoft"
#: a routing weight's floor before its log (a zero weight adds nothing whichever expert it picks)
_WEIGHT_FLOOR = 1e-30
#: router_probs of the experts not chosen: exp(-1e30 - max) is 0 in float32
_NOT_CHOSEN = -1e30
#: the ``cuda`` layout's floor of a weight over its row's largest: its log is >= -60, finite in float16/bfloat16
_CUDA_LOG_FLOOR = -60.0
#: the ``cuda`` layout's router_probs of the experts not chosen: finite in float16 (-1e30 is -inf there), far below
#: the chosen ones' >= -60, and exp(-1e4 - max) is 0 in float32
_CUDA_NOT_CHOSEN = -1e4


def moe_experts_fused_onnx(x, weights, idx, gate_up_proj, down_proj):
    """onnxscript translation of :func:`~mla_deploy.model.layers.moe_experts` into one ONNX Runtime
    ``com.microsoft`` ``MoE`` node in the ``cpu`` layout (see the module docstring); float32 only.

    Args: x ``[T, D]``; weights ``[T, k]`` float; idx ``[T, k]`` int64; gate_up_proj ``[E, 2I, D]``;
    down_proj ``[E, D, I]``. Returns: ``[T, D]`` in x's dtype.
    """
    from onnxscript import opset18 as op

    floor = _filled(op, x, gate_up_proj, _NOT_CHOSEN)  # [T, E]
    log_weights = op.Log(op.Max(weights, op.Constant(value_float=_WEIGHT_FLOOR)))  # [T, k]
    router = op.ScatterElements(floor, idx, log_weights, axis=1)  # [T, E]
    return op.Mul(_moe_node(op, x, router, idx, gate_up_proj, down_proj),
                  op.ReduceSum(weights, op.Constant(value_ints=[1]), keepdims=1))


def moe_experts_fused_cuda_onnx(x, weights, idx, gate_up_proj, down_proj):
    """onnxscript translation of :func:`~mla_deploy.model.layers.moe_experts` into one ONNX Runtime
    ``com.microsoft`` ``MoE`` node in the ``cuda`` layout (see the module docstring): the routing hand-off computed
    in float32, then cast to x's dtype (float16, bfloat16; float32 in the layout's CPU twin).

    Args and returns as :func:`moe_experts_fused_onnx`.
    """
    from onnxscript import opset18 as op

    # [T, 1], float32; a row of zero weights (it adds nothing) divides by the floor, not by 0
    largest = op.Max(op.ReduceMax(weights, op.Constant(value_ints=[1]), keepdims=1), op.Constant(value_float=1e-30))
    ratio = op.Div(weights, largest)  # softmax is shift-invariant: log(w / max w) differs from log w by a constant
    log_weights = op.Max(op.Log(ratio), op.Constant(value_float=_CUDA_LOG_FLOOR))  # [T, k]: finite, >= -60
    router = op.ScatterElements(_filled(op, x, gate_up_proj, _CUDA_NOT_CHOSEN), idx, log_weights, axis=1)  # [T, E]
    total = op.ReduceSum(weights, op.Constant(value_ints=[1]), keepdims=1)  # [T, 1], float32
    router, total = op.CastLike(router, x), op.CastLike(total, x)  # to x's type, after the float32 arithmetic
    return op.Mul(_moe_node(op, x, router, idx, gate_up_proj, down_proj), total)


def _filled(op, x, gate_up_proj, value: float):
    """``[T, E]`` float32 of ``value``: router_probs before the chosen experts' are scattered in."""
    from onnxscript import ir

    experts = int(gate_up_proj.shape[0])
    return op.ConstantOfShape(op.Concat(op.Shape(x, start=0, end=1), op.Constant(value_ints=[experts]), axis=0),
                              value=ir.tensor([value], dtype=ir.DataType.FLOAT))


def _moe_node(op, x, router, idx, gate_up_proj, down_proj):
    """The ``MoE`` node over ``router`` (``[T, E]`` in x's dtype): each token's top ``k`` of it, weighted by their
    softmax normalised over the ``k``, gate and up rows interleaved (``swiglu_fusion=1``)."""
    import onnxscript

    experts, rows, hidden = (int(d) for d in gate_up_proj.shape)
    inter, k = rows // 2, int(idx.shape[1])
    interleaved = op.Reshape(op.Transpose(op.Reshape(gate_up_proj, op.Constant(value_ints=[experts, 2, inter, hidden])),
                                          perm=[0, 2, 1, 3]), op.Constant(value_ints=[experts, rows, hidden]))
    moe = onnxscript.values.Op(onnxscript.values.Opset(MS_DOMAIN, 1), "MoE", _moe_schema())
    out = moe(x, router, interleaved, None, down_proj, k=k, activation_type="swiglu", swiglu_fusion=1,
              normalize_routing_weights=1, activation_alpha=1.0, activation_beta=0.0)  # [T, D]
    out.shape, out.type = x.shape, x.type
    return out


def _moe_schema():
    """The ``onnx.defs.OpSchema`` of ONNX Runtime's ``com.microsoft`` ``MoE`` (version 1), the inputs and attributes
    used here; for onnxscript's tracing, not registered with onnx globally."""
    from onnx.defs import OpSchema

    param, optional = OpSchema.FormalParameter, OpSchema.FormalParameterOption.Optional
    attrs = {"k": OpSchema.AttrType.INT, "activation_type": OpSchema.AttrType.STRING,
             "swiglu_fusion": OpSchema.AttrType.INT, "normalize_routing_weights": OpSchema.AttrType.INT,
             "activation_alpha": OpSchema.AttrType.FLOAT, "activation_beta": OpSchema.AttrType.FLOAT}
    return OpSchema(
        "MoE", MS_DOMAIN, 1, "ONNX Runtime's mixture of experts (contrib op).",
        inputs=[param("input", "T", "[T, D]"), param("router_probs", "T", "[T, E]"),
                param("fc1_experts_weights", "T", "[E, 2I, D]"),
                param("fc1_experts_bias", "T", "", param_option=optional),
                param("fc2_experts_weights", "T", "[E, D, I]")],
        outputs=[param("output", "T", "[T, D]")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "one float type")],
        attributes=[OpSchema.Attribute(name, kind, name) for name, kind in attrs.items()])


#: the fused form's translation in each layout
_FUSED = {CPU_LAYOUT: moe_experts_fused_onnx, CUDA_LAYOUT: moe_experts_fused_cuda_onnx}
assert set(_FUSED) == set(FUSED_LAYOUTS.values())


def translation_table(form: str = BRANCHES, layout: str = CPU_LAYOUT) -> dict:
    """``custom_translation_table`` entries of this module for ``torch.onnx.export``: the routed experts in
    ``form`` (:data:`~mla_deploy.expert_forms.FUSED` or :data:`~mla_deploy.expert_forms.BRANCHES`), the fused form
    in ``layout`` (:data:`~mla_deploy.expert_forms.CPU_LAYOUT` or :data:`~mla_deploy.expert_forms.CUDA_LAYOUT`)."""
    import torch

    from ..model import layers  # noqa: F401  (registers mla_deploy::moe_experts)

    assert form in FORMS and layout in _FUSED, (form, layout)
    return {torch.ops.mla_deploy.moe_experts.default: _FUSED[layout] if form == FUSED else moe_experts_onnx}


#: ops that pass a weight on as a weight (a layout, a dtype, a part, one expert of a stacked tensor, its dequantized
#: value, a broadcast): the walk from an expert weight goes through them to the node that computes with it
_WEIGHT_VIEWS = frozenset({"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Cast", "CastLike", "Identity",
                           "DequantizeLinear", "Slice", "Split", "Concat", "Expand", "Tile"})
#: ops that select rows of a tensor by indices (or a condition) computed in the graph
_SELECTIONS = frozenset({"Gather", "GatherND", "Compress"})
#: ONNX Runtime's operators that route each token to its top-k experts inside (the fused form)
_ROUTING_OPS = frozenset({"MoE", "QMoE"})
#: ops whose output holds no token's values, only sizes or constants
_NO_TOKENS = frozenset({"Constant", "ConstantOfShape", "Shape", "Size", "Range", "EyeLike"})
_ALL, _SOME = "all", "some"  # a value holds every token's data / only the tokens a selection chose


def dense_expert_products(model: onnx.ModelProto, expert_weights: Collection[str]) -> list[str]:
    """The nodes that compute a routed expert's weight with every token: the mark of a dense MoE.

    The walk follows what the expert weights feed, not the shapes of the tensors. Each value of the graph is
    classed by the tokens it holds (in graph order): a graph input holds every token; a ``Gather``/``GatherND``/
    ``Compress`` of token data at indices computed from the tokens holds a chosen subset (an expert's routed
    tokens: ``Gather(x, NonZero(mask[:, e]))``); constants, sizes and weights hold none; any other node holds
    every token if one of its inputs does. From each expert weight the walk goes through weight views
    (transposes, reshapes, one expert of a stacked tensor, dequantization, broadcasts: any of their other inputs
    holding no token) to the nodes that compute with it; one whose other operand holds every token is dense, unless
    the weight was gathered per token on the way (``W[idx]``, a selection at token-computed indices: each token's
    own experts). ONNX Runtime's ``MoE``/``QMoE`` (the fused form) routes each token inside: it is dense only when
    its ``k`` is as many as its experts. Only the expert weights are followed, so an attention product whose shape
    happens to match an expert's (as many heads as experts, ``kv_lora_rank == moe_intermediate_size``) is not
    mistaken for one.

    Args:
        model: the graph (nodes in graph order, as ``onnx.checker`` requires; nested graphs are read for the names
            they use).
        expert_weights: the initializers holding routed-expert weights (per expert or stacked; quantized parts
            included).
    Returns:
        ``["MatMul node (model.layers.1.mlp.experts.gate_up_proj.0.T with every token of x)", ...]``; empty when
        every expert product is computed on its routed tokens only (or there is none).
    """
    if not expert_weights:
        return []
    graph = model.graph
    tokens = _token_states(graph)
    experts = {init.name: (init.dims[0] if init.dims else 0) for init in graph.initializer}
    # expert-derived value -> (whole | routed: gathered per token, the expert weight it comes from)
    weight = {name: ("whole", name) for name in expert_weights}
    found = []
    for node in graph.node:
        used = [name for name in _names_used(node) if name in weight]
        if not used:
            continue
        others = [name for name in node.input if name and name not in weight]
        derived = bool(node.input) and node.input[0] in weight
        by_tokens = any(tokens.get(name) for name in others)
        if derived and node.op_type in _SELECTIONS and by_tokens:  # each token's own experts: W[idx]
            weight.update({out: ("routed", weight[node.input[0]][1]) for out in node.output if out})
        elif derived and node.op_type in _WEIGHT_VIEWS | _SELECTIONS and not by_tokens:
            weight.update({out: weight[node.input[0]] for out in node.output if out})
        elif not _routes_inside(node, experts):
            whole = [weight[name][1] for name in used if weight[name][0] == "whole"]
            every = [name for name in others if tokens.get(name) == _ALL]
            if whole and every:
                found.append(f"{node.op_type} {node.name or node.output[0]} ({whole[0]} with every token of {every[0]})")
    return found


def _routes_inside(node, experts: dict[str, int]) -> bool:
    """``node`` is ONNX Runtime's ``MoE``/``QMoE``, which runs each token through its top ``k`` experts only, and
    ``k`` is fewer than its experts (``experts``: an initializer's leading size, the expert count of a stacked
    weight); ``k`` as many as the experts is every expert for every token."""
    if node.domain != MS_DOMAIN or node.op_type not in _ROUTING_OPS:
        return False
    k = next((a.i for a in node.attribute if a.name == "k"), 1)
    return k < experts.get(node.input[2], 0)


def _token_states(graph) -> dict[str, str]:
    """``{value: "all" | "some"}`` for the values that hold token data (absent: none)."""
    states = {value.name: _ALL for value in graph.input}
    for init in graph.initializer:
        states.pop(init.name, None)  # an initializer listed as an input too (IR < 4) is a constant
    for node in graph.node:
        ins = [states.get(name) for name in node.input if name]
        if node.op_type in _NO_TOKENS:
            state = None
        elif node.op_type in _SELECTIONS and len(ins) > 1 and ins[0] and ins[1]:
            state = _SOME  # rows chosen by indices computed from the tokens
        else:
            state = _ALL if _ALL in ins else _SOME if _SOME in ins else None
        for out in node.output:
            if out and state:
                states[out] = state
    return states


def _names_used(node) -> list[str]:
    """The node's inputs and the outer names its nested graphs (``If``/``Loop``/``Scan``) read."""
    names = [name for name in node.input if name]
    for attr in node.attribute:
        for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
            for inner in sub.node:
                names += _names_used(inner)
    return names
