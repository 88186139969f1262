"""The one export pipeline: every target (:mod:`.artifact`, :mod:`.genai`, :mod:`.blocks`) goes through it.

A target (:class:`ExportTarget`) is a small declaration: which folder it may write (``prepare``), which graphs
(:class:`GraphPlan`: the module, its example inputs and dynamic shapes, its I/O, its opset and its checks) and
what metadata it writes once they are saved (``finish``). :func:`run_export` does the rest, the same for all:

1. ``prepare`` checks the folder; temporaries of a killed export are removed;
2. each graph is traced from a module on the ``meta`` device (shapes only), its weights left as placeholders
   whose source is recorded (:class:`~.weights.WeightSpec`; :func:`trace_meta_graph`);
3. the target's weight quantization (:class:`mla_deploy.quant.Quantization`; :data:`~mla_deploy.quant.FLOAT`
   changes nothing) is applied to all graphs as one unit;
4. every initializer is made one at a time from the weights' source (a checkpoint read tensor by tensor, a preset's
   seeded random weights, a module in memory) and streamed into one ``weights.data`` that every graph references
   (:func:`make_weights`), so memory stays near the largest tensor whatever the model's size; small models
   (weights at most the target's ``external_data_threshold`` bytes) keep them inside the graph file(s). Every
   weight is checked finite as it is written;
5. each graph is saved, checked (``onnx.checker``, its I/O contract) and put through its plan's checks
   (:func:`decode_checks`: no per-head K/V over the cache, no expert computed for every token);
6. ``finish`` writes the target's metadata.

All of it happens in a folder built with :func:`~mla_deploy.artifact.atomic_dir` (a temporary name beside the
target, swapped into place at the end), so a failed or interrupted export never leaves a half-written folder; the
names ``prepare`` returns (the user's files already there) are kept.
"""

from __future__ import annotations

import functools
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from .. import __version__
from ..artifact import atomic_dir, sha256_file
from ..artifact.files import remove_stale
from ..config import MLAConfig
from ..errors import ExportError
from ..expert_forms import BRANCHES, CPU_LAYOUT
from ..io_spec import TensorSpec
from ..model.layers import routed_expert_parameters
from ..quant import Quantization, QuantizedKeys, pack_int4
from .moe_onnx import dense_expert_products
from .onnx_export import bind_initializers, fold_weight_views, per_head_kv_tensors, save_graph, trace_graph
from .weights import WEIGHTS_FILE, Progress, TensorSource, WeightsFile, WeightSpec

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
Log = Callable[[str], None]


def versions() -> dict[str, str]:
    """Versions of what produced an export."""
    import onnx

    out = {"mla_deploy": __version__, "torch": torch.__version__, "onnx": onnx.__version__,
           "python": platform.python_version()}
    try:
        import onnxscript

        out["onnxscript"] = onnxscript.__version__
    except ImportError:  # pragma: no cover - a dependency
        pass
    return out


@dataclass(frozen=True)
class SavedGraph:
    """One graph as saved: its file, the shape-inferred model (no weights), digest and size, and the names of its
    routed-expert weight initializers (what :func:`~.moe_onnx.dense_expert_products` follows)."""

    file: str
    proto: Any  # onnx.ModelProto
    sha256: str
    bytes: int
    experts: frozenset[str] = frozenset()


#: a check of a saved graph: raises :class:`~mla_deploy.errors.ExportError` naming what it refuses
GraphCheck = Callable[[SavedGraph], None]


@dataclass(frozen=True)
class GraphPlan:
    """One graph a target writes.

    Attributes:
        file: its file name in the folder.
        label: what it serves, for the log (``prefill + decode, form A_CC``).
        module: the graph module on the ``meta`` device; its parameters named ``model.<source key>`` (a wrapper
            around the model as ``.model``) or as the weights' source names them.
        args: example inputs on the ``meta`` device, every dynamic axis traced at >= 2 (an axis traced at 1 is frozen).
        dynamic_shapes: ``torch.export`` dynamic shapes of ``args``.
        inputs, outputs: the I/O contract, in graph order.
        opset: the ONNX opset.
        checks: run on the saved graph, in order.
        experts: the routed experts' graph form (:mod:`mla_deploy.expert_forms`: ``fused`` or ``branches``).
        fused_layout: the fused form's layout (:data:`~mla_deploy.expert_forms.FUSED_LAYOUTS`: ``cpu`` or ``cuda``),
            one for every graph of an export.
    """

    file: str
    label: str
    module: torch.nn.Module
    args: tuple
    dynamic_shapes: tuple
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    opset: int
    checks: tuple[GraphCheck, ...] = ()
    experts: str = BRANCHES
    fused_layout: str = CPU_LAYOUT


@dataclass(frozen=True)
class Exported:
    """What the shared steps wrote, handed to the target's ``finish``.

    Attributes:
        graphs: ``{file: SavedGraph}``, in plan order.
        specs: ``{initializer: WeightSpec}`` of every graph (an initializer means one tensor in all of them).
        values: ``{initializer: ir.Value}`` (name, dtype, shape).
        weights_data: ``weights.data``'s record (``{"file", "bytes", "sha256"}``), or None: weights in the graphs.
        quantized: the checkpoint keys quantized (empty: none).
    """

    graphs: dict[str, SavedGraph]
    specs: dict[str, WeightSpec]
    values: dict
    weights_data: dict | None
    quantized: QuantizedKeys = field(default_factory=QuantizedKeys)


class ExportTarget(Protocol):
    """What one kind of export declares (:class:`~.artifact.ArtifactTarget`, :class:`~.genai.GenaiTarget`,
    :class:`~.blocks.BlockTarget`)."""

    config: MLAConfig
    #: the weights' quantization, scheme and format (:data:`~mla_deploy.quant.FLOAT`: none)
    quantization: Quantization
    #: weights above this many bytes go to ``weights.data``
    external_data_threshold: int
    #: the absorbed halves of ``kv_b_proj`` may be quantized per head (:data:`~mla_deploy.quant.HEADWISE`): the
    #: sessions that run the graphs are given the option that folds their dequantization once (mla-deploy's own)
    per_head_weights: bool

    def prepare(self, out: Path, overwrite: bool) -> list[str]:
        """Check that ``out`` may take the export; return the names there to keep. Raises ExportError."""

    def graphs(self) -> list[GraphPlan]:
        """The graphs to write, each file once."""

    def finish(self, tmp: Path, exported: Exported) -> Any:
        """Write the metadata into the folder ``tmp`` beside what ``exported`` holds; return the export's record."""


def run_export(target: ExportTarget, out: str | Path, source: TensorSource, overwrite: bool = False,
               progress: Progress | None = None, log: Log | None = None) -> Any:
    """Export ``target`` into the folder ``out`` (see the module docstring) and return what its ``finish`` returns.

    Args:
        target: what to export.
        out: the folder to create or replace (the names ``target.prepare`` returns are kept).
        source: the weights, served one tensor at a time; closed when the export ends.
        overwrite: passed to ``target.prepare``.
        progress: called as ``progress(bytes_written, total_bytes, seconds)`` while the weights are written.
        log: called with one line per step (tracing each graph, saving it, temporaries of a killed export removed).
    Raises:
        ExportError: ``out`` cannot take the export or cannot be written (no space, no permission), a weight is
            not finite, or the trace or a check fails.
    """
    out, log = Path(out), log or (lambda line: None)
    try:
        keep = target.prepare(out, overwrite)
        for path in remove_stale(out):
            log(f"removed {path}, left by an export that was killed")
        with atomic_dir(out, keep=keep) as tmp:
            return target.finish(tmp, _write_graphs(target, source, tmp, progress, log))
    except OSError as exc:
        raise ExportError(f"cannot write {out}: {exc.strerror or exc}") from None
    finally:
        source.close()


@dataclass
class _Traced:
    """One traced graph before its weights are bound."""

    plan: GraphPlan
    model: Any  # onnx_ir.Model
    placeholders: dict
    specs: dict[str, WeightSpec]
    expert_keys: frozenset[str]

    def experts(self) -> frozenset[str]:
        """The initializers that hold routed-expert weights (quantized parts included)."""
        return frozenset(name for name, spec in self.specs.items() if spec.key in self.expert_keys)


def _write_graphs(target: ExportTarget, source: TensorSource, tmp: Path, progress: Progress | None,
                  log: Log) -> Exported:
    """Steps 2 to 5: trace, quantize, stream the weights, save and check every graph of ``target`` into ``tmp``."""
    traced = []
    for plan in target.graphs():
        log(f"tracing {plan.file} ({plan.label}) ...")
        start = time.perf_counter()
        traced.append(trace_meta_graph(plan))
        log(f"traced {plan.file} in {time.perf_counter() - start:.1f} s")
    layouts = {g.plan.fused_layout for g in traced}
    if len(layouts) > 1:
        raise ExportError(f"one export's graphs hold their fused experts in one layout, not {sorted(layouts)}")
    quantized = target.quantization.quantize_graphs([(g.model, g.placeholders, g.specs) for g in traced], log,
                                                    target.per_head_weights, *layouts)
    specs: dict[str, WeightSpec] = {}
    for graph in traced:
        for name, spec in graph.specs.items():
            if specs.setdefault(name, spec) != spec:
                raise ExportError(f"initializer {name} means different tensors in two graphs")
    values = {name: v for graph in traced for name, v in graph.placeholders.items()}
    total = sum(nbytes(v) for v in values.values())
    external = total > target.external_data_threshold
    size = f"{total / 1e9:.2f} GB" if total >= 1e9 else f"{total / 1e6:.2f} MB"
    log(f"writing {size} of weights" + (f" to {WEIGHTS_FILE}" if external else " into the graph"))
    experts = frozenset().union(*(graph.expert_keys for graph in traced))
    tensors, data = make_weights(specs, values, source, target.config, tmp if external else None, total, progress,
                                 experts)
    graphs = {graph.plan.file: _save(graph, tensors, tmp, log) for graph in traced}
    return Exported(graphs, specs, values, data, quantized)


def _save(graph: _Traced, tensors: dict, tmp: Path, log: Log) -> SavedGraph:
    """Bind ``graph``'s weights, save it into ``tmp`` and run its plan's checks."""
    plan = graph.plan
    log(f"checking and saving {plan.file} ...")
    start = time.perf_counter()
    bind_initializers(graph.placeholders, tensors)
    inferred = save_graph(graph.model, tmp / plan.file, plan.inputs, plan.outputs)
    saved = SavedGraph(plan.file, inferred, sha256_file(tmp / plan.file), (tmp / plan.file).stat().st_size,
                       graph.experts())
    for check in plan.checks:
        check(saved)
    log(f"saved {plan.file} in {time.perf_counter() - start:.1f} s")
    return saved


def trace_meta_graph(plan: GraphPlan) -> _Traced:
    """Trace ``plan.module`` (on the meta device) on ``plan.args`` and say where each placeholder initializer's
    data comes from: the parameter it is (``model.`` stripped: the source's key), through the views folded into it
    (:func:`~.onnx_export.fold_weight_views`).

    Raises:
        ExportError: the trace failed or an initializer is no parameter of the module.
    """
    wrapper = plan.module
    with torch.no_grad():
        model, placeholders = trace_graph(wrapper, plan.args, plan.inputs, plan.outputs, plan.dynamic_shapes,
                                          plan.opset, plan.file, plan.experts, plan.fused_layout)
    parameters = {name for name, _ in wrapper.named_parameters()} | {name for name, _ in wrapper.named_buffers()}
    # A shared parameter (a tied lm_head is the embedding matrix) is listed once by named_parameters, under its
    # first name; the graph may name it by another: each alias reads the tensor of the name the source serves.
    canonical = {id(p): name for name, p in wrapper.named_parameters()}
    aliases = {name: canonical[id(p)] for name, p in wrapper.named_parameters(remove_duplicate=False)}
    derived = fold_weight_views(model, placeholders)
    specs = {}
    for final in placeholders:
        name, ops = final, []
        while name in derived:  # a weight view folded into its own initializer: walk back to the parameter
            name, op = derived[name]
            ops.append(op)
        name = aliases.get(name, name)
        if name not in parameters:
            raise ExportError(f"{plan.file}: initializer {name} is no parameter of the model")
        spec = WeightSpec.for_parameter(name.removeprefix("model."))
        for op in reversed(ops):
            spec = spec.then(op)
        specs[final] = spec
    experts = frozenset(WeightSpec.for_parameter(name.removeprefix("model.")).key
                        for name in routed_expert_parameters(wrapper))
    return _Traced(plan, model, placeholders, specs, experts)


def refuse_per_head_kv(config: MLAConfig) -> GraphCheck:
    """A check that refuses a graph holding per-head keys or values over the cache
    (:func:`~.onnx_export.per_head_kv_tensors`): the absorbed decode graph attends over the latent rows only."""
    def check(graph: SavedGraph) -> None:
        found = per_head_kv_tensors(graph.proto, config)
        if found:
            raise ExportError(f"decode graph {graph.file} holds per-head K/V over the cache: {found[0]}")
    return check


def refuse_dense_experts(graph: SavedGraph) -> None:
    """Refuse a graph that computes a routed expert's weight with every token
    (:func:`~.moe_onnx.dense_expert_products`, which follows what the expert weights feed)."""
    found = dense_expert_products(graph.proto, graph.experts)
    if found:
        raise ExportError(f"decode graph {graph.file} computes every expert for every token: {found[0]}")


def decode_checks(config: MLAConfig) -> tuple[GraphCheck, ...]:
    """The checks of a graph that serves decode steps, whatever the target."""
    return refuse_per_head_kv(config), refuse_dense_experts


def nbytes(value) -> int:
    """Bytes of an initializer ``value`` (``INT4``: two per byte, rounded up)."""
    import math

    count = math.prod(int(d) for d in value.shape)
    return -(-count * value.dtype.bitwidth // 8)


def make_weights(specs: dict[str, WeightSpec], values: dict, source: TensorSource, config, folder: Path | None,
                  total: int, progress: Progress | None, experts: frozenset[str] = frozenset()) -> tuple[dict, dict | None]:
    """Every initializer's data, made one at a time from ``source``: written to ``folder/weights.data`` and
    referenced (``folder`` given), or kept in memory (small models). ``experts``: the source keys of stacked routed
    experts' tensors, read one expert at a time. Returns ``(tensors, weights_data record)``."""
    import onnx_ir as ir

    order = {key: i for i, key in enumerate(source.keys())}
    names = sorted(specs, key=lambda n: (order.get(specs[n].key, len(order)), n))  # a source tensor's views together
    file = WeightsFile(folder / WEIGHTS_FILE, total, progress) if folder is not None else None
    views, tensors, memo = _Views(source, config, experts), {}, {}
    try:
        for name in names:
            value = values[name]
            # the parts of one quantized view are adjacent in ``names``: it is quantized and laid out once
            chunks, stacked = views.chunks(specs[name], memo, _torch_dtype(value.dtype))
            chunks = views.checked(chunks, name, specs[name].key, value, stacked)
            if file is None:
                tensor = torch.stack(list(chunks)) if stacked else next(iter(chunks))
                tensors[name] = ir.Tensor(_numpy(tensor, value.dtype), dtype=value.dtype, name=name)
                continue
            int4 = value.dtype == ir.DataType.INT4
            offset, length = file.append_chunks(pack_int4(t) if int4 else t for t in chunks)
            tensors[name] = ir.ExternalTensor(WEIGHTS_FILE, offset, length, value.dtype, shape=value.shape,
                                              name=name, base_dir=str(folder))
    finally:
        record = file.close() if file is not None else None
    return tensors, record


class _Views:
    """The source's tensors behind the specs, as the specs come (a source tensor's views adjacent): a whole tensor,
    kept while its views are made; a stacked routed experts' tensor (its key in ``experts``) one expert at a time,
    so that memory stays near one expert whatever the layer (a V3 layer's ``gate_up_proj`` is 15 GB in bf16)."""

    def __init__(self, source: TensorSource, config, experts: frozenset[str]):
        self.source, self.config, self.experts = source, config, experts
        self._cached: tuple[Any, torch.Tensor | None] = (None, None)

    def _read(self, key: str, index: int | None = None) -> torch.Tensor:
        """The source tensor ``key`` (``index``: its expert ``index`` alone), kept for the next view."""
        if self._cached[0] != (key, index):
            self._cached = (None, None)
            tensor = _source_tensor(self.source, key, self.config) if index is None else self.source.expert(key, index)
            self._cached = ((key, index), tensor)
        return self._cached[1]

    def chunks(self, spec: WeightSpec, memo: dict, dtype: torch.dtype) -> tuple[Any, bool]:
        """``(tensors, stacked)``: the initializer of ``spec`` as one tensor, or (``stacked``) as the iterable of
        its experts' slices ``[e]``."""
        view = spec.view
        if spec.key in self.experts and self.config.n_routed_experts:
            count = self.config.n_routed_experts
            one = view.per_expert(count)
            if one is not None:
                expert = lambda e: one.apply(self._read(spec.key, e), self.config)  # noqa: E731
                return spec.quant.stacked(view, count, expert, memo, dtype), True
            if view.part is None and view.ops and view.ops[0][0] == "index":  # one expert: read it alone
                rest = WeightSpec(view.key, None, view.ops[1:])
                compute = lambda: rest.apply(self._read(spec.key, view.ops[0][1]), self.config)  # noqa: E731
                return [spec.quant.make(view, compute, memo, dtype)], False
        compute = functools.partial(view.apply, self._read(spec.key), self.config)
        return [spec.quant.make(view, compute, memo, dtype)], False

    def checked(self, chunks, name: str, key: str, value, stacked: bool):
        """``chunks``, each checked finite (NaN and Inf survive the cast, and make their block's scale NaN or Inf)
        and of the graph's shape (a stacked one: ``value.shape[1:]`` each, ``value.shape[0]`` of them).

        Raises:
            ExportError: naming the weight and what it holds or gives."""
        shape = tuple(int(d) for d in value.shape)
        count = 0
        for tensor in chunks:
            if not _all_finite(tensor):
                source = self._cached[1]
                verb = "holds" if source is not None and not _all_finite(source) else \
                    f"overflows {value.dtype.name.lower()} with"
                raise ExportError(f"weight {key} {verb} {_non_finite(tensor)}; the export is refused")
            got = tuple(tensor.shape)
            if got != (shape[1:] if stacked else shape):
                got = (count, *got) if stacked else got
                raise ExportError(f"{name}: the weights give {got}, the graph needs {shape}")
            count += 1
            yield tensor
        if stacked and count != shape[0]:
            raise ExportError(f"{name}: the weights give {count} experts, the graph needs {shape[0]}")


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
