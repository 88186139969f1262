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
import logging
import warnings
from pathlib import Path
from typing import Sequence

import onnx
import torch

from ..cache_layout import CacheLayout, get_layout
from ..config import MLAConfig
from ..errors import ConfigError, ExportError
from ..io_spec import BATCH, CAPACITY, PAST, SEQ, TOTAL, TensorSpec

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
        head_axes: per head input, its dynamic axes by name, ``{axis: BATCH | SEQ}`` (e.g. ``{0: BATCH, 1: SEQ}``
            for ``input_ids [batch_size, sequence_length]``, ``{0: BATCH}`` for ``hidden_states [batch_size, 1, D]``).
        layers: the number of caches.
        steps: the new rows per step when no head input has a ``sequence_length`` axis (e.g. 1 for a graph of
            ``hidden_states [batch_size, 1, D]``); None when the heads' sequence axis is dynamic.
    Returns:
        ``(*head dims, control dims, (cache dims, ...))``; every batch axis is one ``Dim``.
    Raises:
        ConfigError: a head axis named other than ``batch_size`` or ``sequence_length``.
    """
    from torch.export import Dim

    dims = {BATCH: Dim(BATCH, min=1, max=4096), SEQ: Dim(SEQ, min=1, max=1 << 20)}
    unknown = sorted({name for axes in head_axes for name in axes.values()} - set(dims))
    if unknown:
        raise ConfigError(f"head inputs can have only {BATCH} and {SEQ} as dynamic axes, not {', '.join(unknown)}")
    head = tuple({axis: dims[name] for axis, name in axes.items()} for axes in head_axes)
    control, caches = get_layout(layout).dynamic_shapes(layers, dims[BATCH], steps)
    return (*head, control, caches)


def decoder_dynamic_shapes(layout: CacheLayout | str, layers: int) -> tuple:
    """``dynamic_shapes`` for :class:`~mla_deploy.exporter.graphs.DecoderGraph`: ``input_ids`` and ``position_ids``
    ``[batch_size, sequence_length]``, then the layout's control input and ``layers`` caches."""
    return cached_dynamic_shapes(layout, ({0: BATCH, 1: SEQ}, {0: BATCH, 1: SEQ}), layers)


def trace_to_onnx(module: torch.nn.Module, args: tuple, path: Path, inputs: list[TensorSpec],
                  outputs: list[TensorSpec], dynamic_shapes, opset: int, external_data: bool) -> None:
    """Export ``module`` called on ``args`` to ``path`` and post-process it (see the module docstring).

    Raises:
        ExportError: torch.export or the ONNX translation failed, or the result fails the checks.
    """
    from .decode_plugin import translation_table

    table = {torch.ops.mla_deploy.tensor_scatter.default: _tensor_scatter_onnx, **translation_table()}
    log = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(log), _quiet_torch_logs():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                module, args, dynamo=True, dynamic_shapes=dynamic_shapes, opset_version=opset,
                input_names=[t.name for t in inputs], output_names=[t.name for t in outputs],
                custom_translation_table=table, optimize=True, verbose=False)
    except Exception as exc:  # torch raises many types here; the cause is in the first line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"torch.onnx.export failed for {path.name}: {first}") from exc
    model = program.model_proto
    _rename_dims(model, inputs + outputs)
    _check_io(model, inputs, outputs, path.name)
    model.ir_version = onnx.helper.find_min_ir_version_for(list(model.opset_import), True)
    model.producer_name = "mla-deploy"
    if external_data:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".data", size_threshold=1024)
    else:
        onnx.save_model(model, str(path))
    check_onnx_file(path)


@contextlib.contextmanager
def _quiet_torch_logs():
    logger = logging.getLogger("torch.onnx")
    old = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(old)


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
