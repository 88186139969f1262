"""The ONNX Runtime engine: binds the latent cache and runs the artifact's graphs; the rest of the engine interface
(input checks, the cache state, prefill and decode for the generation loop) is :class:`Engine`'s.

* A growing (``concat``) cache is a NumPy array per layer ``[B, P, C]``, replaced by each step's present
  ``[B, P+S, C]``; ``attention_mask [B, P+S]`` marks the padded slots of shorter sequences.
* An in-place (``static``) cache is one ONNX Runtime buffer per layer ``[B, 1, capacity, C]`` bound as both
  ``past_latent.{i}`` and ``present_latent.{i}`` (IO binding), so ``TensorScatter`` writes the new rows in place
  and a decode step never copies the cache; ``write_indices [B]`` = rows already held. Its steps run through
  :mod:`.binding` (inputs and logits on the provider's device, bound once per step shape and state) and, on CUDA,
  replay a CUDA graph per decode binding (:mod:`.cuda`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..artifact import check_artifact
from .record import CPU_ENGINE_DIR, check_cpu_engine, host_cpu
from ..errors import ArtifactError, InputError, RuntimeMissingError, ShapeError
from ..io_spec import PRECISIONS
from ..quant import FAST_COMPUTE, FLOAT, Quantization
from ..engines.base import Engine
from .binding import Bindings, DeviceLogits, TokenChooser
from .cuda import CUDA, EAGER, FALLBACK_REFUSED, CudaOptions, CudaSession, GraphIds, off_device_nodes, \
    placement_error, providers, require_cuda
from .huge_pages import huge_pages
from .mapped import populate

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
#: ONNX's element type of bfloat16 (``TensorProto.BFLOAT16``): ONNX Runtime's Python API takes NumPy dtypes except
#: ``ml_dtypes.bfloat16``, which it names by this number instead
BF16_ELEMENT = 16
#: ONNX's element type numbers (``TensorProto``) of the artifact precisions
ONNX_ELEMENTS = {"fp32": 1, "fp16": 10, "bf16": BF16_ELEMENT}
#: with CUDA graphs, a state's capacity is rounded up to a multiple of this many rows (within the engine's
#: capacity): each (batch, capacity) is a graph of its own, and requests of every length would each capture one
GRAPH_CAPACITY_STEP = 256


def require_onnxruntime():
    """The ``onnxruntime`` module. Raises: RuntimeMissingError: it is not installed (one line saying how to install)."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise RuntimeMissingError("onnxruntime is not installed (pip install onnxruntime-gpu)") from exc
    return ort


def numpy_dtype(precision: str):
    """The NumPy dtype of ``precision`` (bf16 through ``ml_dtypes``)."""
    if precision == "bf16":
        try:
            import ml_dtypes

            return ml_dtypes.bfloat16
        except ImportError as exc:  # pragma: no cover - onnx depends on ml_dtypes
            raise RuntimeMissingError("bf16 caches need the ml_dtypes package") from exc
    return np.dtype(PRECISIONS[precision])


def element_type(dtype):
    """What ONNX Runtime's binding and allocation calls take for ``dtype``: the dtype itself, or ONNX's number for
    bfloat16 (which ONNX Runtime 1.31 cannot read from a NumPy dtype)."""
    return BF16_ELEMENT if np.dtype(dtype).name == "bfloat16" else dtype


def ortvalue(ort, array: np.ndarray, device: str = "cpu"):
    """``array`` as an ``OrtValue`` on ``device`` (a copy there unless ``device`` is the CPU and ``array`` is not
    bfloat16). bfloat16 goes in as its 16-bit pattern: ``OrtValue.ortvalue_from_numpy`` refuses ``ml_dtypes``."""
    if element_type(array.dtype) != BF16_ELEMENT:
        return ort.OrtValue.ortvalue_from_numpy(array, device, 0)
    value = ort.OrtValue.ortvalue_from_shape_and_type(list(array.shape), BF16_ELEMENT, device, 0)
    value.update_inplace(np.ascontiguousarray(array).view(np.uint16))
    return value


def host_array(ort, value, copy: bool = True) -> np.ndarray:
    """The tensor ``OrtValue`` ``value`` (on any device) as a host array; bfloat16 as ``ml_dtypes.bfloat16``, which
    ``OrtValue.numpy()`` cannot make. ``copy=False``: a view of a CPU value's buffer where one can be had (valid
    while ``value`` lives); a value off the CPU or in bfloat16 is copied either way."""
    if value.data_type() != "tensor(bfloat16)":
        return np.array(value.numpy()) if copy else value.numpy()
    host = np.empty(value.shape(), dtype=np.uint16)
    ort.OrtValue.ortvalue_from_numpy_with_onnx_type(host, BF16_ELEMENT).update_inplace(value)
    return host.view(numpy_dtype("bf16"))


def fresh_cpu_engine(artifact: str | Path, manifest):
    """The record of ``artifact``'s pre-built CPU engine when it is fresh for its ``manifest`` on this machine and
    this process's ONNX Runtime; None when it has none.

    Raises: ArtifactError: a stale or foreign engine (:func:`~mla_deploy.ort.record.check_cpu_engine`)."""
    ort = require_onnxruntime()
    return check_cpu_engine(artifact, manifest, host_cpu(ort.__version__))


def check_precision(precision: str, provider: str) -> None:
    """Refuse, before any session is opened, an artifact precision that ``provider`` has no kernels for.

    ONNX Runtime's CPU provider (1.31) has no bf16 kernels for the graphs' arithmetic (``MatMul``, ``Add``, ``Mul``,
    ``Sigmoid``, ``ReduceMax``): loading a bf16 graph on it fails with ``NOT_IMPLEMENTED``. This is the one place
    that rule lives; every ONNX Runtime engine (``run``, ``validate``, the whole-model bench) goes through it.

    Raises:
        RuntimeMissingError: bf16 on the CPU provider, in one line saying where bf16 runs.
    """
    if precision == "bf16" and provider == "cpu":
        raise RuntimeMissingError("bf16 artifacts need TensorRT or ONNX Runtime's CUDA provider; ONNX Runtime's CPU "
                                  "provider has no bf16 kernels (MatMul, Add, Mul, ...); export with --precision "
                                  "fp16 or fp32 to run on the CPU")


def session_options(threads: int | None = None, log_severity: int = 4, spin: bool = False):
    """ONNX Runtime session options as the engine uses them: ``threads`` intra-op threads (None: ORT's default)
    and no CPU memory arena: the arena keeps the largest step's activations and grows by powers of two, so a batch-8
    prefill of a 4-layer V2-Lite left the process at 13.5 GiB for 8.4 GiB of weights, against 10.9 GiB without
    it, at the same decode speed (measured here, 2 threads).

    ``spin``: the intra-op threads spin a while for the next operator's work instead of sleeping at once. A decode
    step is hundreds of short operators, each waking the other threads: spinning made a 4-layer V2-Lite int4 decode
    step about 4% faster (median of 6 alternating runs, 2 threads, 17.6 -> 16.8 ms). Off, a waiting thread leaves
    its core to others at once (a server's event loop on the same cores). How quantized weights are computed is the
    artifact's quantization's to say (:meth:`mla_deploy.quant.Quantization.session`, applied by
    :func:`open_session`)."""
    import onnxruntime as ort

    if threads is not None and (isinstance(threads, bool) or int(threads) != threads or threads < 1):
        raise InputError(f"threads must be an integer >= 1, got {threads!r}")
    options = ort.SessionOptions()
    options.log_severity_level = log_severity
    if threads:
        options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    options.enable_cpu_mem_arena = False
    return options


def _preload_cuda_libraries(ort) -> None:
    """Load the CUDA and cuDNN libraries of the ``nvidia-*`` wheels (torch's CUDA build ships them) before a CUDA
    session: onnxruntime-gpu looks for them only on the loader's path otherwise, and falls back to the CPU. What
    ``preload_dlls`` prints of libraries it could not find is dropped: a provider that still cannot load is
    refused below in one line."""
    import contextlib
    import io

    preload = getattr(ort, "preload_dlls", None)  # onnxruntime >= 1.21
    if preload is None:
        return
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            preload()
        except OSError:
            pass


def open_session(path: str | Path, provider: str = "cpu", threads: int | None = None, log_severity: int = 4,
                 quantized_compute: str = FAST_COMPUTE, quantization: Quantization = FLOAT, optimized: bool = False,
                 spin: bool = False, library: Path | None = None, cuda: CudaSession | None = None):
    """An ``InferenceSession`` on ``provider`` (``cpu``/``cuda``), refusing a silent fallback to another provider.
    ``threads``, ``log_severity``, ``spin``: :func:`session_options`.

    ``optimized``: ``path`` is a graph ONNX Runtime already optimised (a CPU engine's,
    :mod:`~mla_deploy.ort.cpu_build`): opened with graph optimisation disabled (``ORT_DISABLE_ALL``).
    ``library``: the operator library its graph needs (a CPU engine's :mod:`~mla_deploy.ort.operators`), or None.

    ``quantization``: the graph's (its artifact's :attr:`~mla_deploy.artifact.Manifest.quantization`), whose
    quantized products the session computes in ``quantized_compute``: ``int8`` quantizes the activations to int8
    per block inside each ``MatMulNBits`` (its fast path on CPU, as llama.cpp's ``Q8_0``/``Q4_0`` products do; about
    0.5% relative error per product), ``fp32`` multiplies in float32 with the dequantized weights (exact to float32
    rounding; several times slower, int8 weights about 30x): what validation compares with PyTorch.

    ``cuda``: on the CUDA provider, its options, the artifact's precision and whether the session may capture CUDA
    graphs (:class:`~mla_deploy.ort.cuda.CudaSession`; default: strict placement, no capture).

    Raises:
        RuntimeMissingError: onnxruntime missing, or the provider did not load. PlacementError: a node would fall
        back to the CPU (strict placement). ArtifactError: the graph does not load.
    """
    return _open(path, provider, threads, log_severity, quantized_compute, quantization, optimized, spin, library,
                 cuda)[0]


def _open(path, provider, threads, log_severity, quantized_compute, quantization, optimized, spin, library,
          cuda: CudaSession | None):
    """:func:`open_session`, returning ``(session, why)``: ``why`` says why CUDA graphs are off where the session
    was to capture them and ONNX Runtime refused (it is then opened without them), else None."""
    ort = require_onnxruntime()
    if provider not in PROVIDERS:
        raise InputError(f"provider must be one of {', '.join(PROVIDERS)}, got {provider!r}")
    wanted = PROVIDERS[provider]
    if wanted != "CPUExecutionProvider":  # a provider that fails to load logs through the default logger; the
        ort.set_default_logger_severity(max(log_severity, 3))  # fallback is reported below as one line instead
        _preload_cuda_libraries(ort)
    cuda = cuda or CudaSession()
    model, entries = quantization.session(path, quantized_compute)

    def options(strict: bool):
        made = session_options(threads, log_severity, spin)
        # ONNX Runtime's memory-reuse planning (which activation buffers may share memory) took 6 of the 10-15 s a
        # 4-layer V2-Lite int4 session needed to open, and grows faster than the graph; without it: open in 7.6-9.3
        # s, the same tokens, decode as fast, peak RSS no higher (a 4 x 256 prefill: 2.04 GiB against 2.39),
        # measured on the CPU here
        made.enable_mem_reuse = provider != "cpu"
        if optimized:
            made.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        if library is not None:
            from .operators import register

            register(made, library)
        added = {**entries, **(cuda.options.session_entries(strict) if wanted == CUDA else {})}
        for key, value in added.items():
            made.add_session_config_entry(key, value)
        return made

    session, why = _create(ort, Path(path).name, model, options, wanted, cuda)
    if session.get_providers()[0] != wanted:
        raise RuntimeMissingError(f"ONNX Runtime could not use {wanted} (it fell back to "
                                  f"{session.get_providers()[0]}); run `mla-deploy doctor`")
    return session, why


def _create(ort, name: str, model, options, wanted: str, cuda: CudaSession):
    """The session of :func:`_open` and why CUDA graphs are off (None if not refused). ``options(strict)``: its
    session options, with or without the refusal of CPU nodes."""
    capture = wanted == CUDA and cuda.capturing
    try:
        return ort.InferenceSession(model, options(True), providers=providers(wanted, cuda, capture)), None
    except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if wanted == CUDA and FALLBACK_REFUSED in first:
            raise _placement_refusal(ort, name, model, options) from None
        if not capture:
            raise ArtifactError(f"ONNX Runtime cannot load {name}: {first}") from exc
    # ONNX Runtime checks at load that a graph can be captured (every node on CUDA, no copy node, no control flow):
    # the same graph without CUDA graphs may still run
    why = f"ONNX Runtime refused CUDA graphs for {name}: {first[:200]}"
    try:
        return ort.InferenceSession(model, options(True), providers=providers(wanted, cuda, False)), why
    except Exception as again:
        first = (str(again).strip().splitlines() or [type(again).__name__])[0]
        raise ArtifactError(f"ONNX Runtime cannot load {name}: {first}") from again


def _placement_refusal(ort, name: str, model, options) -> Exception:
    """Why a strict CUDA session was refused, in one line: the CUDA provider did not load at all (every node then
    falls to the CPU), or the graph's nodes that it cannot run."""
    try:
        require_cuda(ort)
    except RuntimeMissingError as missing:
        return missing
    try:
        counts = off_device_nodes(ort, model, options(False))
    except Exception:  # the diagnosis is best effort: the refusal stands without its list
        import collections

        counts = collections.Counter()
    return placement_error(name, counts)


class _Rows:
    """Rows ``start .. stop - 1`` (the batch axis) of an in-place cache ``OrtValue``: the same memory, bound by
    address (:meth:`OrtEngine._rows`). Attributes: ``value`` (the whole buffer), ``start``, ``stop``, ``shape``,
    ``address``."""

    def __init__(self, value, start: int, stop: int):
        base, offset = (value.value, value.start) if isinstance(value, _Rows) else (value, 0)
        shape = base.shape()
        row_bytes = base.tensor_size_in_bytes() // shape[0]
        self.value, self.start, self.stop = base, offset + start, offset + stop
        self.shape = [stop - start, *shape[1:]]
        self.address = base.data_ptr() + self.start * row_bytes


class OrtEngine(Engine):
    """Runs an exported artifact with ONNX Runtime.

    Args:
        artifact: the export directory (holding ``manifest.json``).
        provider: ``cpu`` or ``cuda``; an engine whose session falls back to another provider is refused.
        threads: intra-op threads (None: ONNX Runtime's default).
        capacity: static layouts: cache rows per sequence (default: the manifest's ``max_cache_length``).
        log_severity: ONNX Runtime's log level (0 verbose .. 4 fatal; default 4: its errors come back as
            exceptions, reported as one line).
        quantized_compute: quantized weights: ``int8`` (activations quantized per block, the fast path) or
            ``fp32`` (exact); see :func:`open_session`.
        use_engine: on the CPU provider with the fast ``quantized_compute``, open the artifact's pre-built CPU engine
            (``ARTIFACT/cpu``, ``mla-deploy build ARTIFACT --target cpu``) instead of the source graphs when it has
            one; a stale or foreign engine is refused (:func:`~mla_deploy.ort.record.check_cpu_engine`).
            False: always the source graphs. :meth:`info` says which (``graphs``).
        spin: the intra-op threads spin for the next operator's work (:func:`session_options`); False for an
            engine sharing its cores with other work (a server's event loop).
        prefill_chunk: the most prompt tokens per sequence in one prefill call (None: as many as keep one layer's
            attention scores within 1 GiB; :meth:`Engine.prefill <mla_deploy.engines.base.Engine.prefill>`).
        cuda: the CUDA provider's options (:class:`~mla_deploy.ort.cuda.CudaOptions`: CUDA graphs, fpA_intB,
            strict placement; default: all on but fpA_intB at ONNX Runtime's default). Ignored on the CPU.

    With an in-place cache every step runs through :class:`~mla_deploy.ort.binding.Bindings`: inputs, logits and
    caches in ``OrtValue`` buffers on the provider's device, bound once per ``(role, batch, state)`` and refreshed
    in place; on CUDA each decode binding is captured as a CUDA graph and replayed (``info()["cuda_graph"]`` says
    whether, or why not), and tokens are chosen on the GPU (:meth:`choose_tokens_on_device`).

    The artifact is checked first (:func:`~mla_deploy.artifact.check_artifact` without hashing: its manifest
    describes its graphs, their I/O and the weights they hold quantized).
    """

    def __init__(self, artifact: str | Path, provider: str = "cpu", threads: int | None = None,
                 capacity: int | None = None, log_severity: int = 4, quantized_compute: str = FAST_COMPUTE,
                 use_engine: bool = True, spin: bool = True, prefill_chunk: int | None = None,
                 cuda: CudaOptions | None = None):
        ort = require_onnxruntime()
        if provider not in PROVIDERS:
            raise InputError(f"provider must be one of {', '.join(PROVIDERS)}, got {provider!r}")
        manifest = check_artifact(artifact, verify_hashes=False)
        check_precision(manifest.precision, provider)
        super().__init__(artifact, manifest, capacity, prefill_chunk)
        self.ort = ort
        self.dtype = numpy_dtype(self.precision)
        self.device = "cuda" if provider == "cuda" else "cpu"
        self.cuda = (cuda or CudaOptions()) if provider == "cuda" else None
        self.device_id = self.cuda.device_id if self.cuda else 0
        self.element = element_type(self.dtype)
        self.onnx_element = ONNX_ELEMENTS[self.precision]
        self.log_severity = log_severity
        self.run_options = self.new_run_options(None)
        self.built = None  # the CPU engine's record when its graphs are run
        if use_engine and provider == "cpu" and quantized_compute == FAST_COMPUTE:
            self.built = fresh_cpu_engine(self.root, manifest)
        # CUDA graphs replay fixed addresses: only an in-place cache keeps them (a concat cache grows every step)
        capturing = self.cuda is not None and self.cuda.cuda_graph and self.layout.in_place
        refused = self._open_sessions(provider, threads, quantized_compute, spin, capturing)
        self.provider = PROVIDERS[provider]
        reason = refused or ("the concat cache grows every step; export with --cache-mode static"
                             if self.cuda is not None and self.cuda.cuda_graph and not self.layout.in_place else None)
        self.graphs = GraphIds(capturing and not refused, reason)
        self.bindings = Bindings(self)
        self.chooser = None
        self.choose_tokens_on_device(provider == "cuda")
        self._spare = None  # a dropped state's caches, kept for the next state of the same shape (new_state)
        # the CPU engine's weights, which ONNX Runtime maps from its files and its operators read in place: faulted
        # in now rather than by the first steps that read each expert (mla_deploy.ort.mapped). Not the source
        # graphs': ONNX Runtime copies or packs what it computes with, and their mapped files would only be read.
        self.populated = populate(self.root / CPU_ENGINE_DIR) if self.built is not None else None
        # read once, with the weights loaded: /proc/self/smaps_rollup walks every mapping, not for each generation
        self.huge_pages = huge_pages().describe()

    def _open_sessions(self, provider: str, threads, quantized_compute: str, spin: bool, capturing: bool):
        """One session per graph file of the manifest, checked against it (``self.sessions``, by role); returns
        why ONNX Runtime refused to capture CUDA graphs (None: it did not)."""
        manifest, refused = self.manifest, None
        self.sessions = {}
        for role, graph in manifest.graphs.items():
            if graph.uses_plugin:
                raise RuntimeMissingError(f"{graph.file} holds the TensorRT MlaDecode plugin node, which ONNX "
                                          f"Runtime cannot run; export with [export] decode_attention = \"standard\" "
                                          f"for ONNX Runtime, or build it with `mla-deploy build`")
            # one session per graph file: a graph serving prefill and decode holds its weights once
            session = next((v for r, v in self.sessions.items() if manifest.graph(r).file == graph.file), None)
            if session is None:
                # a CUDA graph is captured for decode only (a prefill's width changes with every prompt)
                decode = any(g.file == graph.file for r, g in manifest.graphs.items() if r == "decode")
                cuda = CudaSession(self.cuda, self.precision, capturing and decode) if self.cuda else None
                library = None if self.built is None else self.built.library_path(self.root)
                session, why = _open(self._graph_path(graph.file), provider, threads, self.log_severity,
                                     quantized_compute, manifest.quantization, self.built is not None, spin, library,
                                     cuda)
                refused = refused or why
            names = [i.name for i in session.get_inputs()], [o.name for o in session.get_outputs()]
            if names != (graph.input_names, graph.output_names):
                raise ArtifactError(f"{graph.file} does not match manifest.json: graph inputs/outputs {names}, "
                                    f"manifest {(graph.input_names, graph.output_names)}")
            self.sessions[role] = session
        return refused

    def choose_tokens_on_device(self, on: bool = True) -> None:
        """Choose greedy and sampled tokens with the token-choice graphs on this engine's provider
        (:class:`~mla_deploy.ort.binding.TokenChooser`: only ``[B]`` ids come back to the host) or, ``on`` False,
        on the host from a copy of the logits. On by default on the CUDA provider; on the CPU it runs the very
        graphs the GPU runs (what the tests compare with the host's choice). In-place caches only."""
        self.chooser = TokenChooser(self) if on and self.layout.in_place else None

    def _graph_path(self, file: str) -> Path:
        """What runs the artifact's graph ``file``: its CPU engine's graph, or the file itself."""
        return self.root / file if self.built is None else self.built.engine_path(self.root, file)

    def info(self) -> dict:
        """:meth:`Engine.info`, ``graphs``: ``engine ARTIFACT/cpu`` (the pre-built CPU engine) or ``source graphs``,
        ``huge_pages``: how much of the process's memory was on huge pages once the weights were loaded
        (:mod:`~mla_deploy.ort.huge_pages`), and with a CPU engine ``mapped_weights``: its mapped files
        faulted in when it opened (:mod:`~mla_deploy.ort.mapped`)."""
        graphs = f"engine {self.root / CPU_ENGINE_DIR}" if self.built is not None else "source graphs"
        info = {**super().info(), "graphs": graphs, "huge_pages": self.huge_pages}
        if self.populated is not None:
            info["mapped_weights"] = self.populated.describe()
        if self.built is not None:
            info["operators"] = self.built.operators.describe()
            info["scales_half"] = self.built.operators.scales_half
        if self.cuda is not None:
            info["cuda"] = self.cuda.describe()
            info["cuda_graph"] = self.graphs.describe()
        info["token_choice"] = "device" if self.chooser is not None else "host"
        return info

    # buffers, bindings and token choice --------------------------------------------------------------------------
    def new_run_options(self, graph_id: int | None):
        """Run options of one session run; ``graph_id``: its CUDA graph (:data:`~.cuda.EAGER`: none) on a
        session that may capture, None where no graph is involved."""
        options = self.ort.RunOptions()
        options.log_severity_level = self.log_severity
        # a session that may capture captures a run without an id as graph 0: every run of one names its graph,
        # or -1 (eager); sessions that never capture get no id
        graphs = getattr(self, "graphs", None)
        if graph_id is not None and graphs is not None and graphs.enabled:
            options.add_run_config_entry("gpu_graph_id", str(graph_id))
        return options

    def open_helper_session(self, model: bytes):
        """A session of a small graph built here (token choice) on this engine's provider and options, never
        capturing CUDA graphs."""
        options = session_options(1, self.log_severity)
        if self.cuda is not None:
            for key, value in self.cuda.session_entries().items():
                options.add_session_config_entry(key, value)
        try:
            session = self.ort.InferenceSession(model, options, providers=providers(
                self.provider, CudaSession(self.cuda) if self.cuda else None, False))
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise RuntimeMissingError(f"the token-choice graph does not run on {self.provider}: {first[:200]}") from exc
        return session

    def new_state(self, batch: int, rows: int | None = None):
        """:meth:`Engine.new_state`, reusing the caches of the last dropped state of the same shape (their device
        addresses, and so their bindings and CUDA graphs, stay the same); with CUDA graphs ``rows`` is rounded up to
        a multiple of :data:`GRAPH_CAPACITY_STEP`. A reused cache keeps what its last state wrote beyond each
        sequence's rows: those slots are masked out until written."""
        if rows is not None and self.graphs.enabled and self.capacity:
            rows = min(self.capacity, -(-int(rows) // GRAPH_CAPACITY_STEP) * GRAPH_CAPACITY_STEP)
        state = super().new_state(batch, rows)  # _allocate takes the spare caches where their shape is asked for
        if self.layout.in_place:
            import weakref

            self._spare = None
            weakref.finalize(state, self._keep_spare, state.caches)
        return state

    def _keep_spare(self, caches) -> None:
        self._spare = list(caches)

    def _allocate(self, shape):
        if self._spare and list(self._spare[0].shape()) == list(shape):
            return self._spare.pop(0)
        array = np.zeros(shape, dtype=self.dtype)
        if not self.layout.in_place:
            return array
        return ortvalue(self.ort, array, self.device)

    def argmax(self, logits) -> np.ndarray:
        if self.chooser is not None and isinstance(logits, DeviceLogits) and len(logits.shape) == 2:
            return self.chooser.argmax(logits)
        if isinstance(logits, DeviceLogits) and self.device == "cpu":  # a view of the buffer, no copy
            return host_array(self.ort, logits.value, copy=False).reshape(logits.shape).argmax(-1).astype(np.int64)
        return super().argmax(logits)

    def sample(self, logits, config, uniforms) -> np.ndarray:
        if self.chooser is not None and isinstance(logits, DeviceLogits) and len(logits.shape) == 2:
            return self.chooser.sample(logits, config, uniforms)
        return super().sample(logits, config, uniforms)

    def to_host(self, array) -> np.ndarray:
        # a copy: the NumPy view of an OrtValue (or of a cache's buffer) dies with the state that holds it
        if isinstance(array, DeviceLogits):
            return array.host()
        return host_array(self.ort, array) if isinstance(array, self.ort.OrtValue) else np.array(array)

    def _sliceable(self, cache):
        # an OrtValue cannot be sliced: a view of its buffer (a copy off the CPU or in bfloat16), valid while the
        # state lives (the slice is copied)
        if isinstance(cache, _Rows):
            return host_array(self.ort, cache.value, copy=False)[cache.start: cache.stop]
        return host_array(self.ort, cache, copy=False) if isinstance(cache, self.ort.OrtValue) else cache

    def _rows(self, cache, start, stop):
        return _Rows(cache, start, stop)

    def _host_view(self, cache) -> np.ndarray:
        # an in-place cache on the CPU is host memory: NumPy's view of the OrtValue writes it
        if self.device != "cpu" or not self.layout.in_place or element_type(self.dtype) == BF16_ELEMENT:
            raise RuntimeMissingError(f"copying latent cache rows (n > 1, the prefix cache) runs on the CPU "
                                      f"provider; this engine's cache is on {self.device}")
        if isinstance(cache, _Rows):
            return host_array(self.ort, cache.value, copy=False)[cache.start: cache.stop]
        return host_array(self.ort, cache, copy=False)

    def _run(self, role, ids, positions, logits_index, control, state):
        session = self.sessions[role]
        if not self.layout.in_place:
            feed = {"input_ids": ids, "position_ids": positions, "logits_index": logits_index,
                    self.layout.control: control}
            for tensor, cache in zip(self.cache_tensors, state.caches, strict=True):
                if cache.shape[-1] != tensor.width:
                    raise ShapeError(f"{tensor.past} has width {cache.shape[-1]}, expected {tensor.width}")
                feed[tensor.past] = cache
            if element_type(self.dtype) != BF16_ELEMENT:
                results = self._execute(role, lambda: session.run(None, feed, self.run_options))
                return results[0], results[1:]
            # bfloat16 in and out as OrtValues: session.run takes and returns NumPy arrays of NumPy's own dtypes only
            values = {name: ortvalue(self.ort, np.asarray(array)) for name, array in feed.items()}
            results = self._execute(role, lambda: session.run_with_ort_values(None, values, self.run_options))
            results = [host_array(self.ort, value) for value in results]
            return results[0], results[1:]
        # decode only: a prefill's width changes with every prompt, so it would capture a graph per request
        graph_id = self.graphs.id_for if role == "decode" else (lambda key: EAGER)
        step = self.bindings.get(role, session, ids, positions, logits_index, self.layout.control, control,
                                 state.caches, graph_id)
        self._execute(role, lambda: self._run_step(step))
        return DeviceLogits(self, step.logits, step.logits.shape()), state.caches

    def _run_step(self, step) -> None:
        """One run of a binding; a CUDA graph's capture that fails leaves that binding without a graph (and says
        why in ``info()``), and the step runs again without one: its in-place writes are the same rows with the
        same values, so running it twice is harmless."""
        if step.graph_id == EAGER or step.captured:
            return step.run()
        try:
            step.run()
        except self._ort_errors as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            self.graphs.capture_failed(step.key, first[:200])
            step.graph_id, step.run_options = EAGER, self.new_run_options(EAGER)
            return step.run()
        step.captured = True

    def _execute(self, role: str, call):
        """``call()`` (one session run); ONNX Runtime's own failure becomes an :class:`ArtifactError` naming the
        graph: inputs were checked against the manifest, so the graph and its manifest disagree."""
        try:
            return call()
        except self._ort_errors as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ArtifactError(f"ONNX Runtime failed running {self.manifest.graph(role).file} ({first[:300]}); "
                                f"does manifest.json still describe this graph? Re-export the artifact") from None

    @property
    def _ort_errors(self) -> tuple[type[BaseException], ...]:
        from onnxruntime.capi import onnxruntime_pybind11_state as state

        return (state.Fail, state.InvalidArgument, state.RuntimeException, state.InvalidGraph, RuntimeError)
