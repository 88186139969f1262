"""Which quantized nodes mla-deploy's own CPU operators (:mod:`mla_deploy.ort.operators`,
``mla_deploy/ort/csrc/cpu_ops.c``) compute exactly, and the swaps that put them in place of ONNX Runtime's ``QMoE``
(:data:`~.formats.QMOE`'s layout) and ``MatMulNBits`` (:data:`~.formats.MATMULNBITS`'s) in a CPU engine's graph, and
in place of the per-head weights' ``DequantizeLinear -> Transpose -> MatMul`` (:data:`~.formats.HEADWISE`'s). The
operators read these layouts as they are (a per-head weight's signed integers are handed to ``HeadwiseMatMul`` as
the same bytes, typed ``uint8``); the one re-layout is :func:`interleave_weights`, which moves the bytes of each
``RoutedExperts`` weight and of long ``BlockwiseMatMul`` rows within groups of 16 blocks, and says so on the node."""

from __future__ import annotations

DOMAIN = "mla_deploy"
OP_TYPE = "RoutedExperts"
LINEAR_OP_TYPE = "BlockwiseMatMul"
HEADWISE_OP_TYPE = "HeadwiseMatMul"


def _attributes(node) -> dict:
    """Name -> Python value of each attribute of the NodeProto ``node``."""
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _made_by(producer: dict, name: str, op_type: str, domain: str = ""):
    """The node that makes ``name`` (``producer``: tensor name -> NodeProto) when it is a ``domain`` ``op_type`` (the
    default: ONNX's own domain, written "" or "ai.onnx"), else None."""
    found = producer.get(name)
    domains = ("", "ai.onnx") if domain == "" else (domain,)
    return found if found is not None and found.op_type == op_type and found.domain in domains else None


def _eligible(node) -> dict | None:
    """The RoutedExperts attributes of the ``QMoE`` NodeProto ``node`` when the operator computes exactly what it
    does, else None: int4/int8 blocks of 32, SwiGLU with gate and up interleaved (``swiglu_fusion`` 1, alpha 1,
    beta 0, no limit), no biases, zero points or separate routing weights, ``accuracy_level`` 4, the weights
    normalised over the chosen experts (``normalize_routing_weights`` 1: the only setting the export writes; with 0,
    ONNX Runtime 1.31's CPU ``QMoE`` was measured to normalise all the same, so the operator does not take it)."""
    attrs = _attributes(node)
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
    (``advise_huge`` in ``cpu_ops.c``) faster than ``MatMulNBits`` reads its packed copy (docs/cpu-engine.md)."""
    attrs = _attributes(node)
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
    producer, consumers = _links(list(graph.node))
    outputs = {o.name for o in graph.output}
    constant = _constants(model)
    rewritten, freed = 0, []
    for node in [n for n in graph.node if (n.domain, n.op_type) == (DOMAIN, OP_TYPE)]:
        found = _routing_pattern(node, producer, consumers, outputs, constant)
        if found is None:
            continue
        weights, idx, mul = found
        attrs = _attributes(node)
        attrs["normalize_routing_weights"] = 0
        given = helper.make_node(OP_TYPE, [node.input[0], weights, *node.input[2:6], idx], list(mul.output),
                                 name=node.name, domain=DOMAIN, **attrs)
        freed.extend(_replace(graph, node, mul, given))
        rewritten += 1
    if rewritten:
        _drop_unused(graph, freed)
    return rewritten


def _shared_branch(node, producer: dict, consumers: dict, outputs: set, product_of):
    """The shared experts the graph adds to the experts node ``node``'s output, as an export writes them:
    ``Add(Reshape(experts), down(silu(gate(h)) * up(h)))``, ``silu(g)`` as ``Mul(g, Sigmoid(g))``, ``h`` the node's
    own input or what it reshapes, every tensor between read by nothing else. ``product_of(name)`` is the product
    node (of the caller's kind) making ``name``, or None. Returns ``(the Reshape chain after node, add, gate,
    sigmoid, silu, up, product, down)`` or None."""
    def only_reader(name):
        found = consumers.get(name, [])
        return found[0] if len(found) == 1 and name not in outputs else None

    sources = {node.input[0]}
    reshaped = _made_by(producer, node.input[0], "Reshape")
    if reshaped is not None:
        sources.add(reshaped.input[0])
    tail, chain = node.output[0], []
    while (reader := only_reader(tail)) is not None and (reader.op_type, reader.domain or "") == ("Reshape", ""):
        chain.append(reader)
        tail = reader.output[0]
    add = only_reader(tail)
    if add is None or (add.op_type, add.domain or "") != ("Add", "") or len(add.input) != 2 or (
            add.input[0] == add.input[1]):
        return None
    shared = add.input[1] if add.input[0] == tail else add.input[0]
    down = product_of(shared) if only_reader(shared) is add else None
    product = _made_by(producer, down.input[0], "Mul") if down is not None and only_reader(
        down.input[0]) is down else None
    if product is None or len(product.input) != 2:
        return None
    for silu_name, up_name in (product.input, product.input[::-1]):
        silu, up = _made_by(producer, silu_name, "Mul"), product_of(up_name)
        if silu is None or up is None or only_reader(silu_name) is not product or only_reader(up_name) is not product:
            continue
        gate_name = next((n for n in silu.input if product_of(n) is not None), None)
        sigmoid = next((_made_by(producer, n, "Sigmoid") for n in silu.input if n != gate_name), None)
        if (gate_name is None or sigmoid is None or sigmoid.input[0] != gate_name or len(silu.input) != 2
                or only_reader(sigmoid.output[0]) is not silu
                or sorted(id(n) for n in consumers.get(gate_name, [])) != sorted((id(sigmoid), id(silu)))
                or gate_name in outputs):
            continue
        gate = producer[gate_name]
        if gate.input[0] in sources and up.input[0] == gate.input[0]:
            return chain, add, gate, sigmoid, silu, up, product, down
    return None


def fold_shared_experts(model) -> int:
    """Give each ``mla_deploy.RoutedExperts`` node of the ``onnx.ModelProto`` ``model`` (in place) its layer's shared
    experts where the graph adds them to its output as the export writes them: ``Add(Reshape(experts), down(silu(
    gate(h)) * up(h)))``, gate, up and down ``mla_deploy.BlockwiseMatMul`` products of the experts' bits over the
    experts' own input ``h`` (or what it reshapes), ``silu(g)`` as ``Mul(g, Sigmoid(g))``. The node then takes the
    three products' weights and scales as its inputs 7 to 12 and computes the sum itself
    (``mla_deploy/ort/csrc/cpu_ops.c``): the gate, sigmoid, silu, up, product, down and add nodes go (7 per MoE layer),
    and the shared experts' rows are streamed in the same pass as the routed ones'. Returns how many nodes were
    given their shared experts."""
    graph = model.graph
    producer, consumers = _links(list(graph.node))
    outputs = {o.name for o in graph.output}
    dims = {t.name: list(t.dims) for t in graph.initializer}
    folded, dropped = 0, []
    for node in [n for n in graph.node if (n.domain, n.op_type) == (DOMAIN, OP_TYPE)]:
        if any(node.input[7:]):
            continue
        bits = _attributes(node).get("expert_weight_bits")
        fc1 = dims.get(node.input[2])
        if bits not in (4, 8) or fc1 is None or len(fc1) != 3:
            continue
        hidden = fc1[2] * 8 // bits
        found = _shared_branch(node, producer, consumers, outputs,
                               lambda name: _made_by(producer, name, LINEAR_OP_TYPE, DOMAIN))
        if found is None:
            continue
        chain, add, gate, sigmoid, silu, up, product, down = found
        g, u, d = _attributes(gate), _attributes(up), _attributes(down)
        width = g.get("N")
        if ({g.get("bits"), u.get("bits"), d.get("bits")} != {bits}
                or g.get("K") != hidden or u.get("K") != hidden or u.get("N") != width or d.get("K") != width
                or d.get("N") != hidden or not width or width % 32):
            continue
        given = list(node.input) + [""] * (7 - len(node.input))
        del node.input[:]
        node.input.extend(given[:7] + [gate.input[1], gate.input[2], up.input[1], up.input[2], down.input[1],
                                       down.input[2]])
        (chain[-1] if chain else node).output[0] = add.output[0]
        dropped.extend([gate, sigmoid, silu, up, product, down, add])
        folded += 1
    for old in dropped:
        graph.node.remove(old)
    return folded


FLOAT_EXPERTS_OP_TYPE = "FloatExperts"
FLOAT_LINEAR_OP_TYPE = "FloatMatMul"


def _float_weights(model) -> set[str]:
    """The names of ``model``'s float32 initializers of two or three dimensions (a projection's weight ``[K, N]``,
    or the absorbed attention's per-head ``[H, K, N]``)."""
    from onnx import TensorProto

    return {t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT and len(t.dims) in (2, 3)}


def swap_float_linear(model, folder=None, side=None) -> int:
    """Replace, in the ``onnx.ModelProto`` ``model`` (in place), every ONNX ``MatMul`` whose second input is a
    float32 initializer ``[K, N]`` (a float artifact's projections, MLPs and ``lm_head``) or ``[H, K, N]`` (the
    absorbed attention's per-head ``W_UK`` and ``W_UV``) that only such ``MatMul`` nodes read by
    ``mla_deploy.FloatMatMul`` over the same input and that weight transposed, ``[N, K]`` or ``[H, N, K]``; returns how
    many nodes. The transposed copies of external weights (under ``folder``) go into the file ``side`` (a path
    under ``folder``, appended to, each at a 4 KiB-aligned offset), which the model then names; in-graph weights are transposed in
    place. The weight keeps its name; its ``[K, N]`` form is no longer in the model, so nothing holds both.

    The operator computes a decode step's few rows itself, each output a dot product over one row of the transposed
    weight, streaming it where ONNX Runtime maps it, and hands more rows (a prefill) to ONNX Runtime's own
    ``FusedMatMul`` with ``transB`` (``mla_deploy/ort/csrc/cpu_ops.c``)."""
    import os
    from pathlib import Path

    weights = _float_weights(model)
    consumers = _links(list(model.graph.node))[1]
    outputs = {o.name for o in model.graph.output}
    only_matmul = {w for w in weights if w not in outputs and consumers.get(w) and all(
        (n.domain, n.op_type, len(n.input)) == ("", "MatMul", 2) and list(n.input).index(w) == 1
        for n in consumers[w])}
    tensors = [t for t in model.graph.initializer if t.name in only_matmul]
    external = [t for t in tensors if _is_external(t)]
    if external and (folder is None or side is None):
        raise ValueError("swap_float_linear: external weights need the folder and a side file")
    swapped = _swap(model, "MatMul", FLOAT_LINEAR_OP_TYPE,
                    lambda node: {} if len(node.input) == 2 and node.input[1] in only_matmul else None, (0, 1),
                    domain="")
    for tensor in tensors:
        if not _is_external(tensor):
            _transpose_inside(tensor)
    if external:
        folder, side = Path(folder), Path(side)
        location = os.path.relpath(side, folder)
        with open(side, "ab") as out:  # after what fold_float_shared_experts wrote there, if anything
            for tensor in external:
                _append_transposed(tensor, folder, out, location)
    return swapped


#: the weight inputs of the operators that read the interleaved layout: RoutedExperts' fc1, fc2 and shared gate, up
#: and down, BlockwiseMatMul's B; True where the input holds its rows as ``[E, N, K*bits/8]``, False as ``[N, K/32,
#: 32*bits/8]``
_INTERLEAVED_WEIGHTS = {OP_TYPE: {2: True, 4: True, 7: False, 9: False, 11: False}, LINEAR_OP_TYPE: {1: False}}
#: BlockwiseMatMul rows this long or shorter stay as they are: ``cpu_ops.c`` computes a decode step's short rows 4 at
#: a time (``dot4``, up to its ``DOT4_MAX_K``), faster than one by one in either layout
_SHORT_ROWS = 512


def interleave_rows(rows, bits: int):
    """The uint8 rows ``[M, K*bits/8]`` (int4 or int8 weights in blocks of 32, each block's bytes in order) in the
    interleaved layout of ``mla_deploy/ort/csrc/cpu_ops.c`` (``lane_byte``): in each group of 16 whole blocks, byte
    ``m`` of block ``j`` moves to ``64 * (m // 4) + 4 * j + m % 4`` of the group; blocks after the last whole group
    stay. A new array ``[M, K*bits/8]``; the same bytes, only moved (AVX-512 VNNI then sums each block in its own
    32-bit lane over all of a group's loads, and applies the group's 16 scales once)."""
    import numpy as np

    block = 32 * bits // 8
    M, width = rows.shape
    whole = width // (16 * block) * 16 * block
    out = np.array(rows, dtype=np.uint8, copy=True)
    out[:, :whole] = rows[:, :whole].reshape(M, -1, 16, block // 4, 4).transpose(0, 1, 3, 2, 4).reshape(M, whole)
    return out


def interleave_weights(model, folder=None, side=None) -> int:
    """Store the weights of every ``mla_deploy.RoutedExperts`` node and of every ``BlockwiseMatMul`` of rows longer
    than :data:`_SHORT_ROWS` values of the ``onnx.ModelProto`` ``model`` (in place) in the interleaved layout
    (:func:`interleave_rows`) and give the node ``interleaved=1``, where the node alone reads them; returns how many
    nodes. The new copies of external weights (under ``folder``) go into the file ``side`` (a path under ``folder``,
    appended to, each at a 4 KiB-aligned offset), which the model then names; in-graph ones are rewritten in place.
    The operators' products are the same integer sums per block: only the order of the float sums differs (a
    decode step streams the rows faster: docs/cpu-engine.md)."""
    import contextlib
    import os
    from pathlib import Path

    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    tensors = {t.name: t for t in model.graph.initializer}
    consumers = _links(list(model.graph.node))[1]
    outputs = {o.name for o in model.graph.output}
    chosen = []
    for node in model.graph.node:
        slots = _INTERLEAVED_WEIGHTS.get(node.op_type) if node.domain == DOMAIN else None
        attrs = _attributes(node)
        if not slots or attrs.get("interleaved", 0) or attrs.get("K", _SHORT_ROWS + 1) <= _SHORT_ROWS:
            continue
        names = {i: node.input[i] for i in slots if i < len(node.input) and node.input[i]}
        if all(n in tensors and tensors[n].data_type == TensorProto.UINT8 and len(tensors[n].dims) == 3
               and n not in outputs and consumers.get(n) == [node] for n in names.values()):
            chosen.append((node, names))
    if not chosen:
        return 0
    external = [n for _, names in chosen for n in names.values() if _is_external(tensors[n])]
    if external and (folder is None or side is None):
        raise ValueError("interleave_weights: external weights need the folder and a side file")
    folder = Path(folder) if folder is not None else None
    location = os.path.relpath(side, folder) if external else None
    with open(side, "ab") if external else contextlib.nullcontext() as out:
        for node, names in chosen:
            attrs = _attributes(node)
            bits = int(attrs["bits"] if node.op_type == LINEAR_OP_TYPE else attrs.get("expert_weight_bits", 4))
            for slot, name in names.items():
                tensor = tensors[name]
                dims = [int(d) for d in tensor.dims]
                width = dims[2] if _INTERLEAVED_WEIGHTS[node.op_type][slot] else dims[1] * dims[2]
                if not _is_external(tensor):
                    rows = numpy_helper.to_array(tensor).reshape(-1, width)
                    tensor.CopyFrom(numpy_helper.from_array(interleave_rows(rows, bits).reshape(dims), name))
                    continue
                values = _external_values(tensor, folder, "u1").reshape(-1, width)
                offset = _align(out)
                step = max(1, _CHUNK // width)
                for r in range(0, values.shape[0], step):
                    out.write(interleave_rows(np.asarray(values[r: r + step]), bits).tobytes())
                _point_at(tensor, location, offset, out.tell() - offset)
            node.attribute.append(helper.make_attribute("interleaved", 1))
    return len(chosen)


def _is_external(tensor) -> bool:
    from onnx import TensorProto

    return tensor.data_location == TensorProto.EXTERNAL


def _transpose_inside(tensor) -> None:
    """The in-graph float32 TensorProto ``tensor`` ``[..., K, N]`` made ``[..., N, K]``."""
    import numpy as np
    from onnx import numpy_helper

    values = numpy_helper.to_array(tensor)
    tensor.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(np.swapaxes(values, -1, -2)), tensor.name))


def _append_transposed(tensor, folder, out, location: str) -> None:
    """The external float32 TensorProto ``tensor`` ``[K, N]`` or ``[H, K, N]`` (its data under ``folder``) made ``[N,
    K]`` or ``[H, N, K]``, appended to the open file ``out`` (named ``location``) at a 4 KiB-aligned offset,
    :data:`_CHUNK` values at a time."""
    import numpy as np

    *heads, K, N = (int(d) for d in tensor.dims)
    H = heads[0] if heads else 1
    values = _external_values(tensor, folder).reshape(H, K, N)
    offset = _align(out)
    step = max(1, _CHUNK // max(K, 1))
    for h in range(H):
        for n0 in range(0, N, step):
            out.write(np.ascontiguousarray(values[h, :, n0: n0 + step].T).tobytes())
    del tensor.dims[:]
    tensor.dims.extend([*heads, N, K])
    _point_at(tensor, location, offset, out.tell() - offset)


def swap_float_experts(model) -> int:
    """Replace, in the ``onnx.ModelProto`` ``model`` (in place), every float ``com.microsoft`` ``MoE`` node that
    ``mla_deploy.FloatExperts`` computes (SwiGLU with gate and up interleaved, alpha 1, beta 0, no limit, no biases)
    and whose routing is the export's round trip (:func:`swap_experts`) by that operator, given the routing's weights
    and experts; returns how many."""
    from onnx import TensorProto, helper

    graph = model.graph
    producer, consumers = _links(list(graph.node))
    outputs = {o.name for o in graph.output}
    floats = {t.name for t in graph.initializer if t.data_type == TensorProto.FLOAT}
    constant = _constants(model)
    swapped, freed = 0, []
    for node in [n for n in graph.node if (n.domain, n.op_type) == ("com.microsoft", "MoE")]:
        attrs = _attributes(node)
        activation = attrs.get("activation_type", b"relu")
        inputs = list(node.input) + [""] * (5 - len(node.input))
        if ((activation.decode() if isinstance(activation, bytes) else activation) != "swiglu"
                or attrs.get("swiglu_fusion", 0) != 1 or attrs.get("activation_alpha", 1.0) != 1.0
                or attrs.get("activation_beta", 0.0) != 0.0 or "swiglu_limit" in attrs
                or [i for i, name in enumerate(inputs) if name] != [0, 1, 2, 4]
                or not {inputs[2], inputs[4]} <= floats):
            continue
        found = _routing_pattern(node, producer, consumers, outputs, constant)
        if found is None:
            continue
        weights, idx, mul = found
        given = helper.make_node(FLOAT_EXPERTS_OP_TYPE, [node.input[0], weights, inputs[2], inputs[4], idx],
                                 list(mul.output), name=node.name, domain=DOMAIN, k=attrs.get("k", 1))
        freed.extend(_replace(graph, node, mul, given))
        swapped += 1
    if swapped:
        _drop_unused(graph, freed)
        if not any(o.domain == DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return swapped


def fold_float_shared_experts(model, folder=None, side=None) -> int:
    """Give each ``mla_deploy.FloatExperts`` node of the ``onnx.ModelProto`` ``model`` (in place) its layer's shared
    experts where the graph adds them to its output as a float export writes them: ``Add(Reshape(experts), down(silu(
    gate(h)) * up(h)))``, gate, up and down ``MatMul`` nodes of float32 weights ``[D, S*I]``, ``[D, S*I]``, ``[S*I,
    D]`` over the experts' own input ``h`` (or what it reshapes), read by nothing else, ``silu(g)`` as ``Mul(g,
    Sigmoid(g))``, their width a multiple ``S`` of the routed experts' ``I``. The node then takes them as ``S`` more
    experts in its own layout (inputs 5 and 6: fc1 ``[S, 2I, D]``, gate and up rows interleaved, and fc2 ``[S, D,
    I]``; a shared MLP of ``S*I`` units is ``S`` experts of ``I``, each of weight 1) and computes them in the same
    pass as the routed ones: the gate, sigmoid, silu, up, product, down and add nodes go (7 per MoE layer) with
    their weights. Where those weights are external (under ``folder``) the new ones are written to the new file
    ``side`` (a path under ``folder``, each at a 4 KiB-aligned offset; :func:`swap_float_linear` appends to it);
    else they go into the graph. Returns how many nodes were given their shared experts."""
    import contextlib
    import os
    from pathlib import Path

    import numpy as np
    from onnx import TensorProto, numpy_helper

    graph = model.graph
    producer, consumers = _links(list(graph.node))
    outputs = {o.name for o in graph.output}
    tensors = {t.name: t for t in graph.initializer}

    def float_weight(name, rank=2):
        t = tensors.get(name)
        return t is not None and t.data_type == TensorProto.FLOAT and len(t.dims) == rank

    def float_product(name):  # a MatMul by a float32 [K, N] weight that it alone reads
        n = _made_by(producer, name, "MatMul")
        ok = n is not None and len(n.input) == 2 and float_weight(n.input[1]) and consumers.get(n.input[1]) == [n]
        return n if ok else None

    found_all = []
    for node in [n for n in graph.node if (n.domain, n.op_type) == (DOMAIN, FLOAT_EXPERTS_OP_TYPE)]:
        if len(node.input) > 5 or not float_weight(node.input[2], 3):
            continue
        E, two_i, D = (int(d) for d in tensors[node.input[2]].dims)
        I = two_i // 2
        found = _shared_branch(node, producer, consumers, outputs, float_product)
        if found is None:
            continue
        chain, add, gate, sigmoid, silu, up, product, down = found
        g, u, d = (list(tensors[n.input[1]].dims) for n in (gate, up, down))
        width = g[1]
        if g != [D, width] or u != [D, width] or d != [width, D] or not width or width % I:
            continue
        found_all.append((node, chain, add, gate, sigmoid, silu, up, product, down, width // I))
    if not found_all:
        return 0
    external = any(_is_external(tensors[n.input[1]]) for f in found_all for n in (f[3], f[6], f[8]))
    if external and (folder is None or side is None):
        raise ValueError("fold_float_shared_experts: external weights need the folder and a side file")
    folder = Path(folder) if folder is not None else None
    location = os.path.relpath(side, folder) if external else None

    def values(tensor):
        if _is_external(tensor):
            return _external_values(tensor, folder).reshape([int(x) for x in tensor.dims])
        return numpy_helper.to_array(tensor)

    dropped = []
    with (open(side, "wb") if external else contextlib.nullcontext()) as out:  # in-graph weights: no file
        for node, chain, add, gate, sigmoid, silu, up, product, down, S in found_all:
            E, two_i, D = (int(x) for x in tensors[node.input[2]].dims)
            I = two_i // 2
            names = []
            for suffix, shape, parts in (
                    ("shared_fc1", [S, 2 * I, D], lambda s: np.stack(
                        [values(tensors[gate.input[1]])[:, s * I:(s + 1) * I].T,
                         values(tensors[up.input[1]])[:, s * I:(s + 1) * I].T], axis=1).reshape(2 * I, D)),
                    ("shared_fc2", [S, D, I], lambda s: values(tensors[down.input[1]])[s * I:(s + 1) * I].T)):
                name = f"{node.name or node.output[0]}.{suffix}"
                tensor = graph.initializer.add()
                tensor.name, tensor.data_type = name, TensorProto.FLOAT
                tensor.dims.extend(shape)
                if external:
                    offset = _align(out)
                    for s in range(S):  # one shared expert at a time: [2I, D] or [D, I]
                        out.write(np.ascontiguousarray(parts(s), dtype="<f4").tobytes())
                    _point_at(tensor, location, offset, out.tell() - offset)
                else:
                    tensor.raw_data = np.stack([parts(s) for s in range(S)]).astype("<f4").tobytes()
                names.append(name)
            node.input.extend(names)
            (chain[-1] if chain else node).output[0] = add.output[0]
            dropped.extend([gate, sigmoid, silu, up, product, down, add])
    weights = [n.input[1] for n in dropped if n.op_type == "MatMul"]
    for old in dropped:
        graph.node.remove(old)
    for tensor in [t for t in graph.initializer if t.name in weights]:
        graph.initializer.remove(tensor)
    return len(found_all)


def _links(nodes: list) -> tuple[dict, dict]:
    """``(producer, consumers)`` of the NodeProtos ``nodes``: tensor name -> the node making it, and -> the nodes
    reading it (in order, once per reading input)."""
    producer = {out: node for node in nodes for out in node.output}
    consumers: dict[str, list] = {}
    for node in nodes:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    return producer, consumers


def _replace(graph, experts, mul, given) -> list[str]:
    """Put the node ``given`` where the experts node ``experts`` is, removing it and the ``Mul`` that scaled its
    output (the routing round trip's last node); ``given`` keeps where ``experts`` came from (its metadata). Returns
    the names the removed nodes read (what may be left unread: :func:`_drop_unused`)."""
    given.metadata_props.extend(experts.metadata_props)
    read = [*experts.input, *mul.input]
    at = list(graph.node).index(experts)
    for old in (experts, mul):
        graph.node.remove(old)
    graph.node.insert(at, given)
    return read


def _routing_pattern(node, producer, consumers, outputs, constant) -> tuple[str, str, object] | None:
    """``(weights, idx, the Mul node)`` when the RoutedExperts ``node`` reads the export's routing round trip
    (:func:`swap_experts`), else None. ``constant``: tensor name -> numpy value of the graph's constants."""
    from onnx import numpy_helper

    def made_by(name, op_type):
        return _made_by(producer, name, op_type)

    def attr(n, name, default=None):
        return _attributes(n).get(name, default)

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
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    for output in graph.output:
        readers[output.name] = readers.get(output.name, 0) + 1
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output}
    dropped, pending = set(), list(names)
    while pending:
        name = pending.pop()
        if readers.get(name, 0):
            continue
        at = producer.get(name)
        if at is None or at in dropped or any(readers.get(out, 0) for out in graph.node[at].output):
            continue
        dropped.add(at)
        for source in graph.node[at].input:
            readers[source] -= 1
            pending.append(source)
    unread = {name for name in names if not readers.get(name, 0)}
    kept = [n for i, n in enumerate(_copies(graph.node)) if i not in dropped]
    del graph.node[:]
    graph.node.extend(kept)
    for tensor in [t for t in graph.initializer if t.name in unread or (t.name in readers and not readers[t.name])]:
        graph.initializer.remove(tensor)


def _swap(model, old: str, new: str, eligible, inputs: tuple[int, ...], domain: str = "com.microsoft") -> int:
    """Replace each ``domain`` ``old`` node of ``model`` for which ``eligible(node)`` gives attributes by an
    ``mla_deploy`` ``new`` node with those attributes, the old node's ``inputs`` (by position) and its outputs, at the
    same place in the graph; returns how many."""
    from onnx import helper

    swapped = 0
    for at, node in enumerate(list(model.graph.node)):
        attrs = eligible(node) if (node.domain, node.op_type) == (domain, old) else None
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
        attrs = _attributes(dq)
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
    """Whether the ``onnx.ModelProto`` ``model`` holds a node these operators could replace (``QMoE``, ``MoE``,
    ``MatMulNBits``, a ``DequantizeLinear`` along axis 2, a ``MatMul`` of a float32 weight; eligible or not)."""
    weights = _float_weights(model)
    return any((n.domain, n.op_type) in (("com.microsoft", "QMoE"), ("com.microsoft", "MatMulNBits"),
                                         ("com.microsoft", "MoE"))
               or (n.op_type == "DequantizeLinear" and any(a.name == "axis" and a.i == 2 for a in n.attribute))
               or (n.domain == "" and n.op_type == "MatMul" and len(n.input) == 2 and n.input[1] in weights)
               for n in model.graph.node)


ATTENTION_OP_TYPE = "LatentAttention"
#: the op types a layer's attention core holds besides its key nodes (views, the rope, the norm, the cache write)
_ATTENTION_VIEWS = {"Reshape", "Transpose", "Split", "Slice", "Mul", "Add", "Concat", "Pow", "Sqrt", "Div",
                    "Unsqueeze", "Squeeze", "Identity", "TensorScatter"}
#: the latent rank's multiple the operator computes (its weighted sum's channels per item, cpu_ops.c's CHANNELS;
#: quantized per-head weights' blocks of 32 imply it, float ones do not)
_LATENT_CHANNELS = 32
#: the key nodes, how many of each one layer's core holds
_ATTENTION_KEYS = {HEADWISE_OP_TYPE: 2, "MatMul": 2, "Softmax": 1, "Where": 1, "Gather": 2, "ReduceMean": 1}


def swap_attention(model) -> int:
    """Replace, in the ``onnx.ModelProto`` ``model`` (in place), each layer's absorbed attention core over its
    latent cache, concatenated (``Concat``) or static (``TensorScatter`` at ``write_indices``)
    (:class:`~mla_deploy.model.mla.AbsorbedMLAttention`, ``A_CC``, float32, its per-head
    products already ``HeadwiseMatMul`` (:func:`swap_headwise`) or ``MatMul`` by float32 weights ``[H, K, N]``, which
    the node then takes as they are, ``bits`` 32) by one ``mla_deploy.LatentAttention`` node; returns how many. The core is every node on a path from the query and ``kv_a`` products' outputs to ``o_proj``'s input
    and the present cache (the past cache is one of its inputs); it is swapped only where it holds exactly the nodes
    that form computes (:data:`_ATTENTION_KEYS`, the rest views and elementwise ops) and nothing outside reads its
    inner tensors."""
    from onnx import helper

    graph = model.graph
    graph_inputs = {i.name for i in graph.input}
    outputs = {o.name for o in graph.output}
    initializers = {t.name: t for t in graph.initializer}
    constant = _constants(model)
    presents = [n.output[0] for n in graph.node if n.input and n.input[0] in graph_inputs and n.output[0] in outputs
                and ((n.op_type == "Concat" and len(n.input) == 2) or _static_write(n, graph_inputs))]
    # every layer's core is found in the graph as it is (the cores are disjoint), then the graph is rebuilt once
    cores: dict[int, object] = {}  # the position of a core's last node -> the node replacing the core
    region: set[int] = set()
    for present in presents:
        concat = next(n for n in graph.node if present in n.output)
        found = _attention_core(graph, concat, initializers, constant)
        if found is None:
            continue
        positions, inputs, attrs, attn = found
        if concat.op_type == "TensorScatter":
            inputs.append(concat.input[2])  # write_indices
        cores[max(positions)] = helper.make_node(ATTENTION_OP_TYPE, inputs, [attn, present], domain=DOMAIN,
                                                 name=f"{concat.name}/LatentAttention", **attrs)
        region |= positions
    swapped, freed, order = len(cores), [], []
    for i, copy in enumerate(_copies(graph.node) if cores else []):
        if i in region:
            freed.extend(copy.input)
        else:
            order.append(copy)
        if i in cores:
            order.append(cores[i])
    if swapped:
        del graph.node[:]
        graph.node.extend(order)
        _drop_unused(graph, freed)
        _sort_nodes(graph)
        if not any(o.domain == DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return swapped


def _static_write(node, graph_inputs) -> bool:
    """Whether ``node`` writes a static cache's new rows: ``TensorScatter(past [B, 1, T, C], rows [B, 1, S, C],
    write_indices [B])`` along the slots (axis -2), mode linear, its past and write_indices the graph's inputs."""
    if node.op_type != "TensorScatter" or len(node.input) != 3 or node.input[2] not in graph_inputs:
        return False
    attrs = _attributes(node)
    mode = attrs.get("mode", "linear")
    return attrs.get("axis", -2) in (-2, 2) and (mode.decode() if isinstance(mode, bytes) else mode) == "linear"


def _is_product(node, initializers) -> bool:
    """A layer's projection: a quantized product, or a float MatMul/Gemm by a stored weight of two dimensions."""
    if (node.domain, node.op_type) in (("com.microsoft", "MatMulNBits"), (DOMAIN, LINEAR_OP_TYPE)):
        return True
    return (node.op_type in ("MatMul", "Gemm") and len(node.input) > 1 and node.input[1] in initializers
            and len(initializers[node.input[1]].dims) == 2)


def _is_float_per_head(node, initializers) -> bool:
    """An absorbed attention's float per-head product: ``MatMul`` by a stored float32 weight ``[H, K, N]``."""
    from onnx import TensorProto

    weight = initializers.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
    return (node.domain or "") == "" and weight is not None and len(weight.dims) == 3 and (
        weight.data_type == TensorProto.FLOAT)


def _attention_core(graph, concat, initializers, constant):
    """``(the region's node positions in graph.node, the LatentAttention inputs, its attributes, o_proj's input
    name)`` for the layer whose present cache ``concat`` writes, or None where its attention is not the absorbed
    core :func:`swap_attention` replaces."""
    from onnx import helper

    everything = list(graph.node)  # one wrapper per node: ids below are of these (a repeated field's item is not)
    producer, consumers = _links(everything)
    present = concat.output[0]
    concat = producer[present]

    # forward from the present cache to the first product: o_proj, whose input is the core's output
    seen, todo, ends = set(), [present], []
    while todo:
        for n in consumers.get(todo.pop(), []):
            if id(n) in seen:
                continue
            seen.add(id(n))
            if _is_product(n, initializers):
                ends.append(n)
            else:
                todo.extend(n.output)
    if len({id(n) for n in ends}) != 1:
        return None
    attn = ends[0].input[0]
    # backward from the core's outputs to the products feeding it: the query and kv_a projections
    back, todo, sources = set(), [attn, present], set()
    while todo:
        n = producer.get(todo.pop())
        if n is None or id(n) in back:
            continue
        if _is_product(n, initializers):
            sources.add(n.output[0])
            continue
        back.add(id(n))
        todo.extend(n.input)
    if len(sources) != 2:
        return None

    def forward(starts):
        reached, names = set(), list(starts)
        while names:
            for n in consumers.get(names.pop(), []):
                if id(n) not in reached and id(n) in back:
                    reached.add(id(n))
                    names.extend(n.output)
        return reached

    region = forward(sources)  # the past is read by the cache write and, through its shape, by the shared mask
    if id(concat) not in region:
        return None
    nodes = [n for n in everything if id(n) in region]

    def kind(n):  # a per-head product, quantized (HeadwiseMatMul) or float32 (MatMul by [H, K, N]), counts as one
        return HEADWISE_OP_TYPE if _is_float_per_head(n, initializers) else n.op_type

    kinds: dict[str, int] = {}
    for n in nodes:
        kinds[kind(n)] = kinds.get(kind(n), 0) + 1
    if {k: kinds.get(k, 0) for k in _ATTENTION_KEYS} != _ATTENTION_KEYS or any(
            k not in _ATTENTION_KEYS and k not in _ATTENTION_VIEWS for k in kinds):
        return None
    if any(n.domain not in ("", "ai.onnx") for n in nodes if n.op_type != HEADWISE_OP_TYPE):
        return None
    # nothing outside may read an inner tensor
    inner = {out for n in nodes for out in n.output} - {attn, present}
    if any(id(c) not in region for name in inner for c in consumers.get(name, [])) or inner & set(
            o.name for o in graph.output):
        return None

    def attr(n, name, default=None):
        return _attributes(n).get(name, default)

    def scalar(name):
        value = constant.get(name)
        return float(value.reshape(-1)[0]) if value is not None and value.size == 1 else None

    by_type = {k: [n for n in nodes if kind(n) == k] for k in _ATTENTION_KEYS}
    (softmax,), (where,) = by_type["Softmax"], by_type["Where"]
    if softmax.input[0] != where.output[0] or attr(softmax, "axis", -1) not in (-1, 3):
        return None
    after_softmax = forward([softmax.output[0]])
    heads = by_type[HEADWISE_OP_TYPE]
    uv = [n for n in heads if id(n) in after_softmax]
    uk = [n for n in heads if id(n) not in after_softmax]
    if len(uv) != 1 or len(uk) != 1:
        return None
    uk, uv = uk[0], uv[0]
    # the mask: Where(cond, fill, scores) hides where cond holds; Where(cond, scores, fill) where it does not
    cond, first, second = where.input
    if scalar(second) is not None and first in producer and id(producer[first]) in region:
        hidden_when, fill, scores = 0, scalar(second), first
    elif scalar(first) is not None and second in producer and id(producer[second]) in region:
        hidden_when, fill, scores = 1, scalar(first), second
    else:
        return None
    # the scale: a Mul by a scalar between the scores' MatMul and the Where, through views only
    n, scale = producer.get(scores), None
    while n is not None and id(n) in region and n.op_type in ("Reshape", "Transpose", "Unsqueeze", "Squeeze"):
        n = producer.get(n.input[0])
    if n is not None and n.op_type == "Mul":
        scale = next((scalar(i) for i in n.input if scalar(i) is not None), None)
    if scale is None:
        return None
    # the norm: x / sqrt(mean(x^2) + eps) * w
    (mean,) = by_type["ReduceMean"]
    adds = [c for c in consumers.get(mean.output[0], []) if c.op_type == "Add"]
    eps = next((scalar(i) for i in adds[0].input if scalar(i) is not None), None) if len(adds) == 1 else None
    weights = [i for n in nodes if n.op_type == "Mul" for i in n.input
               if i in initializers and len(initializers[i].dims) == 1]
    floats = {name: n.op_type == "MatMul" for name, n in (("uk", uk), ("uv", uv))}
    r = (initializers[uk.input[1]].dims[2] if floats["uk"]  # float W_UK [H, dn, r]
         else helper.get_attribute_value(next(a for a in uk.attribute if a.name == "N")))
    if eps is None or len(weights) != 1 or list(initializers[weights[0]].dims) != [r] or r % _LATENT_CHANNELS:
        return None
    # the two products: kv_a's output reaches the rows written to the cache, the query's does not
    new_rows = producer.get(concat.input[1])
    kv = [s for s in sorted(sources) if new_rows is not None and id(new_rows) in forward([s])]
    if len(kv) != 1:
        return None
    kv = kv[0]
    q = next(s for s in sources if s != kv)
    from_q = forward([q])
    # the two ropes: x * cos + Gather(x, pairs) * sin, pairs a constant along the last axis
    ropes = {}
    for gather in by_type["Gather"]:
        x, pairs = gather.input
        uses = consumers.get(gather.output[0], [])
        if (pairs not in constant or constant[pairs].ndim != 1 or attr(gather, "axis", 0) != -1 or len(uses) != 1
                or uses[0].op_type != "Mul"):
            return None
        sin = next(i for i in uses[0].input if i != gather.output[0])
        add = consumers.get(uses[0].output[0], [])
        if len(add) != 1 or add[0].op_type != "Add":
            return None
        mul = producer.get(next((i for i in add[0].input if i != uses[0].output[0]), ""))
        if mul is None or mul.op_type != "Mul" or x not in mul.input:
            return None
        cos = next(i for i in mul.input if i != x)
        ropes["q" if id(gather) in from_q else "k"] = (cos, sin, pairs)
    if set(ropes) != {"q", "k"}:
        return None
    # a float per-head weight goes in as its MatMul holds it, with no scales, and bits 32
    bits = {name: 32 if floats[name] else helper.get_attribute_value(next(a for a in n.attribute if a.name == "bits"))
            for name, n in (("uk", uk), ("uv", uv))}
    products = [name for n in (uk, uv) for name in ((n.input[1], "") if n.op_type == "MatMul" else n.input[1:3])]
    inputs = [q, kv, concat.input[0], cond, *ropes["q"][:2], *ropes["k"][:2], ropes["q"][2], ropes["k"][2],
              weights[0], *products]
    attrs = {"bits_uk": bits["uk"], "bits_uv": bits["uv"], "hidden_when": hidden_when, "scale": scale, "eps": eps,
             "fill": fill}
    return {i for i, n in enumerate(everything) if id(n) in region}, inputs, attrs, attn



def _sort_nodes(graph) -> None:
    """Order ``graph``'s nodes so that each comes after the producers of its inputs, keeping their order otherwise
    (each step takes the earliest node whose inputs are all made)."""
    import heapq

    nodes = _copies(graph.node)
    producer = {out: i for i, n in enumerate(nodes) for out in n.output if out}
    waiting = [0] * len(nodes)
    readers: dict[int, list[int]] = {}
    for i, n in enumerate(nodes):
        for j in {producer[name] for name in n.input if name in producer and producer[name] != i}:
            waiting[i] += 1
            readers.setdefault(j, []).append(i)
    ready = [i for i, count in enumerate(waiting) if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(nodes[i])
        for k in readers.get(i, []):
            waiting[k] -= 1
            if waiting[k] == 0:
                heapq.heappush(ready, k)
    assert len(order) == len(nodes), "the graph has a cycle"
    del graph.node[:]
    graph.node.extend(order)


def _copies(nodes) -> list:
    """Detached copies of the NodeProtos ``nodes`` (a repeated field cleared and refilled copies what it is given)."""
    copies = []
    for n in nodes:
        copy = type(n)()
        copy.CopyFrom(n)
        copies.append(copy)
    return copies


#: the scale inputs of our operators that may be float16: (op type, input index)
_HALF_SCALE_SLOTS = {(OP_TYPE, 3), (OP_TYPE, 5), (OP_TYPE, 8), (OP_TYPE, 10), (OP_TYPE, 12), (LINEAR_OP_TYPE, 2)}
#: values converted or transposed at a time: the copies stay near 64 MiB whatever the tensor
_CHUNK = 1 << 24


def store_half_scales(model, folder, side) -> int:
    """Store the float32 block scales that ``mla_deploy.RoutedExperts`` and ``BlockwiseMatMul`` nodes of the
    ``onnx.ModelProto`` ``model`` (in place; its external weights under ``folder``) read as float16, where that is
    exact: every value of the tensor (both of a RoutedExperts node's) a float16 (the export quantizes so:
    :func:`~mla_deploy.quant.scheme.quantize`). The float16 copies of external tensors go into the new file ``side``
    (a path under ``folder``, 4 KiB-aligned; not left behind when it would be empty), which the model then names; a tensor that something else reads too, or
    that any value keeps from being exact, stays as it is. Returns how many tensors were stored as float16.

    Half a scale's bytes: the operators stream 2 bytes of scale per block of 32 weights instead of 4 (10% of an int4
    weight's bytes). The operators read either type; the values, so the products, are the same."""
    import os
    from pathlib import Path

    from onnx import TensorProto

    inits = {t.name: t for t in model.graph.initializer}
    readers: dict[str, list] = {}
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name:
                readers.setdefault(name, []).append((node.op_type if node.domain == DOMAIN else None, i))
    groups = []  # per node: the scale tensors that must change type together
    for node in model.graph.node:
        slots = [i for op, i in _HALF_SCALE_SLOTS if node.domain == DOMAIN and node.op_type == op and i < len(node.input)]
        names = [node.input[i] for i in sorted(slots)]
        if names and all(inits.get(n) is not None and inits[n].data_type == TensorProto.FLOAT
                         and all(r in _HALF_SCALE_SLOTS for r in readers[n]) for n in names):
            groups.append(names)
    folder, side = Path(folder), Path(side)
    location, stored = os.path.relpath(side, folder), 0
    with open(side, "wb") as out:
        for names in groups:
            pending = [n for n in dict.fromkeys(names) if inits[n].data_type == TensorProto.FLOAT]  # not yet stored
            start = out.tell()
            held = [_append_half(inits[n], folder, out) for n in pending] if pending else []
            if None in held:  # a value no float16 holds: the group keeps float32, its bytes are taken back
                out.seek(start)
                out.truncate()
                continue
            for name, where in zip(pending, held):
                _make_half(inits[name], where, location)
            stored += len(pending)
    if not side.stat().st_size:  # nothing external was stored
        side.unlink()
    return stored


def _float_chunks(tensor, folder):
    """The float32 values of the TensorProto ``tensor`` (its external data under ``folder``, or its own), a chunk of
    at most :data:`_CHUNK` at a time (numpy arrays)."""
    import numpy as np
    from onnx import numpy_helper

    if _is_external(tensor):
        values = _external_values(tensor, folder)
    else:
        values = numpy_helper.to_array(tensor).reshape(-1).astype(np.float32)
    for lo in range(0, values.size, _CHUNK):
        yield np.asarray(values[lo: lo + _CHUNK])


def _external_values(tensor, folder, dtype: str = "<f4"):
    """The values of the external TensorProto ``tensor`` (its file under ``folder``; float32 unless ``dtype`` says
    otherwise), mapped, flat."""
    import numpy as np

    entries = {e.key: e.value for e in tensor.external_data}
    return np.memmap(folder / entries["location"], dtype=dtype, mode="r", offset=int(entries.get("offset", 0)),
                     shape=(_count(list(tensor.dims)),))


def _align(out) -> int:
    """Pad the open file ``out`` with zeros to the next 4 KiB boundary; that offset."""
    offset = -(-out.tell() // 4096) * 4096
    out.write(b"\0" * (offset - out.tell()))
    return offset


def _append_half(tensor, folder, out):
    """The float32 TensorProto ``tensor``'s values as float16, checked exact chunk by chunk as they are converted:
    appended to the open file ``out`` at a 4 KiB-aligned offset where the tensor is external (``(offset, length)``),
    else their bytes; None where a value is no float16 (its sign and bits kept; what was appended stays for the
    caller to take back)."""
    import numpy as np

    external = _is_external(tensor)
    offset = _align(out) if external else None
    parts = []
    for chunk in _float_chunks(tensor, folder):
        with np.errstate(over="ignore"):
            half = chunk.astype(np.float16)
        if not np.array_equal(half.astype(np.float32).view(np.uint32), chunk.view(np.uint32)):
            return None
        if external:
            out.write(half.tobytes())
        else:
            parts.append(half.tobytes())
    return (offset, out.tell() - offset) if external else b"".join(parts)


def _make_half(tensor, where, location: str) -> None:
    """Make ``tensor`` float16: ``where`` is :func:`_append_half`'s ``(offset, length)`` in the file ``location``, or
    the bytes it holds itself."""
    from onnx import TensorProto

    tensor.data_type = TensorProto.FLOAT16
    if isinstance(where, tuple):
        _point_at(tensor, location, *where)
    else:
        del tensor.float_data[:]
        tensor.raw_data = where


def _point_at(tensor, location: str, offset: int, length: int) -> None:
    """Make ``tensor``'s data the ``length`` bytes at ``offset`` of the external file ``location``."""
    from onnx import TensorProto

    del tensor.float_data[:]
    tensor.ClearField("raw_data")
    del tensor.external_data[:]
    tensor.data_location = TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value=location)
    tensor.external_data.add(key="offset", value=str(offset))
    tensor.external_data.add(key="length", value=str(length))
