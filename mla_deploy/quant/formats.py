"""The weight formats: how a quantized weight is written into the graph, laid out, stored and computed.

Each format is one object (:data:`QDQ`, :data:`MATMULNBITS`) that answers every question the rest of the package
asks about it:

* the graph (:meth:`~WeightFormat.insert`): ``qdq`` puts ``MatMul(x, DequantizeLinear(W.q, W.scale, axis=0,
  block_size=B))`` (standard ONNX, opset >= 21); ``matmulnbits`` replaces the ``MatMul`` by ONNX Runtime's
  ``com.microsoft`` ``MatMulNBits(x, W.nbits, W.scale)`` with ``accuracy_level=4``;
* the layout (:meth:`~WeightFormat.layout`): ``qdq``: ``W.q [K, N]`` ``INT8``/``INT4`` (two per byte, low nibble
  first), ``W.scale [ceil(K/B), N]``; ``matmulnbits``: ``W.nbits [N, ceil(K/B), B*bits/8]`` uint8 (each value plus
  ``2^(bits-1)``, the kernel's default zero point; a short last block padded), ``W.scale [N * ceil(K/B)]``;
* the bytes stored (:meth:`~WeightFormat.nbytes`, what the bench's bound counts): ``K*N*bits/8`` plus the scales;
  ``matmulnbits`` stores whole blocks (``K`` padded to a multiple of ``B``);
* TensorRT (:attr:`~WeightFormat.tensorrt`, :meth:`~WeightFormat.require_tensorrt`): builds ``qdq`` (weight-only
  quantization), cannot parse ``matmulnbits``;
* exact compute (:func:`session`): ``qdq``: the session option ``session.qdq_matmulnbits_accuracy_level``;
  ``matmulnbits``: the nodes' ``accuracy_level`` rewritten in memory (the files untouched).

The fused experts (:mod:`mla_deploy.expert_forms`) hold their quantized weights in a third layout whatever the
format, :data:`QMOE`: ONNX Runtime's ``QMoE`` node, the same scheme stacked over the experts (:class:`_QMoE`); an
fp16/bf16 export's (the fused form's ``cuda`` layout, :mod:`mla_deploy.expert_forms`) in :data:`QMOE_CUDA`, the same
bytes marked for ONNX Runtime's CUDA kernel (:class:`_QMoECuda`). The
absorbed attention's per-head products (``w_uk``, ``w_uv``: ``[H, K, N]``) are held, by the formats that take them
(:attr:`~WeightFormat.headwise`: ``matmulnbits``), in a fourth, :data:`HEADWISE` (:class:`_Headwise`).

Why two:

* ``qdq``: TensorRT's ONNX parser reads a ``DequantizeLinear`` of a constant weight feeding a ``MatMul`` as
  weight-only quantization. ONNX Runtime's CPU provider fuses each pair into one ``MatMulNBits`` when the session
  loads (its optimized graph holds no ``DequantizeLinear``), but the fusion re-lays every weight out in memory before
  the kernels pack it: 2.2-2.8x the weights' bytes at load, against 1.4x, and 3x the load time, measured here on
  2.2 GB of int4 weights;
* ``matmulnbits``: the same kernel as the fused ``qdq``, without the re-layout. TensorRT cannot read it.

The arithmetic of a quantized product (:data:`COMPUTE`): ``int8`` quantizes the activations to int8 per block
inside the product (ONNX Runtime's fast CPU path, ``accuracy_level`` 4, as llama.cpp's ``Q8_0``/``Q4_0`` products
do), ``fp32`` multiplies in float32 with the dequantized weights (exact to float32 rounding; ``accuracy_level`` 1):
what validation compares with PyTorch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ArtifactError, ExportError, InputError
from ..expert_forms import CPU_LAYOUT, CUDA_LAYOUT, FUSED_LAYOUTS, fused_layout
from .scheme import WeightQuantization

if TYPE_CHECKING:
    import torch

#: ``quantized_compute``: the arithmetic of a quantized weight's product, as ONNX Runtime's ``accuracy_level``
COMPUTE = {"int8": 4, "fp32": 1}
FAST_COMPUTE, EXACT_COMPUTE = "int8", "fp32"
#: the session config entry ONNX Runtime reads for the ``MatMulNBits`` it fuses from ``DequantizeLinear -> MatMul``
QDQ_ACCURACY_ENTRY = "session.qdq_matmulnbits_accuracy_level"
#: where a session given a model's bytes finds its external weights
EXTERNAL_FOLDER_ENTRY = "session.model_external_initializers_file_folder_path"
MS_DOMAIN = "com.microsoft"
ONNX_DOMAINS = ("", "ai.onnx")


def accuracy_level(compute: str) -> int:
    """ONNX Runtime's ``accuracy_level`` of ``compute`` (``int8`` or ``fp32``). Raises: InputError otherwise."""
    if compute not in COMPUTE:
        raise InputError(f"quantized_compute must be one of {', '.join(COMPUTE)}, got {compute!r}")
    return COMPUTE[compute]


class WeightFormat:
    """How quantized weights are written. Use the instances :data:`QDQ` and :data:`MATMULNBITS`.

    Attributes:
        name: ``qdq`` or ``matmulnbits`` (``--quant-format``, ``[export] quant_format``, the manifest's ``format``).
        ops: what carries the weights in the graph (the manifest's ``ops``).
        parts: the suffixes of a weight's initializers, integers first, then scales.
        whole_blocks: the integers are stored in whole blocks (``K`` padded to a multiple of the block size).
        tensorrt: TensorRT can build a graph holding it.
        headwise: the absorbed attention's per-head weights ``[H, K, N]`` are quantized too, in :data:`HEADWISE`.
    """

    name: str = ""
    ops: str = ""
    parts: tuple[str, str] = ("", "")
    whole_blocks: bool = False
    tensorrt: bool = True
    headwise: bool = False

    def __repr__(self) -> str:
        return f"<WeightFormat {self.name}>"

    def insert(self, model, value, scheme: WeightQuantization) -> list:
        """Replace the float weight ``value`` (an ``onnx_ir`` initializer ``[K, N]``, only ever ``MatMul``'s second
        input) in ``model`` by the nodes of this format reading two new initializers (placeholders, no data yet).

        Returns:
            the new initializer values, integers then scales (named ``{W}{parts[i]}``).
        """
        raise NotImplementedError

    def layout(self, q: "torch.Tensor", scale: "torch.Tensor", scheme: WeightQuantization) -> tuple:
        """The stored tensors of :func:`~mla_deploy.quant.quantize`'s ``q [K, N]`` and ``scale [ceil(K/B), N]``,
        in the order of :attr:`parts`."""
        raise NotImplementedError

    def nbytes(self, k: int, n: int, scheme: WeightQuantization, scale_itemsize: int) -> int:
        """Bytes one ``[K, N]`` weight takes as stored: its integers plus its scales."""
        return scheme.nbytes(k, n, scale_itemsize, whole_blocks=self.whole_blocks)

    def observe(self, model) -> dict[str, tuple[int, int]]:
        """What an ONNX ``ModelProto`` (weights not needed) holds in this format: ``{integers' initializer:
        (bits, block_size)}``."""
        raise NotImplementedError

    def lay_out(self, view: "torch.Tensor", scheme: WeightQuantization) -> tuple:
        """The stored tensors of the weight ``view`` as the graph consumes it (``[K, N]``, a ``MatMul``'s second
        input): :func:`~mla_deploy.quant.quantize` then :meth:`layout`."""
        from .scheme import quantize

        return self.layout(*quantize(view, scheme), scheme)

    #: a stacked ``[E, N, K]`` view is laid out one expert at a time (:meth:`lay_out_expert`)
    per_expert: bool = False

    def lay_out_expert(self, view: "torch.Tensor", scheme: WeightQuantization) -> tuple:
        """The stored tensors of one expert ``view [N, K]`` of a stacked weight (formats with :attr:`per_expert`):
        the ``[e]`` slices of :meth:`lay_out`'s."""
        raise NotImplementedError

    def entries(self, level: int) -> dict[str, str]:
        """The session config entries that make ONNX Runtime compute this format at accuracy ``level``."""
        return {}

    def rewrite(self, model, level: int) -> bool:
        """Make the nodes of this format in the ``ModelProto`` ``model`` (loaded without its weights) compute at
        accuracy ``level``, in place; returns whether anything changed."""
        return False

    def require_tensorrt(self, where: str) -> None:
        """Refuse, naming ``where``, a graph TensorRT cannot parse. Raises: ArtifactError."""


class _Qdq(WeightFormat):
    name, ops, parts = "qdq", "DequantizeLinear(axis=0, block_size) -> MatMul", (".q", ".scale")

    def insert(self, model, value, scheme):
        import onnx_ir as ir

        k, n = (int(d) for d in value.shape)
        q = ir.Value(name=value.name + self.parts[0], shape=ir.Shape([k, n]),
                     type=ir.TensorType(ir.DataType.INT4 if scheme.bits == 4 else ir.DataType.INT8))
        scale = ir.Value(name=value.name + self.parts[1], shape=ir.Shape([scheme.blocks(k), n]), type=value.type)
        node = ir.Node("", "DequantizeLinear", inputs=[q, scale], num_outputs=1,
                       attributes=[ir.AttrInt64("axis", 0), ir.AttrInt64("block_size", scheme.block_size)])
        out = node.outputs[0]
        out.name, out.shape, out.type = f"{value.name}.dequantized", ir.Shape([k, n]), value.type
        value.replace_all_uses_with(out)
        model.graph.insert_before(model.graph[0], node)
        return [q, scale]

    def layout(self, q, scale, scheme):
        return q, scale

    def observe(self, model):
        import onnx

        bits = {onnx.TensorProto.INT8: 8, onnx.TensorProto.INT4: 4}
        per_head = HEADWISE.observe(model)
        held = {i.name: bits[i.data_type] for i in model.graph.initializer
                if i.data_type in bits and i.name not in per_head}
        return {node.input[0]: (held[node.input[0]], _attributes(node).get("block_size", 0))
                for node in model.graph.node
                if node.op_type == "DequantizeLinear" and node.domain in ONNX_DOMAINS and node.input[0] in held}

    def entries(self, level):
        return {QDQ_ACCURACY_ENTRY: str(level)}


class _MatMulNBits(WeightFormat):
    name, ops, parts = "matmulnbits", "com.microsoft MatMulNBits(accuracy_level=4)", (".nbits", ".scale")
    whole_blocks, tensorrt, headwise = True, False, True
    #: the ``com.microsoft`` operator that carries the weights
    op_type = "MatMulNBits"
    #: the accuracy level the nodes are written with (int8 activations)
    written = COMPUTE[FAST_COMPUTE]

    def insert(self, model, value, scheme):
        import onnx_ir as ir

        k, n = (int(d) for d in value.shape)
        blocks = scheme.blocks(k)
        q = ir.Value(name=value.name + self.parts[0], shape=ir.Shape([n, blocks, scheme.block_size * scheme.bits // 8]),
                     type=ir.TensorType(ir.DataType.UINT8))
        scale = ir.Value(name=value.name + self.parts[1], shape=ir.Shape([n * blocks]), type=value.type)
        for use in list(value.uses()):
            matmul = use.node
            node = ir.Node(MS_DOMAIN, "MatMulNBits", inputs=[matmul.inputs[0], q, scale], num_outputs=1,
                           attributes=[ir.AttrInt64("K", k), ir.AttrInt64("N", n), ir.AttrInt64("bits", scheme.bits),
                                       ir.AttrInt64("block_size", scheme.block_size),
                                       ir.AttrInt64("accuracy_level", self.written)], name=matmul.name)
            _replace_node(model, matmul, node)
        model.opset_imports[MS_DOMAIN] = 1
        return [q, scale]

    def layout(self, q, scale, scheme):
        return matmulnbits_layout(q, scale, scheme)

    def observe(self, model):
        return {node.input[1]: (_attributes(node).get("bits", 0), _attributes(node).get("block_size", 0))
                for node in _nodes(model)}

    def rewrite(self, model, level):
        return _set_accuracy_level(_nodes(model), level)

    def entries(self, level):
        return HEADWISE.entries(level)

    def require_tensorrt(self, where):
        raise ArtifactError(f"{where}'s quantized weights are ONNX Runtime MatMulNBits nodes, which TensorRT cannot "
                            f"parse; export with --quant-format {QDQ.name} for TensorRT")


def _replace_node(model, old_node, node) -> None:
    """Put ``node`` in ``old_node``'s place in ``model``'s graph: its one output takes the old output's name, shape
    and type and every use of it (graph outputs included)."""
    out, old = node.outputs[0], old_node.outputs[0]
    out.shape, out.type, out_name = old.shape, old.type, old.name
    model.graph.insert_before(old_node, node)
    old.replace_all_uses_with(out, replace_graph_outputs=True)
    model.graph.remove(old_node, safe=True)
    out.name = out_name


def _dequantize_nodes(model, axis: int) -> list:
    """The graph's standard ``DequantizeLinear`` NodeProtos along ``axis`` (ONNX's default axis is 1)."""
    return [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.domain in ONNX_DOMAINS
            and _attributes(n).get("axis", 1) == axis]


def _nodes(model, op_type: str = "MatMulNBits") -> list:
    """The graph's ``com.microsoft`` ``op_type`` nodes."""
    return [n for n in model.graph.node if n.op_type == op_type and n.domain == MS_DOMAIN]


def _set_accuracy_level(nodes, level: int) -> bool:
    """Set the ``accuracy_level`` attribute of ``nodes`` (NodeProtos that have it); whether any changed."""
    changed = False
    for node in nodes:
        for attr in node.attribute:
            if attr.name == "accuracy_level" and attr.i != level:
                attr.i, changed = level, True
    return changed


def session(fmt: WeightFormat, path: Path, compute: str) -> tuple[str | bytes, dict[str, str]]:
    """What ONNX Runtime is given to compute the graph at ``path``, its quantized weights in ``fmt`` (the fused
    experts' in :data:`QMOE`), in ``compute`` (``int8`` or ``fp32``): the model (its path, or its bytes with the
    nodes rewritten in memory, the files untouched) and the session config entries.

    Raises:
        InputError: an unknown ``compute``.
    """
    level = accuracy_level(compute)
    entries = fmt.entries(level)
    if level == COMPUTE[FAST_COMPUTE]:  # what the nodes are written with
        return str(path), entries
    import onnx

    model = onnx.load(str(path), load_external_data=False)  # the session reads the weights from path's folder
    if not any([f.rewrite(model, level) for f in (fmt, *QMOE_LAYOUTS.values())]):
        return str(path), entries
    return model.SerializeToString(), {**entries, EXTERNAL_FOLDER_ENTRY: str(Path(path).parent)}


def _attributes(node) -> dict[str, Any]:
    """A NodeProto's integer attributes by name."""
    return {a.name: a.i for a in node.attribute}


def matmulnbits_layout(q: "torch.Tensor", scale: "torch.Tensor",
                       scheme: WeightQuantization) -> tuple["torch.Tensor", "torch.Tensor"]:
    """ONNX Runtime's ``MatMulNBits`` layout of :func:`quantize`'s ``q [K, N]`` and ``scale [ceil(K/B), N]``:
    ``uint8 [N, ceil(K/B), B*bits/8]`` (values plus ``2^(bits-1)``, the kernel's default zero point; int4 two per
    byte, low nibble first; a short last block padded with the zero point) and ``scale [N * ceil(K/B)]``."""
    import torch

    k, n = q.shape
    blocks, b, zero = scheme.blocks(k), scheme.block_size, 1 << (scheme.bits - 1)
    u = torch.full((n, blocks * b), zero, dtype=torch.uint8)
    u[:, :k] = (q.T.to(torch.int16) + zero).to(torch.uint8)
    u = u.view(n, blocks, b)
    if scheme.bits == 4:
        u = u[..., 0::2] | (u[..., 1::2] << 4)
    return u.contiguous(), scale.T.reshape(-1)


class _QMoE(WeightFormat):
    """The fused experts' weights (:mod:`mla_deploy.expert_forms`): ONNX Runtime's ``MoE`` node becomes ``QMoE``.

    Not a ``--quant-format``: whatever the format of the other weights, the stacked expert weights of a ``MoE`` node
    (``fc1 [E, 2I, D]``, gate and up rows interleaved; ``fc2 [E, D, I]``) are written in ``QMoE``'s layout, each
    expert as :func:`matmulnbits_layout` (the same blockwise symmetric scheme, zero point ``2^(bits-1)``, int4 low
    nibble first): ``W.qmoe uint8 [E, N, K*bits/8]`` and ``W.scale [E, N, K/B]``; ``QMoE`` needs ``K`` a multiple of
    the block size. Its ``accuracy_level`` is written 4 (int8 activations). Exact compute: int4 at level 1 keeps fp32
    activations; ONNX Runtime 1.31's CPU ``QMoE`` has no fp32 kernel for int8 experts (int8 activations at every
    level), so an int8 ``QMoE`` becomes, in memory, its weights dequantized in the graph feeding a float ``MoE``.
    """

    name, ops, parts = "qmoe", "com.microsoft QMoE(accuracy_level=4)", (".qmoe", ".scale")
    whole_blocks, tensorrt = True, False
    written = COMPUTE[FAST_COMPUTE]
    #: the float ``MoE``'s weight inputs -> ``QMoE``'s (the scales follow each)
    slots = {2: 2, 4: 5}
    #: the ``weights_prepacked`` attribute written (None: not written), which tells the layouts' nodes apart
    prepacked: int | None = None
    #: what ``hidden_size`` and ``moe_intermediate_size`` must be multiples of, besides the block size (1: nothing)
    k_tile = 1

    def misfit(self, widths, scheme: WeightQuantization) -> str | None:
        """Why this layout cannot hold experts of these input widths (``{"hidden_size": 2048, ...}``) quantized in
        ``scheme``: ``moe_intermediate_size 32 is not a multiple of 64``; None when it can."""
        step = max(scheme.block_size, self.k_tile)  # both are powers of two: a multiple of the larger is of both
        ragged = [f"{name} {width}" for name, width in widths.items() if width % step]
        verb = "is" if len(ragged) == 1 else "are"
        return f"{' and '.join(ragged)} {verb} not a multiple of {step}" if ragged else None

    def _own(self, model) -> list:
        """The graph's ``QMoE`` NodeProtos in this layout."""
        return [n for n in _nodes(model, "QMoE") if _attributes(n).get("weights_prepacked") == self.prepacked]

    def insert(self, model, value, scheme):
        import onnx_ir as ir

        e, n, k = (int(d) for d in value.shape)
        if k % scheme.block_size:
            raise ExportError(f"{value.name}: ONNX Runtime's QMoE needs whole blocks ({k} input features, blocks of "
                              f"{scheme.block_size}); export with --experts branches or another block size")
        q = ir.Value(name=value.name + self.parts[0], shape=ir.Shape([e, n, k * scheme.bits // 8]),
                     type=ir.TensorType(ir.DataType.UINT8))
        scale = ir.Value(name=value.name + self.parts[1], shape=ir.Shape([e, n, k // scheme.block_size]),
                         type=value.type)
        for use in list(value.uses()):
            node, slot = use.node, use.idx
            if node.op_type == "MoE":
                node, slot = self._quantized_node(model, node, scheme), self.slots[slot]
            node.replace_input_with(slot, q)
            node.replace_input_with(slot + 1, scale)
        return [q, scale]

    def _quantized_node(self, model, moe, scheme):
        """Replace the float ``MoE`` node by a ``QMoE`` over the same inputs (weights in its slots, no scales yet)."""
        import onnx_ir as ir

        inputs = [None] * 7
        inputs[:2] = moe.inputs[:2]
        for old, new in self.slots.items():
            inputs[new] = moe.inputs[old]
        attrs = [a for a in moe.attributes.values()] + [
            ir.AttrInt64("expert_weight_bits", scheme.bits), ir.AttrInt64("block_size", scheme.block_size),
            ir.AttrInt64("accuracy_level", self.written)]
        if self.prepacked is not None:
            attrs.append(ir.AttrInt64("weights_prepacked", self.prepacked))
        node = ir.Node(MS_DOMAIN, "QMoE", inputs=inputs, num_outputs=1, attributes=attrs, name=moe.name)
        node.metadata_props.update(moe.metadata_props)  # where it comes from (the module scope)
        _replace_node(model, moe, node)
        return node

    per_expert = True

    def lay_out(self, view, scheme):
        """``view [E, N, K]`` (the stacked weight as the ``MoE`` node reads it) -> ``(uint8 [E, N, K*bits/8],
        scale [E, N, K/B])``."""
        import torch

        parts = [self.lay_out_expert(expert, scheme) for expert in view]
        return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])

    def lay_out_expert(self, view, scheme):
        """``view [N, K]`` (one expert) -> ``(uint8 [N, K*bits/8], scale [N, K/B])``."""
        from .scheme import quantize

        q, scale = matmulnbits_layout(*quantize(view.T, scheme), scheme)
        n = view.shape[0]
        return q.reshape(n, -1), scale.reshape(n, -1)

    def observe(self, model):
        found = {}
        for node in self._own(model):
            attrs = _attributes(node)
            found.update({node.input[i]: (attrs.get("expert_weight_bits", 4), attrs.get("block_size", 0))
                          for i in self.slots.values()})
        return found

    def rewrite(self, model, level):
        nodes = self._own(model)
        int4 = [n for n in nodes if _attributes(n).get("expert_weight_bits", 4) == 4]
        changed = _set_accuracy_level(int4, level)
        if level != self.written:
            for node in [n for n in nodes if n not in int4]:
                _dequantized_moe(model, node)
                changed = True
        return changed

    def require_tensorrt(self, where):
        raise ArtifactError(f"{where}'s experts are ONNX Runtime QMoE nodes, which TensorRT cannot parse; export with "
                            f"--experts branches for TensorRT")


class _QMoECuda(_QMoE):
    """The fused experts' weights in an fp16/bf16 export (the ``cuda`` layout of :mod:`mla_deploy.expert_forms`),
    for ONNX Runtime's CUDA ``QMoE`` (float16/bfloat16 kernels only; onnxruntime-cuda-facts.md, from ONNX Runtime
    1.31.1's schema and source).

    The bytes are :class:`_QMoE`'s (the schema's raw layout: ``uint8 [E, N, K*bits/8]``, zero point
    ``2^(bits-1)``, int4 low nibble first; scales ``[E, N, K/B]``, in the graph's float type as the CUDA kernel
    requires), and the node says so with ``weights_prepacked=0``: the CUDA provider converts them to the CUTLASS SM80
    layout its kernels read when the session loads (``PrePackIntExpertWeights``), as onnxruntime-genai's builder
    writes CUDA ``QMoE`` with ``weights_prepacked=0``. The alternative, storing that pre-packed layout, would mean
    re-implementing CUTLASS's private row permutation and tile interleave here, which no CPU can run or check; these
    bytes are dequantized in NumPy and run by ONNX Runtime's CPU ``QMoE`` (which ignores the attribute). CUDA's
    kernel tiles ``K`` by 64, so ``hidden_size`` and ``moe_intermediate_size`` must be multiples of 64; blocks of 32,
    64 and 128 are all supported there. A session must not set ``session.disable_prepacking`` (the conversion is a
    pre-pack).
    """

    name, ops = "qmoe-cuda", "com.microsoft QMoE(weights_prepacked=0)"
    prepacked, k_tile = 0, 64


def _dequantized_moe(model, node) -> None:
    """Replace the ``QMoE`` NodeProto ``node`` of ``model`` (int8, blocked) by its weights dequantized in the graph
    (``(float(q) - 128) * scale`` per block, exactly PyTorch's ``q * scale``) feeding a float ``MoE`` with the same
    routing inputs and attributes."""
    import numpy as np
    from onnx import helper, numpy_helper

    dims = {init.name: list(init.dims) for init in model.graph.initializer}
    types = {init.name: init.data_type for init in model.graph.initializer}
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    block, zero = attrs["block_size"], 1 << (attrs.get("expert_weight_bits", 8) - 1)
    nodes, weights = [], []
    for slot in _QMoE.slots.values():
        q, scale, name = node.input[slot], node.input[slot + 1], f"{node.input[slot]}.dequantized"
        e, n, k = dims[q]
        dtype = types[scale]  # the graph's float type (float16 in a cuda layout's graph): q - zero is exact in it
        consts = {f"{name}.zero": numpy_helper.from_array(np.array(zero, helper.tensor_dtype_to_np_dtype(dtype))),
                  f"{name}.blocks": numpy_helper.from_array(np.array([e, n, k // block, block], np.int64)),
                  f"{name}.shape": numpy_helper.from_array(np.array([e, n, k], np.int64)),
                  f"{name}.axis": numpy_helper.from_array(np.array([-1], np.int64))}
        for const_name, tensor in consts.items():
            tensor.name = const_name
            model.graph.initializer.append(tensor)
        nodes += [helper.make_node("Cast", [q], [f"{name}.f"], to=dtype),
                  helper.make_node("Sub", [f"{name}.f", f"{name}.zero"], [f"{name}.c"]),
                  helper.make_node("Reshape", [f"{name}.c", f"{name}.blocks"], [f"{name}.b"]),
                  helper.make_node("Unsqueeze", [scale, f"{name}.axis"], [f"{name}.s"]),
                  helper.make_node("Mul", [f"{name}.b", f"{name}.s"], [f"{name}.m"]),
                  helper.make_node("Reshape", [f"{name}.m", f"{name}.shape"], [name])]
        weights.append(name)
    keep = ("k", "activation_type", "swiglu_fusion", "normalize_routing_weights", "activation_alpha", "activation_beta")
    nodes.append(helper.make_node("MoE", [node.input[0], node.input[1], weights[0], "", weights[1]], list(node.output),
                                  name=node.name, domain=MS_DOMAIN, **{k: v for k, v in attrs.items() if k in keep}))
    at = list(model.graph.node).index(node)
    model.graph.node.remove(node)
    for offset, new in enumerate(nodes):
        model.graph.node.insert(at + offset, new)


class _Headwise(WeightFormat):
    """The absorbed attention's per-head weights (``w_uk [H, dn, r]``, ``w_uv`` as multiplied, ``[H, r, dv]``): a
    ``MatMul(A [H, M, K], W [H, K, N])`` against a 3-D constant, which ``MatMulNBits`` does not take.

    Not a ``--quant-format``: the formats with :attr:`~WeightFormat.headwise` (``matmulnbits``) hold these weights
    here. Each head's ``[K, N]`` is quantized like any weight (blocks of ``K``, its product's input features) and
    stored transposed, each output row's ``K`` values contiguous: ``W.q [H, N, K]`` ``INT4``/``INT8`` (signed, no zero
    point; int4 two per byte, low nibble first) and ``W.scale [H, N, ceil(K/B)]``, read by standard ONNX:
    ``MatMul(A, Transpose(DequantizeLinear(W.q, W.scale, axis=2, block_size=B), perm=[0, 2, 1]))``. A bf16 graph
    stores float32 scales and casts the transposed weight to bf16 (``Cast(Transpose(...), to=BFLOAT16)``): ONNX
    Runtime has no ``DequantizeLinear`` that produces bf16, on any provider (a CUDA session refused to load the
    graph: docs/gpu-verification.md).

    ONNX Runtime: the session option ``session.disable_quant_qdq`` = 1 (:meth:`entries`, which ``matmulnbits``
    passes on: its graphs hold no other ``DequantizeLinear``) makes the CPU provider fold the dequantization into a
    float32 constant once, when the session loads (measured on 1.31.1: the optimised graph holds one ``MatMul``), so
    a plain session computes exactly with the dequantized weights; without it, the dequantization would run at every
    step. A CPU engine (:mod:`mla_deploy.ort.cpu_build`) reads the integers as they are instead
    (``mla_deploy.HeadwiseMatMul``, :mod:`mla_deploy.ort.swaps`).
    """

    name, ops, parts = "headwise", "DequantizeLinear(axis=2, block_size) -> Transpose -> MatMul", (".q", ".scale")
    whole_blocks, tensorrt = False, False
    #: folds the dequantization at load (see the class docstring); ONNX Runtime's
    #: ``kOrtSessionOptionsDisableQuantQDQ``
    FOLD_ENTRY = "session.disable_quant_qdq"

    def insert(self, model, value, scheme):
        import onnx_ir as ir

        h, k, n = (int(d) for d in value.shape)
        # ONNX Runtime has no DequantizeLinear producing bfloat16 (on no provider: a session will not load a graph
        # holding one): a bf16 graph dequantizes in float32 and casts the constant
        widen = value.type.dtype == ir.DataType.BFLOAT16
        dequantized = ir.TensorType(ir.DataType.FLOAT) if widen else value.type
        q = ir.Value(name=value.name + self.parts[0], shape=ir.Shape([h, n, k]),
                     type=ir.TensorType(ir.DataType.INT4 if scheme.bits == 4 else ir.DataType.INT8))
        scale = ir.Value(name=value.name + self.parts[1], shape=ir.Shape([h, n, scheme.blocks(k)]), type=dequantized)
        dq = ir.Node("", "DequantizeLinear", inputs=[q, scale], num_outputs=1,
                     attributes=[ir.AttrInt64("axis", 2), ir.AttrInt64("block_size", scheme.block_size)])
        rows = dq.outputs[0]
        rows.name, rows.shape, rows.type = f"{value.name}.dequantized", ir.Shape([h, n, k]), dequantized
        transpose = ir.Node("", "Transpose", inputs=[rows], num_outputs=1,
                            attributes=[ir.AttrInt64s("perm", [0, 2, 1])])
        nodes = [dq, transpose]
        if widen:
            nodes.append(ir.Node("", "Cast", inputs=[transpose.outputs[0]], num_outputs=1,
                                 attributes=[ir.AttrInt64("to", value.type.dtype)]))
            transpose.outputs[0].name = f"{value.name}.transposed"
            transpose.outputs[0].shape, transpose.outputs[0].type = ir.Shape([h, k, n]), dequantized
        out = nodes[-1].outputs[0]
        out.name, out.shape, out.type = f"{value.name}.weight", ir.Shape([h, k, n]), value.type
        value.replace_all_uses_with(out)
        model.graph.insert_before(model.graph[0], nodes)
        return [q, scale]

    def lay_out(self, view, scheme):
        """``view [H, K, N]`` (the weight as the ``MatMul`` multiplies with it) -> ``(int8 [H, N, K], scale
        [H, N, ceil(K/B)])``, each head as :func:`~mla_deploy.quant.quantize` gives it, transposed."""
        import torch

        from .scheme import quantize

        parts = [quantize(head, scheme) for head in view]
        return (torch.stack([q.T for q, _ in parts]).contiguous(),
                torch.stack([s.T for _, s in parts]).contiguous())

    def nbytes(self, k, n, scheme, scale_itemsize):
        """Bytes of one head's ``[K, N]``: each of the ``N`` rows packs its ``K`` integers (a whole byte per row)."""
        return n * -(-k * scheme.bits // 8) + n * scheme.blocks(k) * scale_itemsize

    def observe(self, model):
        import onnx

        bits = {onnx.TensorProto.INT8: 8, onnx.TensorProto.INT4: 4}
        held = {i.name: bits[i.data_type] for i in model.graph.initializer
                if i.data_type in bits and len(i.dims) == 3}
        return {node.input[0]: (held[node.input[0]], _attributes(node).get("block_size", 0))
                for node in _dequantize_nodes(model, axis=2) if node.input[0] in held}

    def entries(self, level):
        return {self.FOLD_ENTRY: "1"}


QDQ = _Qdq()
MATMULNBITS = _MatMulNBits()
#: the absorbed attention's per-head weights (no ``--quant-format``: see :class:`_Headwise`)
HEADWISE = _Headwise()
#: the fused experts' format (no ``--quant-format``: see :class:`_QMoE`)
QMOE = _QMoE()
#: the fused experts' format in an fp16/bf16 export (see :class:`_QMoECuda`)
QMOE_CUDA = _QMoECuda()
#: the fused experts' format of each layout of the fused form (:data:`mla_deploy.expert_forms.FUSED_LAYOUTS`)
QMOE_LAYOUTS = {CPU_LAYOUT: QMOE, CUDA_LAYOUT: QMOE_CUDA}
assert set(QMOE_LAYOUTS) == set(FUSED_LAYOUTS.values())


def layout_disagreement(model, precision: str) -> str | None:
    """Why the ``QMoE`` nodes of the ONNX ``ModelProto`` ``model`` (weights not needed) are not all in the fused
    form's layout for ``precision`` (:func:`mla_deploy.expert_forms.fused_layout`), or None."""
    layout = fused_layout(precision)
    held = QMOE_LAYOUTS[layout].observe(model)
    stray = [node for node in _nodes(model, "QMoE") if node.input[2] not in held]
    if stray:
        return f"its QMoE node {stray[0].name} is not in the {layout} layout of a {precision} export"
    return None
#: every format by name, the default first
FORMATS = {f.name: f for f in (MATMULNBITS, QDQ)}
DEFAULT_FORMAT = MATMULNBITS
