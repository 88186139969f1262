"""Quantized weights in the graph, in one of two formats (``[export] quant_format``):

* ``qdq``, standard ONNX (opset >= 21): ``MatMul(x, W)`` becomes ``MatMul(x, DequantizeLinear(W.q, W.scale))``,
  ``W.q [K, N]`` ``INT8`` or ``INT4`` (two per byte), ``W.scale [ceil(K/B), N]`` in the graph's float type,
  ``axis=0, block_size=B``, symmetric (no zero point). TensorRT's ONNX parser reads a ``DequantizeLinear`` of a
  constant weight feeding a ``MatMul`` as weight-only quantization. ONNX Runtime's CPU provider fuses each pair
  into one ``MatMulNBits`` when the session loads (its optimized graph holds no ``DequantizeLinear``), but the
  fusion re-lays every weight out in memory before the kernels pack it: 2.2-2.8x the weights' bytes at load,
  against 1.4x, and 3x the load time, measured here on 2.2 GB of int4 weights;
* ``matmulnbits``, ONNX Runtime's own (``com.microsoft``): ``MatMul(x, W)`` becomes ``MatMulNBits(x, W.q, W.scale)``
  with ``W.q [N, ceil(K/B), B*bits/8]`` ``uint8`` (each value stored plus ``2^(bits-1)``, two int4 per byte, low
  nibble first: the kernel's default zero point), ``W.scale [N * ceil(K/B)]`` and ``accuracy_level = 4`` (int8
  activations, ONNX Runtime's fast CPU path; :class:`~mla_deploy.engines.ort_engine.OrtEngine` rewrites it to 1,
  float32, for exact comparisons). The same kernel as the fused ``qdq``, without the re-layout. TensorRT cannot
  read it.

Which weights: every 2-D weight whose only use is the second input of a ``MatMul`` (the attention projections
``q_proj``/``q_a_proj``/``q_b_proj``, ``kv_a_proj_with_mqa``, ``o_proj``, the dense and shared MLPs, each routed
expert and ``lm_head``), decided per checkpoint tensor: a tensor is quantized only where every graph uses it that
way, so the artifact computes with one set of weights. What stays in the float type, and why:

* ``embed_tokens``: a ``Gather`` reads one row per token, so its size costs memory, not decode time;
* the norms and biases: vectors, a rounding error in a norm's gain scales a whole hidden state;
* ``kv_b_proj`` in the absorbed forms: its per-head halves ``w_uk``/``w_uv`` are batched 3-D products against
  the latent, 2-4% of a layer's weights, which ``MatMulNBits`` does not cover;
* the MoE router (``mlp.gate``): expert choice is a discontinuous function of its logits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import ExportError
from ..quant import WeightQuantization
from .weights import WeightSpec

#: the MoE router's weight: kept in the float type (expert choice is discontinuous in its logits)
ROUTER_SUFFIX = "mlp.gate.weight"
MIN_OPSET = 21


#: ``[export] quant_format`` values
QUANT_FORMATS = ("matmulnbits", "qdq")
#: what the manifest says carries the quantized weights, per format
QUANT_OPS = {"qdq": "DequantizeLinear(axis=0, block_size) -> MatMul",
             "matmulnbits": "com.microsoft MatMulNBits(accuracy_level=4)"}
#: MatMulNBits' accuracy_level: 4 computes with int8 activations (fast), 1 in float32 (exact)
FAST_ACCURACY, EXACT_ACCURACY = 4, 1


def quantize_graph_weights(graphs: list[tuple[Any, dict, dict[str, WeightSpec]]],
                           scheme: WeightQuantization, quant_format: str = "qdq") -> list[str]:
    """Quantize every quantizable weight of ``graphs`` in ``quant_format`` (see the module docstring).

    Args:
        graphs: ``(onnx_ir model, {initializer: placeholder value}, {initializer: WeightSpec})`` per graph, as
            traced (:func:`~mla_deploy.exporter.export.trace_meta_graph`); updated in place: each quantized
            ``W`` is replaced by the placeholders ``W.q`` and ``W.scale``, whose specs carry ``quant``.
        scheme: the quantization.
        quant_format: ``qdq`` or ``matmulnbits``.
    Returns:
        the checkpoint keys quantized, sorted.
    Raises:
        ExportError: a graph's opset is older than 21 (blocked ``DequantizeLinear``).
    """
    verdict: dict[str, bool] = {}
    for model, placeholders, specs in graphs:
        opset = model.opset_imports.get("", 0)
        if opset < MIN_OPSET:
            raise ExportError(f"quantized weights need opset >= {MIN_OPSET} (blocked DequantizeLinear); the recipe "
                              f"exports opset {opset}")
        for name, value in placeholders.items():
            key = specs[name].key
            verdict[key] = verdict.get(key, True) and _quantizable(value, specs[name])
    keys = sorted(k for k, ok in verdict.items() if ok)
    chosen = set(keys)
    insert = _insert_dequantize if quant_format == "qdq" else _insert_matmulnbits
    for model, placeholders, specs in graphs:
        for name in [n for n in placeholders if specs[n].key in chosen]:
            insert(model, placeholders, specs, name, scheme)
        if quant_format == "matmulnbits" and chosen:
            model.opset_imports["com.microsoft"] = 1
    return keys


def _quantizable(value, spec: WeightSpec) -> bool:
    """A 2-D weight used only as ``MatMul``'s second input, not the router's."""
    uses = list(value.uses())
    return (len(value.shape) == 2 and not spec.key.endswith(ROUTER_SUFFIX) and bool(uses)
            and all(u.node.op_type == "MatMul" and u.node.domain in ("", "ai.onnx") and u.idx == 1 for u in uses))


def _insert_dequantize(model, placeholders: dict, specs: dict, name: str, scheme: WeightQuantization) -> None:
    import onnx_ir as ir

    value, spec = placeholders.pop(name), specs.pop(name)
    k, n = (int(d) for d in value.shape)
    q = ir.Value(name=f"{name}.q", shape=ir.Shape([k, n]),
                 type=ir.TensorType(ir.DataType.INT4 if scheme.bits == 4 else ir.DataType.INT8))
    scale = ir.Value(name=f"{name}.scale", shape=ir.Shape([scheme.blocks(k), n]), type=value.type)
    _add_placeholders(model, placeholders, specs, spec, scheme, (q, "q"), (scale, "scale"))
    node = ir.Node("", "DequantizeLinear", inputs=[q, scale], num_outputs=1,
                   attributes=[ir.AttrInt64("axis", 0), ir.AttrInt64("block_size", scheme.block_size)])
    out = node.outputs[0]
    out.name, out.shape, out.type = f"{name}.dequantized", ir.Shape([k, n]), value.type
    value.replace_all_uses_with(out)
    model.graph.insert_before(model.graph[0], node)
    del model.graph.initializers[name]


def _insert_matmulnbits(model, placeholders: dict, specs: dict, name: str, scheme: WeightQuantization) -> None:
    import onnx_ir as ir

    value, spec = placeholders.pop(name), specs.pop(name)
    k, n = (int(d) for d in value.shape)
    blocks = scheme.blocks(k)
    q = ir.Value(name=f"{name}.nbits", shape=ir.Shape([n, blocks, scheme.block_size * scheme.bits // 8]),
                 type=ir.TensorType(ir.DataType.UINT8))
    scale = ir.Value(name=f"{name}.scale", shape=ir.Shape([n * blocks]), type=value.type)
    _add_placeholders(model, placeholders, specs, spec, scheme, (q, "nbits"), (scale, "nbits_scale"))
    for use in list(value.uses()):
        matmul = use.node
        node = ir.Node("com.microsoft", "MatMulNBits", inputs=[matmul.inputs[0], q, scale], num_outputs=1,
                       attributes=[ir.AttrInt64("K", k), ir.AttrInt64("N", n), ir.AttrInt64("bits", scheme.bits),
                                   ir.AttrInt64("block_size", scheme.block_size),
                                   ir.AttrInt64("accuracy_level", FAST_ACCURACY)], name=matmul.name)
        out, old = node.outputs[0], matmul.outputs[0]
        out.shape, out.type, out_name = old.shape, old.type, old.name
        model.graph.insert_before(matmul, node)
        old.replace_all_uses_with(out, replace_graph_outputs=True)
        model.graph.remove(matmul, safe=True)
        out.name = out_name
    del model.graph.initializers[name]


def _add_placeholders(model, placeholders: dict, specs: dict, spec: WeightSpec, scheme: WeightQuantization,
                      *parts) -> None:
    for new, part in parts:
        model.graph.initializers.add(new)  # placeholders: their data is bound after the weights are written
        placeholders[new.name] = new
        specs[new.name] = dataclasses.replace(spec, quant=(scheme.weights, scheme.block_size, part))
