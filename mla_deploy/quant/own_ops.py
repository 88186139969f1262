"""Which quantized nodes mla-deploy's own CPU operators (:mod:`mla_deploy.engines.cpu_ops`,
``plugins/ort_cpu/cpu_ops.c``) compute exactly, and the swaps that put them in place of ONNX Runtime's ``QMoE``
(:data:`~.formats.QMOE`'s layout) and ``MatMulNBits`` (:data:`~.formats.MATMULNBITS`'s) in a CPU engine's graph, and
in place of the per-head weights' ``DequantizeLinear -> Transpose -> MatMul`` (:data:`~.formats.HEADWISE`'s). The
operators read these layouts as they are: nothing is re-laid out (a per-head weight's signed integers are handed to
``HeadwiseMatMul`` as the same bytes, typed ``uint8``)."""

from __future__ import annotations

DOMAIN = "mla_deploy"
OP_TYPE = "RoutedExperts"
LINEAR_OP_TYPE = "BlockwiseMatMul"
HEADWISE_OP_TYPE = "HeadwiseMatMul"


def _eligible(node) -> dict | None:
    """The RoutedExperts attributes of the ``QMoE`` NodeProto ``node`` when the operator computes exactly what it
    does, else None: int4/int8 blocks of 32, SwiGLU with gate and up interleaved (``swiglu_fusion`` 1, alpha 1,
    beta 0, no limit), no biases, zero points or separate routing weights, ``accuracy_level`` 4, the weights
    normalised over the chosen experts (``normalize_routing_weights`` 1: the only setting the export writes; with 0,
    ONNX Runtime 1.31's CPU ``QMoE`` was measured to normalise all the same, so the operator does not take it)."""
    from onnx import helper

    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    activation = attrs.get("activation_type", b"relu")
    wanted = {"expert_weight_bits": attrs.get("expert_weight_bits", 4) in (4, 8),
              "block_size": attrs.get("block_size") == 32,
              "activation": (activation.decode() if isinstance(activation, bytes) else activation) == "swiglu",
              "fusion": attrs.get("swiglu_fusion", 0) == 1, "alpha": attrs.get("activation_alpha", 1.0) == 1.0,
              "beta": attrs.get("activation_beta", 0.0) == 0.0, "limit": "swiglu_limit" not in attrs,
              "level": attrs.get("accuracy_level", 0) == 4, "k": attrs.get("k", 1) >= 1,
              "normalize": attrs.get("normalize_routing_weights", 0) == 1}
    inputs = list(node.input) + [""] * (7 - len(node.input))
    used = [i for i, name in enumerate(inputs) if name]
    if not all(wanted.values()) or used != [0, 1, 2, 3, 5, 6]:
        return None
    return {"k": attrs.get("k", 1), "expert_weight_bits": attrs.get("expert_weight_bits", 4), "block_size": 32,
            "normalize_routing_weights": 1}


def _linear_eligible(node, dims: dict) -> dict | None:
    """The BlockwiseMatMul attributes of the ``MatMulNBits`` NodeProto ``node`` when it computes exactly what that
    node does at ``accuracy_level`` 4: int4/int8 blocks of 32, no zero points, group indices or bias, its weight and
    scales initializers (``dims``: initializer name -> shape) of the layout ``[N, K/32, 32*bits/8]`` and ``N*K/32``
    values. Every size: the lm_head too, whose weights the operator reads from the engine's file on 2 MiB pages
    (``advise_huge`` in ``cpu_ops.c``) faster than ``MatMulNBits`` reads its packed copy (README)."""
    from onnx import helper

    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    k, n, bits, block = attrs.get("K"), attrs.get("N"), attrs.get("bits", 4), attrs.get("block_size")
    used = [i for i, name in enumerate(node.input) if name]
    if (used != [0, 1, 2] or bits not in (4, 8) or block != 32 or attrs.get("accuracy_level", 0) != 4 or not k
            or k % 32 or not n):
        return None
    weight, scales = dims.get(node.input[1]), dims.get(node.input[2])
    if weight != [n, k // 32, 32 * bits // 8] or scales is None or _count(scales) != n * k // 32:
        return None
    return {"K": k, "N": n, "bits": bits, "block_size": 32}


def _count(shape: list[int]) -> int:
    total = 1
    for d in shape:
        total *= d
    return total


def swap_linear(model) -> int:
    """Replace, in the ``onnx.ModelProto`` ``model`` (in place), every eligible ``com.microsoft`` ``MatMulNBits``
    node (:func:`_linear_eligible`) by ``mla_deploy.BlockwiseMatMul`` over the same inputs; returns how many."""
    dims = {t.name: list(t.dims) for t in model.graph.initializer}
    return _swap(model, "MatMulNBits", LINEAR_OP_TYPE, lambda node: _linear_eligible(node, dims), (0, 1, 2))


def swap_experts(model) -> int:
    """Replace, in the ``onnx.ModelProto`` ``model`` (in place), every eligible ``com.microsoft`` ``QMoE`` node by
    ``mla_deploy.RoutedExperts`` over the same inputs (its bias slot dropped) and output; returns how many.

    Where the node's routing is the export's (:func:`~mla_deploy.exporter.moe_onnx.moe_experts_fused_onnx`:
    ``router_probs = ScatterElements(ConstantOfShape(-1e30), idx, Log(Max(weights, 1e-30)))``, the output multiplied
    by ``ReduceSum(weights, axis 1, keepdims)``), the operator is given ``weights`` and ``idx`` themselves
    (``normalize_routing_weights`` 0, :func:`_give_routing`): the same sum of experts without the round trip, and
    about 8 nodes fewer per layer."""
    swapped = _swap(model, "QMoE", OP_TYPE, _eligible, (0, 1, 2, 3, 5, 6))
    if swapped:
        _give_routing(model)
    return swapped


def _give_routing(model) -> int:
    """Rewrite each ``mla_deploy.RoutedExperts`` node of ``model`` (``normalize_routing_weights`` 1) whose router
    input and output follow the export's pattern (:func:`swap_experts`) to take the routing as given; the nodes left
    without a use are removed. Returns how many were rewritten."""
    from onnx import helper

    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    constant = _constants(model)
    rewritten, freed = 0, []
    for node in [n for n in graph.node if (n.domain, n.op_type) == (DOMAIN, OP_TYPE)]:
        found = _routing_pattern(node, producer, consumers, outputs, constant)
        if found is None:
            continue
        weights, idx, mul = found
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        attrs["normalize_routing_weights"] = 0
        given = helper.make_node(OP_TYPE, [node.input[0], weights, *node.input[2:6], idx], list(mul.output),
                                 name=node.name, domain=DOMAIN, **attrs)
        given.metadata_props.extend(node.metadata_props)
        at = list(graph.node).index(node)
        for old in (node, mul):
            graph.node.remove(old)
            freed.extend(old.input)
        graph.node.insert(at, given)
        rewritten += 1
    if rewritten:
        _drop_unused(graph, freed)
    return rewritten


def _routing_pattern(node, producer, consumers, outputs, constant) -> tuple[str, str, object] | None:
    """``(weights, idx, the Mul node)`` when the RoutedExperts ``node`` reads the export's routing round trip
    (:func:`swap_experts`), else None. ``constant``: tensor name -> numpy value of the graph's constants."""
    from onnx import helper, numpy_helper

    def made_by(name, op_type):
        found = producer.get(name)
        return found if found is not None and found.op_type == op_type and found.domain in ("", "ai.onnx") else None

    def attr(n, name, default=None):
        return next((helper.get_attribute_value(a) for a in n.attribute if a.name == name), default)

    def small(name, below):  # a constant whose every value is < below
        value = constant.get(name)
        return value is not None and value.size >= 1 and bool((value < below).all())

    def single_use(name):
        return len(consumers.get(name, [])) == 1 and name not in outputs

    if attr(node, "normalize_routing_weights") != 1 or not single_use(node.input[1]):
        return None
    scatter = made_by(node.input[1], "ScatterElements")
    if scatter is None or attr(scatter, "axis", 0) not in (1, -1) or attr(scatter, "reduction", b"none") not in (
            b"none", "none") or len(scatter.input) != 3:
        return None
    floor, idx, log_weights = scatter.input
    fill = made_by(floor, "ConstantOfShape")
    log = made_by(log_weights, "Log")
    if fill is None or attr(fill, "value") is None or not (numpy_helper.to_array(attr(fill, "value")) < -1e20).all():
        return None
    floored = made_by(log.input[0], "Max") if log is not None else None
    if floored is None or len(floored.input) != 2:
        return None
    weights = next((name for name in floored.input if name not in constant), None)
    if weights is None or not any(small(name, 1e-20) for name in floored.input if name != weights):
        return None
    if not single_use(node.output[0]):
        return None
    mul = consumers[node.output[0]][0]
    if mul.op_type != "Mul" or mul.domain not in ("", "ai.onnx") or len(mul.input) != 2:
        return None
    total = made_by(next(n for n in mul.input if n != node.output[0]), "ReduceSum") if mul.input[0] != mul.input[
        1] else None
    if total is None or total.input[0] != weights or attr(total, "keepdims", 1) != 1:
        return None
    axes = constant.get(total.input[1]) if len(total.input) > 1 and total.input[1] else None
    if axes is None or [int(a) for a in axes.reshape(-1)] not in ([1], [-1]):
        return None
    return weights, idx, mul


def _constants(model) -> dict:
    """Name -> numpy value of ``model``'s small initializers held in the graph and of its ``Constant`` nodes' outputs
    (what the routing pattern reads)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    found = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer
             if t.data_location != TensorProto.EXTERNAL and _count(list(t.dims)) <= 64}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.attribute) == 1:
            value = helper.get_attribute_value(node.attribute[0])
            found[node.output[0]] = numpy_helper.to_array(value) if hasattr(value, "dims") else np.asarray(value)
    return found


def _drop_unused(graph, names: list[str]) -> None:
    """Remove the nodes producing ``names`` (and, in turn, their producers) whose outputs nothing reads any more;
    initializers left without a reader are removed too."""
    outputs = {o.name for o in graph.output}
    pending = list(names)
    while pending:
        used = {name for node in graph.node for name in node.input} | outputs
        name = pending.pop()
        node = next((n for n in graph.node if name in n.output), None)
        if node is not None and not any(out in used for out in node.output):
            graph.node.remove(node)
            pending.extend(node.input)
        elif node is None and name not in used:
            for tensor in [t for t in graph.initializer if t.name == name]:
                graph.initializer.remove(tensor)


def _swap(model, old: str, new: str, eligible, inputs: tuple[int, ...]) -> int:
    """Replace each ``com.microsoft`` ``old`` node of ``model`` for which ``eligible(node)`` gives attributes by an
    ``mla_deploy`` ``new`` node with those attributes, the old node's ``inputs`` (by position) and its outputs, at the
    same place in the graph; returns how many."""
    from onnx import helper

    swapped = 0
    for at, node in enumerate(list(model.graph.node)):
        attrs = eligible(node) if (node.domain, node.op_type) == ("com.microsoft", old) else None
        if attrs is None:
            continue
        replacement = helper.make_node(new, [node.input[i] for i in inputs], list(node.output), name=node.name,
                                       domain=DOMAIN, **attrs)
        replacement.metadata_props.extend(node.metadata_props)  # where it comes from (the module scope)
        model.graph.node.remove(node)
        model.graph.node.insert(at, replacement)
        swapped += 1
    if swapped and not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return swapped


def swap_headwise(model) -> int:
    """Replace, in the ``onnx.ModelProto`` ``model`` (in place), every per-head product ``MatMul(A,
    Transpose(DequantizeLinear(W.q, W.scale, axis=2, block_size=32), perm=[0, 2, 1]))`` whose weight the operator
    reads (``W.q`` an ``INT4``/``INT8`` initializer ``[H, N, K]``, ``K`` a multiple of 32, ``W.scale`` float
    ``[H, N, K/32]``, no zero point) by ``mla_deploy.HeadwiseMatMul(A, W.q as uint8 [H, N, K*bits/8], W.scale)``;
    returns how many products. The dequantization and transpose go where every use of them was swapped."""
    from onnx import TensorProto, helper

    inits = {t.name: t for t in model.graph.initializer}
    consumers: dict[str, list] = {}
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node, i))
    outputs = {o.name for o in model.graph.output}
    bits_of = {TensorProto.INT4: 4, TensorProto.INT8: 8}
    swapped = 0
    for dq in [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.domain in ("", "ai.onnx")]:
        attrs = {a.name: helper.get_attribute_value(a) for a in dq.attribute}
        q, scale = (inits.get(name) for name in (list(dq.input) + ["", ""])[:2])
        if (attrs.get("axis", 1) != 2 or attrs.get("block_size") != 32 or len([i for i in dq.input if i]) != 2
                or q is None or scale is None or q.data_type not in bits_of or len(q.dims) != 3 or q.dims[2] % 32
                or scale.data_type != TensorProto.FLOAT or list(scale.dims) != [*q.dims[:2], q.dims[2] // 32]):
            continue
        uses = consumers.get(dq.output[0], [])
        transpose = uses[0][0] if len(uses) == 1 and dq.output[0] not in outputs else None
        if transpose is None or transpose.op_type != "Transpose" or transpose.output[0] in outputs or [
                list(a.ints) for a in transpose.attribute if a.name == "perm"] != [[0, 2, 1]]:
            continue
        matmuls = consumers.get(transpose.output[0], [])
        if not matmuls or any(n.op_type != "MatMul" or n.domain not in ("", "ai.onnx") or i != 1 for n, i in matmuls):
            continue
        bits, (heads, n, k) = bits_of[q.data_type], q.dims
        packed = _as_bytes(q, bits)
        model.graph.initializer.append(packed)
        for matmul, _ in matmuls:
            node = helper.make_node(HEADWISE_OP_TYPE, [matmul.input[0], packed.name, scale.name], list(matmul.output),
                                    name=matmul.name, domain=DOMAIN, K=k, N=n, bits=bits, block_size=32)
            node.metadata_props.extend(matmul.metadata_props)
            at = list(model.graph.node).index(matmul)
            model.graph.node.remove(matmul)
            model.graph.node.insert(at, node)
            swapped += 1
        model.graph.node.remove(transpose)
        model.graph.node.remove(dq)
        if len(consumers.get(q.name, [])) == 1:
            model.graph.initializer.remove(q)
    if swapped and not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return swapped


def _as_bytes(tensor, bits: int):
    """The ``INT4``/``INT8`` TensorProto ``tensor`` ``[H, N, K]`` as ``uint8 [H, N, K*bits/8]`` over the same bytes:
    the same external data (file, offset, length) where it has them, else its raw bytes (packed here when the
    tensor holds its values one per field)."""
    import numpy as np
    from onnx import TensorProto, numpy_helper

    heads, n, k = tensor.dims
    out = TensorProto(name=f"{tensor.name}.bytes", data_type=TensorProto.UINT8, dims=[heads, n, k * bits // 8])
    if tensor.data_location == TensorProto.EXTERNAL:
        out.data_location = TensorProto.EXTERNAL
        out.external_data.extend(tensor.external_data)
    elif tensor.raw_data:
        out.raw_data = tensor.raw_data
    else:
        values = numpy_helper.to_array(tensor).astype(np.int8).reshape(-1).view(np.uint8)
        out.raw_data = (values if bits == 8 else (values[0::2] & 0x0F) | ((values[1::2] & 0x0F) << 4)).tobytes()
    return out


def swappable(model) -> bool:
    """Whether the ``onnx.ModelProto`` ``model`` holds a node these operators could replace (``QMoE``,
    ``MatMulNBits``, a ``DequantizeLinear`` along axis 2; eligible or not)."""
    return any((n.domain, n.op_type) in (("com.microsoft", "QMoE"), ("com.microsoft", "MatMulNBits"))
               or (n.op_type == "DequantizeLinear" and any(a.name == "axis" and a.i == 2 for a in n.attribute))
               for n in model.graph.node)
