"""The pre-built ONNX Runtime CPU engine of an artifact: ``mla-deploy build ART --target cpu`` writes it once, and
:class:`~mla_deploy.ort.engine.OrtEngine` opens it instead of the source graphs when it is fresh (its record's
check, :func:`mla_deploy.ort.record.check_cpu_engine`).

Opening the source graph makes ONNX Runtime optimise it (fusions, constant folding, layout changes) and pack every
weight for its kernels, at every start. The build does that once per graph file of the artifact, with ONNX Runtime's
own session options (``onnxruntime_session_options_config_keys.h``, checked against 1.31.1):

* ``SessionOptions.optimized_model_filepath``: the graph after ``ORT_ENABLE_ALL``, saved as ``cpu/<graph>.onnx``;
* ``session.optimized_model_external_initializers_file_name``: its weights in ``cpu/<graph>.data``; ONNX Runtime
  places every tensor over 1 MiB at a 4 KiB-aligned offset (its fixed policy; 1.31 has no option to change it) and
  maps aligned data with ``mmap`` when it opens the graph;
* ``session.optimized_model_external_initializers_min_size_in_bytes`` = 1024: smaller tensors (shape constants) stay
  inside the graph, where ONNX Runtime's shape inference reads them (it cannot read external ones);
* ``session.save_external_prepacked_constant_initializers`` = 1 (float weights only): the pre-packed weights go into
  the data file too, and a session opening the graph reads them back instead of packing again. ONNX Runtime 1.31.1
  saves ``MatMulNBits``'s packed buffer before its ``int8``-compute (``accuracy_level`` 4) path packs the scales into
  it on x86-64, and a session reading it back computes NaN (measured on the tiny preset): an artifact with quantized
  weights (either format: ``qdq`` is fused into ``MatMulNBits`` by the optimisation) saves none, its kernels pack
  at open as before. Of a float artifact's, :func:`keep_prepacked` keeps only the kernels in :data:`PREPACKED_KEPT`
  (checked bit for bit); any other kernel (a fused expert operator, say) packs at open. Where the operators below
  compile, a float weight's ``MatMul`` (a projection's, or the attention's per-head ``W_UK``/``W_UV``) is
  ``mla_deploy.FloatMatMul``, which packs nothing: what is left to keep is that of the ``Gemm`` nodes (the
  routers').

Float routed experts (``MoE``, given their layer's shared experts where the graph adds them:
:func:`~mla_deploy.ort.swaps.fold_float_shared_experts`) and the products of float weights (``MatMul``) are
swapped for ``mla_deploy.FloatExperts`` and ``mla_deploy.FloatMatMul``. Quantized routed experts (``QMoE``), a layer's quantized
products (``MatMulNBits``) and the absorbed attention's per-head products (:data:`~mla_deploy.quant.formats.HEADWISE`), int4/int8 in blocks of 32, are swapped for
mla-deploy's own operators ``mla_deploy.RoutedExperts``, ``mla_deploy.BlockwiseMatMul`` and
``mla_deploy.HeadwiseMatMul``
(:mod:`~mla_deploy.ort.operators`), compiled into ``cpu/cpu_ops.so`` for this CPU: the same weights and the same
compute, streamed faster; their weights are not packed (they are read where ONNX Runtime maps them), only those of
``RoutedExperts`` and of ``BlockwiseMatMul`` rows over 512 values stored interleaved in groups of 16 blocks
(:func:`~mla_deploy.ort.swaps.interleave_weights`: the same bytes, moved). Each layer's
absorbed attention core (the cache write, the rope, ``kv_a_layernorm``, ``W_UK``, the
scores, the softmax, the weighted sum and ``W_UV``: about 40 nodes) then becomes one ``mla_deploy.LatentAttention``
(:func:`~mla_deploy.ort.swaps.swap_attention`), its per-head products quantized or float32. Without a C
compiler, the source, or any of the operators' fast paths (AVX-512 VNNI, AVX-VNNI, AVX2: the best the CPU has is
compiled, and the record names it), the engine keeps ONNX Runtime's operators and says why.

The engine is opened with ``ORT_DISABLE_ALL`` (nothing left to optimise; ONNX Runtime's kernels where it kept them,
so the same numbers there, our operators' float sums in another order elsewhere: checked token for token in the
tests). Quantized products are baked in the fast compute (``int8``); the exact compute
that validation compares with PyTorch always opens the source graph. What the engine is tied to is its record's
(:mod:`mla_deploy.ort.record`).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Callable

from ..artifact import atomic_dir, check_artifact, load_manifest, now, sampled_sha256, sha256_file
from ..artifact.manifest import Manifest
from ..artifact.target import probe_writable
from ..errors import ArtifactError, ExportError, RuntimeMissingError
from ..quant import FAST_COMPUTE
from ..quant.formats import EXTERNAL_FOLDER_ENTRY
from . import operators, swaps
from .engine import check_precision, require_onnxruntime, session_options
from .record import (CPU_ENGINE_DIR, CPU_ENGINE_RECORD, SESSION, CpuEngineRecord, CpuOperators, EngineGraph, host_cpu,
                     write_cpu_engine_record)

#: the name of a graph or data file a build writes (``<graph stem>.onnx``, ``.data``): what a record may name
ENGINE_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.(onnx|data)")
#: the kernels whose saved pre-packed weights ONNX Runtime 1.31.1 reads back bit for bit (fp32 ``MatMul``/``Gemm``)
PREPACKED_KEPT = ("MatMul", "Gemm")
#: initializers below this many bytes stay inside the engine graph
DATA_MIN_BYTES = 1024
EXTERNAL_FILE = "session.optimized_model_external_initializers_file_name"
EXTERNAL_MIN_BYTES = "session.optimized_model_external_initializers_min_size_in_bytes"
SAVE_PREPACKED = "session.save_external_prepacked_constant_initializers"


def build_cpu_engine(artifact: str | Path, log: Callable[[str], None] | None = None,
                     isa: operators.Isa | None = None, features: tuple[str, ...] | None = None) -> CpuEngineRecord:
    """Build ``artifact``'s CPU engine into ``artifact/cpu/`` (atomically: a failed or interrupted build leaves the
    previous engine, or none) and return its record. Its own operators are compiled for ``isa``, by default the best
    fast path of a CPU with ``features``, by default this one's (:func:`~mla_deploy.ort.operators.compile_library`:
    ``isa`` must run here; ``features`` is how a test builds as a CPU without a fast path would).

    Raises:
        ArtifactError: not an artifact, or an inconsistent one. RuntimeMissingError: no onnxruntime; a bf16 artifact
            or a graph holding the TensorRT plugin (ONNX Runtime's CPU provider runs neither).
        ExportError: ``artifact/cpu`` cannot be written or is not an engine folder (a user's file there is never
            replaced), or ONNX Runtime failed to optimise a graph.
    """
    ort = require_onnxruntime()
    root = Path(artifact)
    manifest = load_manifest(root)
    check_precision(manifest.precision, "cpu")
    manifest = check_artifact(root)  # the graphs' sha256 included: the record ties the engine to them
    plugin = next((g.file for g in manifest.graphs.values() if g.uses_plugin), None)
    if plugin is not None:  # check_artifact saw the node in the file
        raise RuntimeMissingError(f"{plugin} holds the TensorRT MlaDecode plugin node, which ONNX Runtime cannot run; "
                                  f"build it with `mla-deploy build {root} --target tensorrt`")
    _check_replaceable(root / CPU_ENGINE_DIR, _engine_files(root, manifest))
    probe_writable(root / CPU_ENGINE_DIR)
    start = time.perf_counter()
    sources: dict[str, list[str]] = {}
    for role, graph in manifest.graphs.items():
        sources.setdefault(graph.file, []).append(role)
    with atomic_dir(root / CPU_ENGINE_DIR) as tmp:
        # DeepSeek Sparse Attention keeps its attention in ONNX Runtime's operators: LatentAttention attends to every
        # cached token, not to the indexer's top-k (the products around it are swapped all the same)
        graphs, own = [], _Operators(tmp, isa, features, fuse_attention=not manifest.config.is_sparse)
        for source, roles in sources.items():
            if log:
                log(f"optimising {source} ({' + '.join(roles)}) ...")
            graphs.append(_build_graph(ort, root, manifest, source, tmp, tuple(roles), own))
        record = CpuEngineRecord(host_cpu(ort.__version__), manifest.fingerprint,
                                 (manifest.weights_data or {}).get("sha256"), tuple(graphs), dict(SESSION),
                                 prepacked_kernels(manifest), now(), round(time.perf_counter() - start, 3),
                                 own.record())
        write_cpu_engine_record(tmp, record)
    return record


def _engine_files(root: Path, manifest: Manifest) -> set[str]:
    """The names of the files a build of ``root``'s engine writes (``engine.json``, ``<graph>.onnx`` and
    ``<graph>.data`` for each of its graph files, ``cpu_ops.so``), and those the engine there now records."""
    from .record import read_cpu_engine_record
    from .operators import LIBRARY

    names = {CPU_ENGINE_RECORD, LIBRARY}
    for graph in manifest.graphs.values():
        names |= {f"{Path(graph.file).stem}.onnx", f"{Path(graph.file).stem}.data"}
    try:
        record = read_cpu_engine_record(root)
    except (ArtifactError, OSError, ValueError):  # an unreadable record names nothing
        record = None
    for graph in record.graphs if record is not None else ():  # an edited record may name anything: only engine
        names |= {n for n in (graph.engine, graph.data) if n and ENGINE_FILE.fullmatch(n)}  # files' own names count
    return names


def _check_replaceable(folder: Path, engine_files: set[str]) -> None:
    """An existing ``folder`` must be an engine folder, holding only ``engine_files`` (:func:`_engine_files`), none
    of them a link: the build replaces it whole.

    Raises: ExportError: a file, a link, or a folder holding anything else (a user's file)."""
    if not os.path.lexists(folder):
        return
    if folder.is_symlink() or not folder.is_dir():
        raise ExportError(f"{folder} exists and is not a CPU engine folder; move it away first")
    foreign = sorted(p.name for p in folder.iterdir()
                     if p.name not in engine_files or p.is_symlink() or not p.is_file())
    if foreign:
        raise ExportError(f"{folder / foreign[0]} is not a file of a CPU engine and the build would replace it; move it "
                          f"away first")


class _Operators:
    """The build's own operators: compiled into ``tmp`` the first time a graph holds a node they can compute, then
    swapped into every graph that does (:func:`~mla_deploy.ort.swaps.swap_experts`, ``swap_linear``)."""

    def __init__(self, tmp: Path, isa: operators.Isa | None = None, features: tuple[str, ...] | None = None,
                 fuse_attention: bool = True):
        self.tmp, self.library, self.experts, self.linear, self.heads = tmp, None, 0, 0, 0
        self.isa, self.features, self.fuse_attention = isa, features, fuse_attention
        self.attention = self.float_experts = self.half_scales = self.float_linear = self.shared = 0

    def swap(self, model: str | bytes, folder: Path, side: Path, rewritten: Path):
        """``model`` (a path or bytes, :meth:`~mla_deploy.quant.Quantization.session`'s; its weights under ``folder``)
        with its eligible nodes swapped, their scales stored as float16 where exact (into the file ``side``, which
        the model then names; :func:`~mla_deploy.ort.swaps.store_half_scales`) and the float weights of its
        ``FloatMatMul`` nodes transposed and the quantized weights of its ``RoutedExperts`` and long
        ``BlockwiseMatMul`` rows interleaved (both into the file ``rewritten``;
        :func:`~mla_deploy.ort.swaps.swap_float_linear`, :func:`~mla_deploy.ort.swaps.interleave_weights`):
        ``(model, the library to register or None)``."""
        import onnx

        proto = (onnx.load(str(model), load_external_data=False) if isinstance(model, str)
                 else onnx.load_from_string(model))
        if not swaps.swappable(proto):
            return model, None
        if self.library is None:
            self.library = operators.compile_library(self.tmp, self.isa, features=self.features)
        if self.library.path is None:
            return model, None
        experts, linear, heads = swaps.swap_experts(proto), swaps.swap_linear(proto), swaps.swap_headwise(proto)
        shared = swaps.fold_shared_experts(proto) if experts and linear else 0
        linear -= 3 * shared  # each layer's shared gate, up and down products now inside its RoutedExperts
        float_experts = swaps.swap_float_experts(proto)
        # the float shared experts' weights, in FloatExperts' layout, open the side file swap_float_linear appends to
        float_shared = swaps.fold_float_shared_experts(proto, folder, rewritten) if float_experts else 0
        attention = swaps.swap_attention(proto) if self.fuse_attention else 0
        # each core takes its layer's two per-head products inside (quantized, or float32 ones, which go no further)
        heads = sum(1 for n in proto.graph.node if (n.domain, n.op_type) == (swaps.DOMAIN, swaps.HEADWISE_OP_TYPE))
        float_linear = swaps.swap_float_linear(proto, folder, rewritten)
        swaps.interleave_weights(proto, folder, rewritten)  # appended after the float ones, if any
        if not experts + linear + heads + attention + float_experts + float_linear:
            return model, None
        self.experts, self.linear, self.heads = self.experts + experts, self.linear + linear, self.heads + heads
        self.attention, self.float_experts = self.attention + attention, self.float_experts + float_experts
        self.float_linear, self.shared = self.float_linear + float_linear, self.shared + shared + float_shared
        self.half_scales += swaps.store_half_scales(proto, folder, side)
        return proto.SerializeToString(), self.library.path

    def record(self) -> CpuOperators:
        if self.experts + self.linear + self.heads + self.attention + self.float_experts + self.float_linear:
            path = self.library.path
            return CpuOperators(self.experts, self.linear, path.name, sha256_file(path),
                                sha256_file(operators.source_path()), heads=self.heads, attention=self.attention,
                                float_experts=self.float_experts, half_scales=self.half_scales,
                                float_linear=self.float_linear, shared=self.shared, isa=self.library.isa)
        if self.library is not None and self.library.path is not None:
            self.library.path.unlink()  # compiled, but no node qualified
            return CpuOperators(why_not="no QMoE, MoE, MatMulNBits, per-head product or float MatMul they compute "
                                        "exactly (mla_deploy.ort.operators)")
        return CpuOperators(why_not=None if self.library is None else self.library.why_not)


def _build_graph(ort, root: Path, manifest: Manifest, source: str, tmp: Path, roles: tuple[str, ...],
                 own: _Operators) -> EngineGraph:
    """Optimise ``root/source`` once into ``tmp/<stem>.onnx`` + ``tmp/<stem>.data``, its quantized experts and
    products swapped for :mod:`~mla_deploy.ort.operators`'s operators where they compute them; its
    :class:`EngineGraph`."""
    stem = Path(source).stem
    engine, data = tmp / f"{stem}.onnx", tmp / f"{stem}.data"
    options = session_options()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(engine)
    kept = prepacked_kernels(manifest)
    for key, value in ((EXTERNAL_FILE, data.name), (EXTERNAL_MIN_BYTES, str(DATA_MIN_BYTES)),
                       (SAVE_PREPACKED, "1" if kept else "0")):
        options.add_session_config_entry(key, value)
    model, entries = manifest.quantization.session(root / source, FAST_COMPUTE)
    # float16 scales, transposed float weights, interleaved quantized ones: read by the session below into the
    # engine's data, then gone
    side, rewritten = tmp / f"{stem}.scales16", tmp / f"{stem}.rewritten"
    model, library = own.swap(model, (root / source).parent, side, rewritten)
    if library is not None:
        operators.register(options, library)
        entries = {**entries, EXTERNAL_FOLDER_ENTRY: str((root / source).parent)}  # the swapped graph, as bytes
    for key, value in entries.items():
        options.add_session_config_entry(key, value)
    try:
        session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ExportError(f"ONNX Runtime could not optimise {source}: {write_failure(tmp) or first[:300]}") from exc
    del session  # the files are complete once the session is created; its packed weights are freed here
    side.unlink(missing_ok=True)
    rewritten.unlink(missing_ok=True)
    if not engine.is_file():
        raise ExportError(f"ONNX Runtime did not write the optimised {source}")
    keep_prepacked(engine, kept)
    sample = sampled_sha256(data) if data.is_file() else ""
    if data.is_file() and library is not None:  # only our operators ask for huge pages: else keep what is cached
        drop_cached_pages(data)
    graph = next(g for g in manifest.graphs.values() if g.file == source)
    return EngineGraph(source, graph.sha256 or sha256_file(root / source), engine.name, sha256_file(engine),
                       data.name if data.is_file() else None, data.stat().st_size if data.is_file() else 0, roles,
                       sample)


def write_failure(folder: Path) -> str | None:
    """Why writing into ``folder`` failed, where the system says so (ONNX Runtime's own message names neither): a
    file that reached this process's file size limit, or a device out of space; None when neither is the case."""
    import resource
    import shutil

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        full = next((p for p in folder.iterdir() if p.is_file() and p.stat().st_size >= limit), None)
        if full is not None:
            return f"writing {full.name} reached this process's file size limit ({limit} bytes, `ulimit -f`)"
    free = shutil.disk_usage(folder).free
    if free < WRITE_SLACK:
        return f"no space left on the device of {folder} ({free} bytes free)"
    return None


#: less free space than this after a failed write: the device is what filled up
WRITE_SLACK = 16 << 20


def drop_cached_pages(path: Path) -> None:
    """Write ``path`` to disk and drop its pages from the page cache (where the system allows it; a hint).

    The build leaves the engine's weights cached in the 4 KiB pages it wrote them in, and a session reading cached
    pages keeps them. Dropped, they are read again on the first session's first use, into 2 MiB pages where the
    engine's operators ask for them (``advise_huge`` in ``mla_deploy/ort/csrc/cpu_ops.c``): fewer TLB misses while a
    decode step streams them (``benchmarks/gemv_probe``). An engine without our operators keeps its pages cached: nothing
    in it asks for huge pages, so dropping them would only cost a read from disk."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def prepacked_kernels(manifest: Manifest) -> tuple[str, ...]:
    """The kernels whose pre-packed weights the engine of ``manifest``'s artifact stores: :data:`PREPACKED_KEPT` for
    float weights, none for quantized ones (ONNX Runtime 1.31.1 cannot read back ``MatMulNBits``'s)."""
    return () if manifest.quantization.quantized else PREPACKED_KEPT


def keep_prepacked(path: Path, kernels: tuple[str, ...]) -> int:
    """Drop from the ONNX graph at ``path`` the saved pre-packed weights of every kernel not in ``kernels``; returns
    how many were dropped.

    ONNX Runtime records a saved pre-packed weight in its initializer's ``external_data`` as ``prepacked_<i>`` =
    ``<kernel>+<hash>|<offset>;<length>;...``; without that entry the kernel packs the initializer at open. The bytes
    stay in the data file, unused."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    dropped = 0
    for tensor in model.graph.initializer:
        entries = list(tensor.external_data)
        kept = [e for e in entries if not e.key.startswith("prepacked") or e.value.split("+", 1)[0] in kernels]
        if len(kept) != len(entries):
            dropped += len(entries) - len(kept)
            del tensor.external_data[:]
            tensor.external_data.extend(kept)
    if dropped:
        path.write_bytes(model.SerializeToString())
    return dropped
