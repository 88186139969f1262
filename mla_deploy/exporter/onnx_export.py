"""Trace a wrapper with ``torch.onnx.export(dynamo=True)`` and turn the result into a checked ONNX file.

Steps for every graph: export with named dynamic axes (traced at sizes >= 2), map the static cache
write to ONNX ``TensorScatter`` (opset 24), rename derived axes to the names of
:mod:`mla_deploy.io_spec`, set the IR version to the lowest the opset allows (onnx 1.23 writes IR 14,
which ONNX Runtime 1.31 cannot read), then ``onnx.checker`` with ``full_check`` and strict shape
inference. Large weights go to a side file ``<graph>.onnx.data``.
"""

from __future__ import annotations

import contextlib
import io
import math
import logging
import warnings
from pathlib import Path
from typing import Sequence

import onnx
import torch

from ..cache_layout import CacheLayout, get_layout
from ..config import MLAConfig
from ..errors import ConfigError, ExportError
from ..expert_forms import BRANCHES, CPU_LAYOUT
from ..io_spec import BATCH, CAPACITY, LOGITS, PAST, SEQ, TOTAL, TensorSpec

_TOTAL_ALIASES = ("sequence_length + past_sequence_length", "past_sequence_length + sequence_length")


def _tensor_scatter_onnx(past, update, write_indices):
    import onnxscript

    op = onnxscript.values.Opset("", 24)
    return op.TensorScatter(past, update, write_indices, axis=-2, mode="linear")


def cached_dynamic_shapes(layout: CacheLayout | str, head_axes: Sequence[dict[int, str]], layers: int,
                          steps: int | None = None) -> tuple:
    """``torch.export`` dynamic shapes of a module called as ``(*head, control, *caches)``: the head tensors, then
    the layout's control input and ``layers`` caches (the inputs of :meth:`CacheLayout.io
    <mla_deploy.cache_layout.CacheLayout.io>`, in the same order).

    Args:
        layout: the cache layout (or its mode name).
        head_axes: per head input, its dynamic axes by name, ``{axis: BATCH | SEQ | LOGITS}`` (e.g. ``{0: BATCH, 1: SEQ}``
            for ``input_ids [batch_size, sequence_length]``, ``{0: BATCH}`` for ``hidden_states [batch_size, 1, D]``).
        layers: the number of caches.
        steps: the new rows per step when no head input has a ``sequence_length`` axis (e.g. 1 for a graph of
            ``hidden_states [batch_size, 1, D]``); None when the heads' sequence axis is dynamic.
    Returns:
        ``(*head dims, control dims, (cache dims, ...))``; every batch axis is one ``Dim``.
    Raises:
        ConfigError: a head axis named other than ``batch_size``, ``sequence_length`` or ``logits_length``.
    """
    from torch.export import Dim

    dims = {BATCH: Dim(BATCH, min=1, max=4096), SEQ: Dim(SEQ, min=1, max=1 << 20),
            LOGITS: Dim(LOGITS, min=1, max=1 << 20)}
    unknown = sorted({name for axes in head_axes for name in axes.values()} - set(dims))
    if unknown:
        raise ConfigError(f"head inputs can have only {', '.join(dims)} as dynamic axes, not {', '.join(unknown)}")
    head = tuple({axis: dims[name] for axis, name in axes.items()} for axes in head_axes)
    control, caches = get_layout(layout).dynamic_shapes(layers, dims[BATCH], steps)
    return (*head, control, caches)


def decoder_dynamic_shapes(layout: CacheLayout | str, layers: int) -> tuple:
    """``dynamic_shapes`` for :class:`~mla_deploy.exporter.graphs.CausalLMGraph`: ``input_ids`` and ``position_ids``
    ``[batch_size, sequence_length]``, ``logits_index [batch_size, logits_length]``, then the layout's control
    input and ``layers`` caches."""
    return cached_dynamic_shapes(layout, ({0: BATCH, 1: SEQ}, {0: BATCH, 1: SEQ}, {0: BATCH, 1: LOGITS}), layers)


def trace_graph(module: torch.nn.Module, args: tuple, inputs: list[TensorSpec], outputs: list[TensorSpec],
                dynamic_shapes, opset: int, label: str, experts: str = BRANCHES, fused_layout: str = CPU_LAYOUT):
    """Export ``module`` called on ``args`` with ``torch.onnx.export(dynamo=True)`` and optimise it; its routed
    experts in the graph form ``experts`` (:mod:`mla_deploy.expert_forms`, :mod:`.moe_onnx`), the fused form in
    ``fused_layout``.

    ``module`` may live on the ``meta`` device (``args`` too): its parameters then become *placeholder*
    initializers, with a name, dtype and shape but no data, which the optimiser leaves alone (no constant
    folding reads them). Bind them with :func:`bind_initializers` before saving.

    Returns:
        ``(model, placeholders)``: the ``onnx_ir.Model`` and ``{initializer name: ir.Value}`` of the placeholders.
    Raises:
        ExportError: torch.export or the ONNX translation failed.
    """
    from .decode_plugin import translation_table
    from .moe_onnx import translation_table as moe_translation_table

    table = {torch.ops.mla_deploy.tensor_scatter.default: _tensor_scatter_onnx, **translation_table(),
             **moe_translation_table(experts, fused_layout)}
    log = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(log), _quiet_torch_logs():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                module, args, dynamo=True, dynamic_shapes=dynamic_shapes, opset_version=opset,
                input_names=[t.name for t in inputs], output_names=[t.name for t in outputs],
                custom_translation_table=table, optimize=False, verbose=False)
            model = program.model
            placeholders = {}
            for name, value in model.graph.initializers.items():
                data = getattr(value.const_value, "raw", None)
                if isinstance(data, torch.Tensor) and data.is_meta:
                    value.const_value = None  # shape and dtype stay on the value
                    placeholders[name] = value
            _optimize(model)
    except OSError:  # a full disk, a file-size limit: the OS's own words (the CLI names the file and the cause)
        raise
    except Exception as exc:  # torch raises many types here; the cause is in the first line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"torch.onnx.export failed for {label}: {first}") from exc
    return model, {name: v for name, v in placeholders.items() if name in model.graph.initializers}


def _optimize(model) -> None:
    """onnxscript's ``optimize_ir`` without its pattern rewriter: constant folding (the shape arithmetic, twice),
    dead code removal, constants lifted to initializers, duplicate initializers and common subexpressions merged.

    The rewriter's rules (no-op Cast/Reshape/Slice collapsing) are what ONNX Runtime and TensorRT do at load
    anyway, and its matching grows quadratically with the graph: 10.6 s for the 6-layer DeepSeek-V2-Lite graph
    (6,041 nodes), minutes for the full 27 layers."""
    import onnx_ir.passes.common as common
    import onnxscript.optimizer as optimizer

    common.InlinePass()(model)
    for _ in range(2):
        optimizer.fold_constants_ir(model, onnx_shape_inference=True)
        common.RemoveUnusedNodesPass()(model)
    for step in (common.RemoveUnusedFunctionsPass(), common.RemoveUnusedOpsetsPass(),
                 common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
                 common.LiftSubgraphInitializersToMainGraphPass(), common.DeduplicateInitializersPass(),
                 common.CommonSubexpressionEliminationPass(), common.OutputFixPass(), common.NameFixPass()):
        step(model)


def fold_weight_views(model, placeholders: dict) -> dict[str, tuple[str, tuple]]:
    """Fold views of placeholder weights into placeholders of their own, so that each weight is stored the way
    the graph consumes it and no runtime re-lays it out or copies it:

    * ``Transpose(W)`` (the exporter writes ``x @ W.T`` as ``MatMul(x, Transpose(W))``): ``W`` stored transposed;
    * ``Gather(W, i)`` with a constant scalar ``i`` on axis 0 (one expert of a stacked ``[E, ...]`` tensor): the
      slice stored as its own tensor;
    * ``Reshape(W, shape)`` with a constant ``shape`` of known sizes (the fused experts' interleaved gate and up
      rows are ``Reshape -> Transpose -> Reshape``): ``W`` stored in that shape.

    A placeholder is folded when every node using it is such a view; views of views fold in turn.

    Returns:
        ``{new name: (name it was made from, op)}`` with ``op`` ``("perm", perm)`` or ``("index", i)``;
        ``placeholders`` is updated in place (folded-away names removed, new ones added).
    """
    import onnx_ir as ir

    derived: dict[str, tuple[str, tuple]] = {}
    pending = list(placeholders)
    while pending:
        name = pending.pop()
        value = placeholders.get(name)
        if value is None:
            continue
        users = [use.node for use in value.uses()]
        views = [_weight_view(node, value) for node in users]
        if not users or any(v is None for v in views):
            continue
        for node, op in zip(users, views):
            new_name, shape = _view_of(name, value, op)
            new = placeholders.get(new_name)
            if new is None:
                new = ir.Value(name=new_name, shape=ir.Shape(shape), type=value.type)
                model.graph.initializers.add(new)  # no data yet: register_initializer would refuse it
                placeholders[new_name] = new
                derived[new_name] = (name, op)
                pending.append(new_name)
            node.outputs[0].replace_all_uses_with(new)
            model.graph.remove(node, safe=True)
        del model.graph.initializers[name]
        del placeholders[name]
    for name, value in list(model.graph.initializers.items()):  # the folded Gathers' index constants
        if name not in placeholders and not value.uses() and not value.is_graph_input() and not value.is_graph_output():
            del model.graph.initializers[name]
    return derived


def _view_of(name: str, value, op: tuple) -> tuple[str, list]:
    """The name and shape of the view ``op`` of the weight ``name`` (its ``value``): ``W.T``, ``W.perm021``,
    ``W.3`` (one expert), ``W.shape8x2x32x64``."""
    if op[0] == "perm":
        return (f"{name}.T" if op[1] == (1, 0) else f"{name}.perm{''.join(map(str, op[1]))}",
                [value.shape[p] for p in op[1]])
    if op[0] == "shape":
        return f"{name}.shape{'x'.join(map(str, op[1]))}", list(op[1])
    return f"{name}.{op[1]}", list(value.shape)[1:]


def _weight_view(node, value) -> tuple | None:
    """``("perm", p)``, ``("index", i)`` or ``("shape", s)`` when ``node`` is a foldable view of the weight ``value``,
    else None."""
    if node.domain not in ("", "ai.onnx") or node.inputs[0] is not value:
        return None
    if node.op_type == "Transpose":
        rank = len(value.shape)
        attr = node.attributes.get("perm")
        return ("perm", tuple(attr.value) if attr is not None else tuple(range(rank - 1, -1, -1)))
    if node.op_type == "Gather":
        axis = node.attributes.get("axis")
        index = node.inputs[1].const_value if len(node.inputs) > 1 and node.inputs[1] is not None else None
        if (axis is None or axis.value == 0) and index is not None and index.shape.dims == ():
            return ("index", int(index.numpy()))
    if node.op_type == "Reshape" and node.inputs[1] is not None and node.inputs[1].const_value is not None:
        shape = tuple(int(d) for d in node.inputs[1].const_value.numpy())
        known = [int(d) for d in value.shape]
        if all(d > 0 for d in shape) and math.prod(shape) == math.prod(known):  # no 0 (copy) nor -1 (infer)
            return ("shape", shape)
    return None


def bind_initializers(placeholders: dict, tensors: dict) -> None:
    """Give every placeholder its data: ``tensors[name]`` is an ``onnx_ir`` tensor (in memory or external)."""
    missing = sorted(set(placeholders) - set(tensors))
    if missing:
        raise ExportError(f"no data for the graph initializer(s) {', '.join(missing[:4])}")
    for name, value in placeholders.items():
        value.const_value = tensors[name]


def save_graph(model, path: Path, inputs: list[TensorSpec], outputs: list[TensorSpec]) -> onnx.ModelProto:
    """Finish an exported graph and write it to ``path``: our axis names, the I/O contract checked, the lowest IR
    version the opset allows, then ``onnx.checker`` with ``full_check``. Initializers stay where they are bound
    (inline, or in an external file already written). Returns the shape-inferred model (no weights)."""
    import onnx_ir as ir

    proto = ir.to_proto(model)
    _rename_dims(proto, inputs + outputs)
    _check_io(proto, inputs, outputs, path.name)
    proto.ir_version = onnx.helper.find_min_ir_version_for(list(proto.opset_import), True)
    proto.producer_name = "mla-deploy"
    try:
        onnx.save_model(proto, str(path))
    except OSError as exc:
        raise ExportError(f"cannot write {path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # protobuf refuses a graph over 2 GB: the weights must be external
        raise ExportError(f"{path.name} cannot be written inline ({exc}); its weights must go to weights.data") from None
    return check_onnx_file(path)


def trace_to_onnx(module: torch.nn.Module, args: tuple, path: Path, inputs: list[TensorSpec],
                  outputs: list[TensorSpec], dynamic_shapes, opset: int, experts: str = BRANCHES,
                  fused_layout: str = CPU_LAYOUT) -> None:
    """Export a module with its weights in memory to one self-contained file ``path`` (weights inline):
    :func:`trace_graph` then :func:`save_graph`, the routed experts in the form ``experts`` (the fused form in
    ``fused_layout``). For small graphs (comparison blocks, the bench's unit).

    Raises:
        ExportError: torch.export or the ONNX translation failed, or the result fails the checks.
    """
    model, placeholders = trace_graph(module, args, inputs, outputs, dynamic_shapes, opset, path.name, experts,
                                      fused_layout)
    if placeholders:
        raise ExportError(f"{path.name}: the module has weights on the meta device ({next(iter(placeholders))})")
    save_graph(model, path, inputs, outputs)


@contextlib.contextmanager
def _quiet_torch_logs():
    """The exporter's and optimiser's progress and notes (e.g. onnx_ir's "Skipped deduplication of initializer
    ... as it has no constant value", expected for the placeholders) stay off the user's terminal; errors pass."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "onnx_ir", "onnxscript")]
    old = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, old):
            logger.setLevel(level)


def _rename_dims(model: onnx.ModelProto, specs: list[TensorSpec]) -> None:
    """Give the axes the exporter named itself (``s73``, ``sequence_length + past_sequence_length``) our names."""
    wanted = {t.name: t.shape for t in specs}
    renames: dict[str, str] = {alias: TOTAL for alias in _TOTAL_ALIASES}
    for value in list(model.graph.input) + list(model.graph.output):
        shape = wanted.get(value.name)
        if shape is None:
            continue
        for dim, target in zip(value.type.tensor_type.shape.dim, shape):
            if isinstance(target, str) and dim.dim_param and dim.dim_param != target:
                renames.setdefault(dim.dim_param, target)
    for value in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in renames:
                dim.dim_param = renames[dim.dim_param]


def _check_io(model: onnx.ModelProto, inputs: list[TensorSpec], outputs: list[TensorSpec], label: str) -> None:
    """The graph's I/O must be exactly the contract: names, element types, ranks, fixed sizes and axis names."""
    for kind, actual, specs in (("input", model.graph.input, inputs), ("output", model.graph.output, outputs)):
        names = [v.name for v in actual]
        if names != [t.name for t in specs]:
            raise ExportError(f"{label}: {kind}s are {names}, expected {[t.name for t in specs]}")
        for value, spec in zip(actual, specs):
            elem = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
            np_name = "bfloat16" if value.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16 else elem.name
            if np_name != spec.dtype:
                raise ExportError(f"{label}: {kind} {spec.name} has dtype {np_name}, expected {spec.dtype}")
            dims = [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
            if len(dims) != len(spec.shape) or any(a != b for a, b in zip(dims, spec.shape)):
                raise ExportError(f"{label}: {kind} {spec.name} has shape {dims}, expected {list(spec.shape)}")


def check_onnx_file(path: Path) -> onnx.ModelProto:
    """``onnx.checker`` with ``full_check`` and strict shape inference; returns the inferred model (no weights).

    Raises:
        ExportError: the file fails a check.
    """
    try:
        onnx.checker.check_model(str(path), full_check=True)
        model = onnx.load(str(path), load_external_data=False)
        return onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise ExportError(f"{path.name} fails the ONNX checks: {str(exc).splitlines()[0]}") from exc


_PAST_AXES = (PAST, TOTAL, CAPACITY)


def per_head_kv_tensors(model: onnx.ModelProto, config: MLAConfig) -> list[str]:
    """Tensors that look like per-head keys or values over the cached sequence.

    A tensor counts when its shape (after shape inference) has the head count on a non-last axis, an axis
    named after the cached length (past, total or capacity), and a last axis of a per-head key or value
    width (``qk_nope_head_dim``, ``qk_head_dim``, ``v_head_dim``). The absorbed decode graph has none.

    Returns: ``["name [dims]", ...]``.
    """
    c = config
    widths = {c.qk_nope_head_dim, c.qk_head_dim, c.v_head_dim}
    found = []
    for value in list(model.graph.value_info) + list(model.graph.output):
        dims = [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
        if len(dims) < 3:
            continue
        has_heads = c.num_attention_heads in dims[:-1]
        over_cache = any(isinstance(d, str) and any(a in d for a in _PAST_AXES) for d in dims)
        if has_heads and over_cache and dims[-1] in widths:
            found.append(f"{value.name} {dims}")
    return found
