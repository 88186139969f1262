"""Quantized weights in the graph: ``MatMul(x, W)`` becomes ``MatMul(x, DequantizeLinear(W.q, W.scale))``.

Standard ONNX (opset >= 21): ``W.q [K, N]`` is ``INT8`` or ``INT4`` (two per byte), ``W.scale [ceil(K/B), N]``
is in the graph's float type, and ``DequantizeLinear(axis=0, block_size=B)`` gives one scale per block of ``B``
input features, symmetric (no zero point). Both runtimes read it as weight-only quantization:

* ONNX Runtime's CPU provider fuses each ``DequantizeLinear -> MatMul`` into one ``com.microsoft`` ``MatMulNBits``
  when the session loads (seen in the optimized graph, and in the profile as ``MatMulNBits`` nodes only), which
  reads the packed integers and never materializes the float weight; its session option
  ``session.qdq_matmulnbits_accuracy_level`` picks the arithmetic (:func:`~mla_deploy.engines.ort_engine.session_options`);
* TensorRT's ONNX parser reads a ``DequantizeLinear`` of a constant weight feeding a ``MatMul`` as weight-only
  quantization.

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


def quantize_graph_weights(graphs: list[tuple[Any, dict, dict[str, WeightSpec]]],
                           scheme: WeightQuantization) -> list[str]:
    """Put ``DequantizeLinear`` in front of every quantizable weight of ``graphs``.

    Args:
        graphs: ``(onnx_ir model, {initializer: placeholder value}, {initializer: WeightSpec})`` per graph, as
            traced (:func:`~mla_deploy.exporter.export.trace_meta_graph`); updated in place: each quantized
            ``W`` is replaced by the placeholders ``W.q`` and ``W.scale``, whose specs carry ``quant``.
        scheme: the quantization.
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
    for model, placeholders, specs in graphs:
        for name in [n for n in placeholders if specs[n].key in chosen]:
            _insert_dequantize(model, placeholders, specs, name, scheme)
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
    for new, part in ((q, "q"), (scale, "scale")):
        model.graph.initializers.add(new)  # placeholders: their data is bound after the weights are written
        placeholders[new.name] = new
        specs[new.name] = dataclasses.replace(spec, quant=(scheme.weights, scheme.block_size, part))
    node = ir.Node("", "DequantizeLinear", inputs=[q, scale], num_outputs=1,
                   attributes=[ir.AttrInt64("axis", 0), ir.AttrInt64("block_size", scheme.block_size)])
    out = node.outputs[0]
    out.name, out.shape, out.type = f"{name}.dequantized", ir.Shape([k, n]), value.type
    value.replace_all_uses_with(out)
    model.graph.insert_before(model.graph[0], node)
    del model.graph.initializers[name]
