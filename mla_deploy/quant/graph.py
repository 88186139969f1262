"""Quantized weights in the traced graphs: which weights, and what the graphs of an artifact hold.

Which weights: every 2-D weight whose only use is the second input of a ``MatMul`` (the attention projections
``q_proj``/``q_a_proj``/``q_b_proj``, ``kv_a_proj_with_mqa``, ``o_proj``, the dense and shared MLPs, each routed
expert and ``lm_head``), decided per checkpoint tensor: a tensor is quantized only where every graph uses it that
way, so the artifact computes with one set of weights. What stays in the float type, and why:

* ``embed_tokens``: a ``Gather`` reads one row per token, so its size costs memory, not decode time;
* the norms and biases: vectors, a rounding error in a norm's gain scales a whole hidden state;
* ``kv_b_proj`` where a graph multiplies with it whole (a ``CC`` prefill) and another per head: the two uses cut
  its blocks along different axes. Where every graph takes its absorbed halves (``w_uk [H, dn, r]``, ``w_uv``
  multiplied as ``[H, r, dv]``: the batched products ``MatMul(A [H, M, K], W [H, K, N])`` of the absorbed
  attention, the default for prefill and decode), they are quantized per head in blocks of their own input features
  (:data:`~.formats.HEADWISE`) by the formats that take them (``matmulnbits``: 227 MB of float32 per full-size
  DeepSeek-V2-Lite step otherwise); ``qdq`` keeps them in the float type (TensorRT's weight-only quantization is
  written for 2-D weights);
* the MoE router (``mlp.gate``): expert choice is a discontinuous function of its logits;
* DeepSeek Sparse Attention's indexer (``self_attn.indexer.*``), for the same reason: which tokens a query attends to
  is a top-k of its scores.

Each weight is then written in its format (:meth:`~mla_deploy.quant.formats.WeightFormat.insert`); the stacked
expert weights of the fused experts' ``MoE`` node (:mod:`mla_deploy.expert_forms`) in :data:`~.formats.QMOE` (or,
in the fused form's ``cuda`` layout, :data:`~.formats.QMOE_CUDA`), which turns the node into ``QMoE``; the
per-head halves in :data:`~.formats.HEADWISE`.
:func:`observe_graphs` reads the other way: what an artifact's graph files hold, so the artifact check can compare
it with the manifest's record.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable

from ..errors import ExportError
from .formats import FORMATS, HEADWISE, MS_DOMAIN, ONNX_DOMAINS, QMOE, QMOE_LAYOUTS, WeightFormat
from .scheme import WeightQuantization

#: the MoE router's weight (DeepSeek's ``mlp.gate``, LongCat-Flash's ``mlp.router.classifier``): kept in the float
#: type (expert choice is discontinuous in its logits)
ROUTER_SUFFIX = ("mlp.gate.weight", "mlp.router.classifier.weight")
#: the sparse-attention indexer's weights: kept in the float type (its top-k token choice is discontinuous too)
INDEXER_PART = ".self_attn.indexer."
#: the oldest opset with blocked ``DequantizeLinear``
MIN_OPSET = 21
#: the absorbed attention's per-head halves of ``kv_b_proj`` (:attr:`~mla_deploy.exporter.weights.WeightSpec.part`)
HEAD_PARTS = ("w_uk", "w_uv")


@dataclass(frozen=True)
class WeightPart:
    """What a graph initializer is of its weight (:attr:`mla_deploy.exporter.weights.WeightSpec.quant`): the
    weight itself (:data:`WHOLE`), or one stored tensor of its quantization.

    Attributes:
        scheme: the quantization; None for the weight itself.
        format: the format laying it out; None for the weight itself.
        index: which of the format's :attr:`~mla_deploy.quant.formats.WeightFormat.parts` (0: integers, 1: scales).
    """

    scheme: WeightQuantization | None = None
    format: WeightFormat | None = None
    index: int = 0

    @property
    def quantized(self) -> bool:
        return self.format is not None

    def make(self, view: Any, compute, memo: dict, dtype) -> "Any":
        """This initializer's tensor.

        Args:
            view: what identifies the weight's view (its spec without the part): the parts of one view are adjacent,
                so it is quantized and laid out once (kept in ``memo``).
            compute: ``() -> torch.Tensor``, the view in the source's dtype (``[K, N]``; a fused ``MoE``'s stacked
                ``[E, N, K]``).
            memo: one view's layout, kept between calls.
            dtype: the ``torch.dtype`` of the initializer (the graph's float type; integers: their own type, int8
                for ``INT4``, packed when written).
        """
        if self.format is None:
            return compute().to(dtype).contiguous()
        if memo.get("view") != view:
            memo["view"], memo["parts"] = view, self.format.lay_out(compute(), self.scheme)
        return memo["parts"][self.index].to(dtype)

    def stacked(self, view: Any, count: int, expert, memo: dict, dtype):
        """This initializer's tensor of a stacked experts' view, one expert at a time: yields ``count`` tensors
        whose stack is :meth:`make`'s (the whole view is never held: a V3 layer's is 15 GB in bf16).

        Args:
            view, memo, dtype: as :meth:`make`'s (the other parts of one expert's layout wait in ``memo`` for their
                own initializer: the scales, a fraction of the integers, when the integers come first).
            count: the experts.
            expert: ``(e) -> torch.Tensor``, expert ``e``'s slice of the view (``[N, K]``).
        """
        if self.format is None:
            for e in range(count):
                yield expert(e).to(dtype).contiguous()
            return
        assert self.format.per_expert, f"{self.format!r} lays out no stacked experts' view"  # only QMoE takes one
        kept = memo.get("stacked") if memo.get("stacked_view") == view else None
        if kept is not None and kept[self.index] is not None:
            parts, kept[self.index] = kept[self.index], None
            yield from (part.to(dtype) for part in parts)
            return
        memo["stacked_view"] = view
        memo["stacked"] = kept = [[] if i != self.index else None for i in range(len(self.format.parts))]
        for e in range(count):
            parts = self.format.lay_out_expert(expert(e), self.scheme)
            for i, part in enumerate(parts):
                if i != self.index:
                    kept[i].append(part)
            yield parts[self.index].to(dtype)


#: the weight itself, in the graph's float type
WHOLE = WeightPart()


@dataclass(frozen=True)
class QuantizedKeys:
    """The checkpoint tensors an export quantized.

    Attributes:
        keys: those held in the format's own layout (and the fused experts' ``QMoE``), quantized along their input
            features (the checkpoint's last axis), sorted.
        per_head: the ``kv_b_proj`` tensors held as their absorbed halves in :data:`~.formats.HEADWISE`, each half
            in blocks of its product's input features (``w_uk``'s: ``qk_nope_head_dim``), sorted.
    """

    keys: tuple[str, ...] = ()
    per_head: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.keys) + len(self.per_head)


def quantize_graph_weights(graphs: list[tuple[Any, dict, dict]], scheme: WeightQuantization,
                           quant_format: WeightFormat, per_head: bool = True,
                           qmoe: WeightFormat = QMOE) -> QuantizedKeys:
    """Quantize every quantizable weight of ``graphs`` (see the module docstring) in ``quant_format``.

    Args:
        graphs: ``(onnx_ir model, {initializer: placeholder value}, {initializer: WeightSpec})`` per graph, as
            traced (:func:`~mla_deploy.exporter.export.trace_meta_graph`); updated in place: each quantized
            ``W`` is replaced by the format's placeholders, whose specs carry ``quant`` (a :class:`WeightPart`).
        scheme: the quantization.
        quant_format: the format.
        per_head: the absorbed halves of ``kv_b_proj`` too, where ``quant_format`` takes them (False: kept float,
            for a consumer that would dequantize them at every step).
        qmoe: the fused experts' format, that of the graphs' layout (:data:`~.formats.QMOE_LAYOUTS`).
    Returns:
        the checkpoint keys quantized. A key is quantized only where every use of it, in every graph, is held in
        one format: the artifact computes with one set of weights.
    Raises:
        ExportError: a graph's opset is older than 21 (blocked ``DequantizeLinear``).
    """
    uses: dict[str, set] = {}
    for model, placeholders, specs in graphs:
        opset = model.opset_imports.get("", 0)
        if opset < MIN_OPSET:
            raise ExportError(f"quantized weights need opset >= {MIN_OPSET} (blocked DequantizeLinear); the recipe "
                              f"exports opset {opset}")
        for name, value in placeholders.items():
            uses.setdefault(specs[name].key, set()).add(_layout(value, specs[name], quant_format, scheme, per_head,
                                                                qmoe))
    chosen = {key: next(iter(kinds)) for key, kinds in uses.items() if len(kinds) == 1 and None not in kinds}
    for model, placeholders, specs in graphs:
        for name in [n for n in placeholders if specs[n].key in chosen]:
            value, spec = placeholders.pop(name), specs.pop(name)
            fmt = chosen[spec.key]
            for index, new in enumerate(fmt.insert(model, value, scheme)):
                model.graph.initializers.add(new)  # placeholders: their data is bound after the weights are written
                placeholders[new.name] = new
                specs[new.name] = dataclasses.replace(spec, quant=WeightPart(scheme, fmt, index))
            del model.graph.initializers[name]
    return QuantizedKeys(tuple(sorted(k for k, f in chosen.items() if f is not HEADWISE)),
                         tuple(sorted(k for k, f in chosen.items() if f is HEADWISE)))


def _layout(value, spec, quant_format: WeightFormat, scheme: WeightQuantization, per_head: bool,
            qmoe: WeightFormat) -> WeightFormat | None:
    """The format one use of a weight would be held in: ``quant_format`` for a 2-D weight used only as ``MatMul``'s
    second input (not the router's), ``qmoe`` for a fused ``MoE``'s expert weights,
    :data:`~.formats.HEADWISE` for an absorbed half of ``kv_b_proj`` multiplied per head (where ``quant_format``
    takes them and its input features fill whole blocks); None: kept in the float type."""
    uses = list(value.uses())
    matmul = bool(uses) and all(u.node.op_type == "MatMul" and u.node.domain in ONNX_DOMAINS and u.idx == 1
                                for u in uses)
    if spec.key.endswith(ROUTER_SUFFIX) or INDEXER_PART in spec.key:
        return None
    if _moe_weight(value):
        return qmoe
    if matmul and len(value.shape) == 2 and spec.part is None:
        return quant_format
    if (matmul and len(value.shape) == 3 and spec.part in HEAD_PARTS and quant_format.headwise and per_head
            and int(value.shape[1]) % scheme.block_size == 0):
        return HEADWISE
    return None


def _moe_weight(value) -> bool:
    """A stacked ``[E, N, K]`` weight used only as a weight input of ONNX Runtime's float ``MoE`` (the fused experts),
    or of the ``QMoE`` that quantizing its other weight made of it."""
    slots = {"MoE": tuple(QMOE.slots), "QMoE": tuple(QMOE.slots.values())}
    uses = list(value.uses())
    return len(value.shape) == 3 and bool(uses) and all(
        u.node.domain == MS_DOMAIN and u.idx in slots.get(u.node.op_type, ()) for u in uses)


@dataclass(frozen=True)
class GraphQuantization:
    """What an artifact's graphs hold quantized, read from their nodes and initializers (:func:`observe_graphs`).

    Attributes:
        held: ``{(format name, bits, block_size): number of quantized weights}`` (empty: every weight is float).
    """

    held: dict

    def describe(self) -> str:
        """``2 x int8 weights in blocks of 32 (matmulnbits)``, or ``no quantized weights``."""
        return "; ".join(f"{n} x int{bits} weights in blocks of {block} ({name})"
                         for (name, bits, block), n in sorted(self.held.items())) or "no quantized weights"

    def counted_as(self, name: str) -> "GraphQuantization":
        """These counts with the fused experts' ``QMoE`` weights and the per-head weights (held in
        :data:`~.formats.QMOE` and :data:`~.formats.HEADWISE` whatever the format of the others) counted as the
        format ``name``'s."""
        held: dict[tuple, int] = {}
        for (fmt, bits, block), n in self.held.items():
            key = (name if fmt in (*(f.name for f in QMOE_LAYOUTS.values()), HEADWISE.name) else fmt, bits, block)
            held[key] = held.get(key, 0) + n
        return GraphQuantization(held)


def observe_graphs(models: Iterable) -> GraphQuantization:
    """What ONNX ``ModelProto`` s (loaded without their external weights) hold in each format; a weight shared
    by several graphs (prefill and decode) counts once."""
    seen: dict[str, tuple] = {}
    for model in models:
        for fmt in (*FORMATS.values(), *QMOE_LAYOUTS.values(), HEADWISE):
            seen.update({name: (fmt.name, *held) for name, held in fmt.observe(model).items()})
    held: dict[tuple, int] = {}
    for kind in seen.values():
        held[kind] = held.get(kind, 0) + 1
    return GraphQuantization(held)
