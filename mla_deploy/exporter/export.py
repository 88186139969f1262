"""Export a recipe to an artifact directory: the graph(s), one weights file, ``manifest.json``.

The export never holds the model. Each graph is traced from a model on the ``meta`` device (shapes only);
its initializers are then made one at a time from the weights' source (a checkpoint read tensor by tensor,
a preset's seeded random weights, or a model in memory: :mod:`.weights`) and streamed into one
``weights.data`` that every graph references, so memory stays near the largest tensor whatever the model's
size, and the weights exist once on disk. When the prefill and decode forms are the same (the default,
``A_CC``), prefill and decode are one graph, ``model.onnx``, so a runtime also holds the weights once;
with a ``CC`` prefill there are two graphs over the same ``weights.data``. Small models (weights at most
``[export] external_data_threshold`` bytes) keep their weights inside the graph file(s) instead.

A checkpoint export also copies the checkpoint's tokenizer files into the artifact
(:func:`~mla_deploy.artifact.copy_tokenizer_files`, recorded in the manifest).

The directory is built with :func:`~mla_deploy.artifact.atomic_dir` (under a temporary name beside the
target, swapped into place at the end), so a failed or interrupted export never leaves a half-written
artifact, and temporaries left by a killed export are removed by the next one. Re-exporting into an artifact
directory replaces only the artifact's own files (manifest, graphs, weights); anything else there (``validation/``,
``trt/``, the user's files) is kept. Every weight is checked finite as it is written. The cache layout
(:mod:`mla_deploy.cache_layout`) decides the graphs' I/O, traced shapes and capacity.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from .. import __version__
from ..artifact import GraphEntry, Manifest, WeightsSource, atomic_dir, copy_tokenizer_files, now, sha256_file
from ..artifact.files import remove_stale
from ..artifact.target import check_export_target
from ..errors import ExportError
from ..model import MLAForCausalLM
from ..quant import pack_int4
from ..recipe import Recipe
from .graphs import CausalLMGraph, example_decoder_inputs
from .moe_onnx import all_expert_tensors
from .onnx_export import (bind_initializers, decoder_dynamic_shapes, fold_weight_views, per_head_kv_tensors,
                          save_graph, trace_graph)
from .weights import WEIGHTS_FILE, ModuleTensors, Progress, RandomTensors, TensorSource, WeightsFile, WeightSpec

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
Log = Callable[[str], None]


def fingerprint(recipe: Recipe, weights: WeightsSource) -> str:
    """Identity of the model an artifact holds: its dimensions and where its weights came from (16 hex digits)."""
    identity = {"model": recipe.model.to_dict(), "weights": weights.to_dict(),
                **recipe.export.quantization.fingerprint()}  # a quantized model is another model (float ones: none)
    blob = json.dumps(identity, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def versions() -> dict[str, str]:
    """Versions of what produced an artifact."""
    import onnx

    out = {"mla_deploy": __version__, "torch": torch.__version__, "onnx": onnx.__version__,
           "python": platform.python_version()}
    try:
        import onnxscript

        out["onnxscript"] = onnxscript.__version__
    except ImportError:  # pragma: no cover - a dependency
        pass
    return out


def export_recipe(recipe: Recipe, out: str | Path, model: MLAForCausalLM | None = None,
                  weights: WeightsSource | Mapping[str, Any] | None = None, overwrite: bool = False,
                  source: TensorSource | None = None, progress: Progress | None = None,
                  log: Log | None = None) -> Manifest:
    """Export ``recipe``'s model to ``out`` and return its manifest.

    Args:
        recipe: model and ``[export]`` settings.
        out: the artifact directory to create (or replace, when it holds the same model).
        model: an original-form model in memory (fp32) to export; None: ``source``, or the preset's random
            weights from ``[export]``'s seed and init_std (rebuilt from them for validation, not stored twice).
        weights: where the weights came from (recorded in the manifest), e.g. ``WeightsSource(kind="hf",
            path=...)`` or the same as a dict; None: ``in-memory`` for ``model``/``source``.
        overwrite: replace ``out`` even when it holds a different model.
        source: the original-form state dict served one tensor at a time (e.g.
            :class:`~mla_deploy.checkpoint.CheckpointTensors`); closed when the export ends.
        progress: called as ``progress(bytes_written, total_bytes, seconds)`` while the weights are written.
        log: called with one line per step (tracing each graph, saving it, temporaries of a killed export removed).
    Returns:
        the :class:`~mla_deploy.artifact.Manifest` written to ``out/manifest.json``.
    Raises:
        ExportError: ``out`` holds something else or cannot be written (no space, no permission), a weight is
            not finite, or the export or a check fails.
    """
    out = Path(out)
    settings = recipe.export
    if model is not None:
        source = ModuleTensors(model.eval())
    if source is None:
        source = RandomTensors(recipe.model, settings.init_std, settings.seed)
        weights = WeightsSource(kind="random", seed=settings.seed, std=settings.init_std)
    elif not isinstance(weights, WeightsSource):
        weights = WeightsSource.from_dict(weights or {"kind": "in-memory"})
    log = log or (lambda line: None)
    try:
        fp = fingerprint(recipe, weights)
        keep = check_export_target(out, fp, overwrite)
        for path in remove_stale(out):
            log(f"removed {path}, left by an export that was killed")
        with atomic_dir(out, keep=keep) as tmp:
            manifest = _write_artifact(recipe, source, weights, fp, tmp, progress, log)
    except OSError as exc:
        raise ExportError(f"cannot write {out}: {exc.strerror or exc}") from None
    finally:
        source.close()
    return manifest


@dataclass
class _Traced:
    """One traced graph before its weights are bound."""

    file: str
    form: str
    attention: str
    model: Any  # onnx_ir.Model
    placeholders: dict
    specs: dict[str, WeightSpec]


def _trace(recipe: Recipe, file: str, form: str, attention: str) -> _Traced:
    """Trace the graph of ``form`` from a model on the meta device; its initializers stay placeholders."""
    settings, config, layout = recipe.export, recipe.model, recipe.export.layout
    dtype = TORCH_DTYPES[settings.precision]
    inputs, outputs = layout.io(config, settings.precision)
    with torch.device("meta"):
        graph_model = MLAForCausalLM(config, form).to(dtype)
    if attention == "plugin":
        from .decode_plugin import use_decode_plugin

        use_decode_plugin(graph_model)
    wrapper = CausalLMGraph(graph_model, layout).eval()
    args = tuple(a.to("meta") for a in example_decoder_inputs(graph_model, layout, settings.max_cache_length, dtype))
    model, placeholders, specs = trace_meta_graph(wrapper, args, inputs, outputs,
                                                  decoder_dynamic_shapes(layout, config.num_hidden_layers),
                                                  settings.opset, file)
    return _Traced(file, form, attention, model, placeholders, specs)


def trace_meta_graph(wrapper: torch.nn.Module, args: tuple, inputs, outputs, dynamic_shapes, opset: int,
                     file: str) -> tuple[Any, dict, dict[str, WeightSpec]]:
    """Trace ``wrapper`` (a graph wrapper around an :class:`MLAForCausalLM` on the meta device, as ``.model``,
    called on meta ``args``) and say where each placeholder initializer's data comes from.

    Returns:
        ``(onnx_ir model, {initializer: placeholder value}, {initializer: WeightSpec})``; bind the data with
        :func:`make_weights` and :func:`~mla_deploy.exporter.onnx_export.bind_initializers`.
    Raises:
        ExportError: the trace failed or an initializer is no parameter of the model.
    """
    with torch.no_grad():
        model, placeholders = trace_graph(wrapper, args, inputs, outputs, dynamic_shapes, opset, file)
    parameters = {name for name, _ in wrapper.named_parameters()} | {name for name, _ in wrapper.named_buffers()}
    derived = fold_weight_views(model, placeholders)
    specs = {}
    for final in placeholders:
        name, ops = final, []
        while name in derived:  # a weight view folded into its own initializer: walk back to the parameter
            name, op = derived[name]
            ops.append(op)
        if name not in parameters:
            raise ExportError(f"{file}: initializer {name} is no parameter of the model")
        spec = WeightSpec.for_parameter(name.removeprefix("model."))
        for op in reversed(ops):
            spec = spec.then(op)
        specs[final] = spec
    return model, placeholders, specs


def _write_artifact(recipe: Recipe, source: TensorSource, weights: WeightsSource, fp: str, tmp: Path,
                    progress: Progress | None, log: Log) -> Manifest:
    settings, config, layout = recipe.export, recipe.model, recipe.export.layout
    single = settings.prefill_form == settings.decode_form
    roles = {"prefill": settings.prefill_form, "decode": settings.decode_form}
    traced: dict[str, _Traced] = {}
    for role, form in roles.items():
        file = "model.onnx" if single else f"{role}.onnx"
        if file not in traced:
            attention = settings.decode_attention if (role == "decode" or single) else "standard"
            log(f"tracing {file} ({'prefill + decode' if single else role}, form {form}) ...")
            start = time.perf_counter()
            traced[file] = _trace(recipe, file, form, attention)
            log(f"traced {file} in {time.perf_counter() - start:.1f} s")
    quantization = settings.quantization
    quantized = quantization.quantize_graphs([(g.model, g.placeholders, g.specs) for g in traced.values()], log)
    specs: dict[str, WeightSpec] = {}
    for graph in traced.values():
        for name, spec in graph.specs.items():
            if specs.setdefault(name, spec) != spec:
                raise ExportError(f"initializer {name} means different tensors in two graphs")
    values = {name: v for graph in traced.values() for name, v in graph.placeholders.items()}
    total = sum(nbytes(v) for v in values.values())
    external = total > settings.external_data_threshold
    size = f"{total / 1e9:.2f} GB" if total >= 1e9 else f"{total / 1e6:.2f} MB"
    log(f"writing {size} of weights" + (f" to {WEIGHTS_FILE}" if external else " into the graph"))
    tensors, data = make_weights(specs, values, source, config, tmp if external else None, total, progress)
    quantization = quantization.recorded(quantized, ((s.quant, nbytes(values[n])) for n, s in specs.items()))
    inputs, outputs = layout.io(config, settings.precision)
    entries: dict[str, tuple[Any, Any]] = {}
    for file, graph in traced.items():
        log(f"checking and saving {file} ...")
        start = time.perf_counter()
        bind_initializers(graph.placeholders, tensors)
        inferred = save_graph(graph.model, tmp / file, inputs, outputs)
        entries[file] = (inferred, sha256_file(tmp / file))
        log(f"saved {file} in {time.perf_counter() - start:.1f} s")
    graphs = {}
    for role, form in roles.items():
        file = "model.onnx" if single else f"{role}.onnx"
        inferred, digest = entries[file]
        if role == "decode":
            offenders = per_head_kv_tensors(inferred, config)
            if offenders:
                raise ExportError(f"decode graph holds per-head K/V over the cache: {offenders[0]}")
            dense = all_expert_tensors(inferred, config)
            if dense:
                raise ExportError(f"decode graph computes every expert for every token: {dense[0]}")
        graphs[role] = GraphEntry(role=role, file=file, form=form, inputs=tuple(inputs), outputs=tuple(outputs),
                                  attention=traced[file].attention, external_data=WEIGHTS_FILE if external else None,
                                  bytes=(tmp / file).stat().st_size, sha256=digest)
    manifest = Manifest(
        name=recipe.name, fingerprint=fp, model=config, weights=weights, precision=settings.precision,
        opset=settings.opset, cache=layout.describe(config),
        max_cache_length=layout.manifest_capacity(settings.max_cache_length), graphs=graphs,
        recipe=recipe.to_dict(), versions=versions(), created=now(), weights_data=data,
        tokenizer=copy_tokenizer_files(weights.path, tmp) if weights.kind == "hf" and weights.path else None,
        quantization=quantization)
    manifest.save(tmp)
    return manifest


def nbytes(value) -> int:
    """Bytes of an initializer ``value`` (``INT4``: two per byte, rounded up)."""
    import math

    count = math.prod(int(d) for d in value.shape)
    return -(-count * value.dtype.bitwidth // 8)


def make_weights(specs: dict[str, WeightSpec], values: dict, source: TensorSource, config, folder: Path | None,
                  total: int, progress: Progress | None) -> tuple[dict, dict | None]:
    """Every initializer's data, made one at a time from ``source``: written to ``folder/weights.data`` and
    referenced (``folder`` given), or kept in memory (small models). Returns ``(tensors, weights_data record)``."""
    import onnx_ir as ir

    order = {key: i for i, key in enumerate(source.keys())}
    names = sorted(specs, key=lambda n: (order.get(specs[n].key, len(order)), n))  # a source tensor's views together
    file = WeightsFile(folder / WEIGHTS_FILE, total, progress) if folder is not None else None
    tensors, cached, memo = {}, (None, None), {}
    try:
        for name in names:
            spec, value = specs[name], values[name]
            if cached[0] != spec.key:
                cached = (spec.key, _source_tensor(source, spec.key, config))
            # the parts of one quantized view are adjacent in ``names``: it is quantized and laid out once
            tensor = spec.quant.make(spec.view, functools.partial(spec.view.apply, cached[1], config), memo,
                                     _torch_dtype(value.dtype))
            # NaN and Inf survive the cast, and make their block's scale NaN or Inf: one check of what is written
            if not _all_finite(tensor):
                verb = "holds" if not _all_finite(cached[1]) else f"overflows {value.dtype.name.lower()} with"
                raise ExportError(f"weight {spec.key} {verb} {_non_finite(tensor)}; the export is refused")
            if tuple(tensor.shape) != tuple(int(d) for d in value.shape):
                raise ExportError(f"{name}: the weights give {tuple(tensor.shape)}, the graph needs "
                                  f"{tuple(value.shape)}")
            if file is None:
                tensors[name] = ir.Tensor(_numpy(tensor, value.dtype), dtype=value.dtype, name=name)
            else:
                offset, length = file.append(pack_int4(tensor) if value.dtype == ir.DataType.INT4 else tensor)
                tensors[name] = ir.ExternalTensor(WEIGHTS_FILE, offset, length, value.dtype, shape=value.shape,
                                                  name=name, base_dir=str(folder))
            del tensor
    finally:
        record = file.close() if file is not None else None
    return tensors, record


#: elements per slice when checking a weight: the check's own memory stays small whatever the tensor's size
_CHECK_SLICE = 1 << 22


def _all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or +-Inf in ``tensor`` (any shape), checked slice by slice."""
    if not tensor.is_floating_point():
        return True
    flat = tensor.reshape(-1)
    return all(bool(torch.isfinite(flat[i: i + _CHECK_SLICE]).all()) for i in range(0, flat.numel(), _CHECK_SLICE))


def _non_finite(tensor: torch.Tensor) -> str:
    """``NaN and Inf (3 of 1024 values)``: what a weight that is not all finite holds."""
    nan, inf = int(tensor.isnan().sum()), int(tensor.isinf().sum())
    kinds = " and ".join(k for k, n in (("NaN", nan), ("Inf", inf)) if n)
    return f"{kinds} ({nan + inf} of {tensor.numel()} values)"


def _source_tensor(source: TensorSource, key: str, config) -> torch.Tensor:
    """The source's tensor ``key``; the rope frequencies are computed from the config, as the model does."""
    if key.endswith("rotary_emb.inv_freq"):
        from ..model.rope import inv_freq_for

        return inv_freq_for(config)
    try:
        return source.get(key)
    except KeyError:
        raise ExportError(f"the weights have no tensor {key}") from None


def _torch_dtype(dtype) -> torch.dtype:
    """The torch dtype a tensor of the ONNX ``dtype`` is made in (``INT4``: int8 values, packed when written)."""
    import onnx_ir as ir

    table = {ir.DataType.FLOAT: torch.float32, ir.DataType.FLOAT16: torch.float16,
             ir.DataType.BFLOAT16: torch.bfloat16, ir.DataType.INT64: torch.int64, ir.DataType.INT8: torch.int8,
             ir.DataType.UINT8: torch.uint8, ir.DataType.INT4: torch.int8}
    return table[dtype]


def _numpy(tensor: torch.Tensor, dtype=None):
    import onnx_ir as ir

    if dtype == ir.DataType.INT4:
        import ml_dtypes

        return tensor.numpy().astype(ml_dtypes.int4)
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()
