"""The record of an artifact's pre-built ONNX Runtime CPU engine (``ART/cpu/engine.json``): what the engine is tied to,
and the check that refuses one built for something else.

``mla-deploy build ART --target cpu`` (:func:`mla_deploy.ort.cpu_build.build_cpu_engine`) writes ``ART/cpu/``:
per graph file of the artifact, the graph ONNX Runtime optimised once (``model.onnx``) and its weights and pre-packed
weights (``model.data``), and this record. An engine is only valid for:

* the ONNX Runtime version that built it (its optimised graph holds ORT's own fused operators and its pre-packed
  weights ORT's private layouts);
* the CPU it was built on: the machine architecture and the instruction-set features ORT's kernels choose their
  code paths and packed layouts by (:data:`CPU_FEATURES`, as :func:`mla_deploy.host.cpu_flags` reads them);
* the source graphs (their sha256 in the manifest, and the file's own sha256 at build), the model's fingerprint and
  the shared weights file's recorded sha256;
* its own files: each engine graph's sha256 and each data file's size (the data file is not hashed at open: it is
  as large as the weights);
* the session settings baked in (:data:`SESSION`): optimised at ``ORT_ENABLE_ALL`` with quantized products in the
  fast compute (``int8``, ``accuracy_level`` 4), opened with graph optimisation disabled;
* where its graphs hold mla-deploy's own operators (:mod:`mla_deploy.ort.operators`): the operator library
  compiled into ``cpu/`` (its sha256) from the operator source of this mla-deploy (its sha256).

:meth:`CpuEngineRecord.staleness` names the first difference; :func:`check_cpu_engine` turns it into one line.
This module imports neither onnxruntime nor onnx: the caller passes the running ORT version.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..errors import ArtifactError
from ..host import cpu_flags, machine
from ..artifact.files import atomic_write_text, sampled_sha256, sha256_file
from ..artifact.manifest import Manifest

CPU_ENGINE_DIR = "cpu"
CPU_ENGINE_RECORD = "engine.json"
RECORD_FORMAT = "mla-deploy-cpu-engine"
RECORD_VERSION = 3
#: the ``/proc/cpuinfo`` flags ONNX Runtime's CPU kernels (MLAS) dispatch on, x86-64 and Arm
CPU_FEATURES = ("sse3", "ssse3", "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq",
                "avx512vl", "avx512cd", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avxvnni", "avx_vnni_int8",
                "amx_tile", "amx_int8", "amx_bf16", "amx_fp16", "asimd", "asimddp", "asimdhp", "fphp", "i8mm", "bf16",
                "sve", "sve2", "sme")
#: the session settings an engine bakes in (recorded in every engine and compared at open)
SESSION = {"built_with": "ORT_ENABLE_ALL", "opened_with": "ORT_DISABLE_ALL", "quantized_compute": "int8",
           "accuracy_level": 4}


@dataclass(frozen=True)
class HostCpu:
    """What an engine depends on in the machine and runtime that open it.

    Attributes:
        onnxruntime: ONNX Runtime's version.
        machine: the architecture (:func:`mla_deploy.host.machine`: ``x86_64``, ``aarch64``).
        features: the :data:`CPU_FEATURES` this CPU has, sorted.
    """

    onnxruntime: str
    machine: str
    features: tuple[str, ...]


def host_cpu(onnxruntime_version: str) -> HostCpu:
    """This machine as an engine sees it, with ``onnxruntime_version`` (the running ORT's ``__version__``)."""
    flags = cpu_flags()
    return HostCpu(onnxruntime_version, machine(), tuple(sorted(f for f in CPU_FEATURES if f in flags)))


@dataclass(frozen=True)
class EngineGraph:
    """One engine graph: built from the artifact's ``source`` graph file (serving ``roles``).

    Attributes:
        source, source_sha256: the artifact's graph file and its sha256 when the engine was built.
        engine, engine_sha256: the optimised graph in ``cpu/`` and its sha256.
        data, data_bytes: its weights and pre-packed weights file in ``cpu/`` and its size.
        roles: ``prefill``/``decode``, as the manifest assigns them to ``source``.
        data_sample: :func:`~mla_deploy.artifact.files.sampled_sha256` of ``data`` ("" where there is none, or where
            an older mla-deploy wrote the record).
    """

    source: str
    source_sha256: str
    engine: str
    engine_sha256: str
    data: str | None
    data_bytes: int
    roles: tuple[str, ...]
    data_sample: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "source_sha256": self.source_sha256, "engine": self.engine,
                "engine_sha256": self.engine_sha256, "data": self.data, "data_bytes": self.data_bytes,
                "data_sample": self.data_sample, "roles": list(self.roles)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "EngineGraph":
        return cls(str(data["source"]), str(data["source_sha256"]), str(data["engine"]), str(data["engine_sha256"]),
                   None if data.get("data") is None else str(data["data"]), int(data["data_bytes"]),
                   tuple(str(r) for r in data["roles"]), str(data.get("data_sample", "")))


@dataclass(frozen=True)
class CpuOperators:
    """mla-deploy's own operators in the engine (:mod:`mla_deploy.ort.operators`).

    Attributes:
        experts: how many ``QMoE`` nodes the build swapped for ``mla_deploy.RoutedExperts``.
        linear: how many ``MatMulNBits`` nodes it swapped for ``mla_deploy.BlockwiseMatMul``.
        library, library_sha256: the operator library in ``cpu/`` and its sha256 (None when nothing was swapped).
        source_sha256: the sha256 of the operator source it was compiled from.
        why_not: why the build swapped nothing (no compiler, no source, none of the operators' fast paths), or None.
        heads: how many per-head products (``DequantizeLinear -> Transpose -> MatMul``) it swapped for
            ``mla_deploy.HeadwiseMatMul`` (a record without the field: none).
        attention: how many layers' attention cores it swapped for ``mla_deploy.LatentAttention`` (their per-head
            products inside them, no longer counted in ``heads``; a record without the field: none).
        float_experts: how many float ``MoE`` nodes it swapped for ``mla_deploy.FloatExperts`` (a record without the
            field: none).
        half_scales: how many of the swapped nodes' scale tensors it stores as float16, exactly
            (:func:`~mla_deploy.ort.swaps.store_half_scales`; a record without the field: none).
        float_linear: how many ``MatMul`` nodes of a float32 weight it swapped for ``mla_deploy.FloatMatMul``
            (:func:`~mla_deploy.ort.swaps.swap_float_linear`; a record without the field: none).
        shared: how many of the ``RoutedExperts`` nodes compute their layer's shared experts too
            (:func:`~mla_deploy.ort.swaps.fold_shared_experts`: three products each, not counted in ``linear``;
            a record without the field: none).
        isa: the instruction set of the library's integer products (:data:`mla_deploy.ort.operators.FAST_PATHS`:
            ``avx512-vnni``, ``avx-vnni``, ``avx2``; None when nothing was swapped; a record without the field and
            with a library: ``avx512-vnni``, the only one mla-deploy compiled before it recorded this).
    """

    experts: int = 0
    linear: int = 0
    library: str | None = None
    library_sha256: str | None = None
    source_sha256: str | None = None
    why_not: str | None = None
    heads: int = 0
    attention: int = 0
    float_experts: int = 0
    half_scales: int = 0
    float_linear: int = 0
    shared: int = 0
    isa: str | None = None

    @property
    def scales_half(self) -> bool:
        """Every scale tensor of the engine's ``RoutedExperts`` and ``BlockwiseMatMul`` nodes is float16."""
        return bool(self.half_scales) and self.half_scales == 2 * self.experts + 3 * self.shared + self.linear

    @property
    def used(self) -> bool:
        return bool(self.experts or self.linear or self.heads or self.attention or self.float_experts
                    or self.float_linear)

    def to_dict(self) -> dict[str, Any]:
        return {"experts": self.experts, "linear": self.linear, "heads": self.heads, "attention": self.attention,
                "float_experts": self.float_experts, "half_scales": self.half_scales,
                "float_linear": self.float_linear, "shared": self.shared, "library": self.library,
                "library_sha256": self.library_sha256, "source_sha256": self.source_sha256, "why_not": self.why_not,
                "isa": self.isa}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CpuOperators":
        return cls(int(data["experts"]), int(data["linear"]), data.get("library"), data.get("library_sha256"),
                   data.get("source_sha256"), data.get("why_not"), int(data.get("heads", 0)),
                   int(data.get("attention", 0)), int(data.get("float_experts", 0)), int(data.get("half_scales", 0)),
                   int(data.get("float_linear", 0)), int(data.get("shared", 0)),
                   data.get("isa", "avx512-vnni" if data.get("library") else None))

    def describe(self) -> str:
        """One phrase: which of our operators the engine holds, how many of each, and their library."""
        if not self.used:
            return f"ONNX Runtime's only ({self.why_not})" if self.why_not else "ONNX Runtime's only"
        counts = (("RoutedExperts", self.experts), ("BlockwiseMatMul", self.linear), ("HeadwiseMatMul", self.heads),
                  ("LatentAttention", self.attention), ("FloatExperts", self.float_experts),
                  ("FloatMatMul", self.float_linear))
        half = f", {self.half_scales} scale tensors as float16" if self.half_scales else ""
        shared = f", {self.shared} with their layer's shared experts" if self.shared else ""
        isa = f", instruction set {self.isa}" if self.isa else ""
        return ", ".join(f"mla_deploy.{name} x{n}" for name, n in counts if n) + f" ({self.library}{isa}{shared}{half})"


@dataclass(frozen=True)
class CpuEngineRecord:
    """``cpu/engine.json``: what the engine was built from, by and for (see the module's docstring).

    Attributes:
        host: the ONNX Runtime version and CPU that built it.
        fingerprint: the manifest's model fingerprint.
        weights_sha256: the manifest's sha256 of the shared weights file (None: weights inside the graphs, or not
            recorded).
        graphs: one :class:`EngineGraph` per source graph file.
        session: the session settings baked in (:data:`SESSION` at build).
        prepacked: the kernels whose pre-packed weights the engine stores; every other kernel packs at open.
        created: ISO time of the build; build_seconds: how long it took.
        operators: mla-deploy's own operators in its graphs (:class:`CpuOperators`).
    """

    host: HostCpu
    fingerprint: str
    weights_sha256: str | None
    graphs: tuple[EngineGraph, ...]
    session: dict = field(default_factory=lambda: dict(SESSION))
    prepacked: tuple[str, ...] = ()
    created: str = ""
    build_seconds: float = 0.0
    operators: CpuOperators = field(default_factory=CpuOperators)

    def library_path(self, artifact: str | Path) -> Path | None:
        """The operator library every session of this engine registers, or None."""
        return None if not self.operators.used else Path(artifact) / CPU_ENGINE_DIR / str(self.operators.library)

    def graph_for(self, source: str) -> EngineGraph | None:
        """The engine graph built from the artifact's graph file ``source``."""
        return next((g for g in self.graphs if g.source == source), None)

    def engine_path(self, artifact: str | Path, source: str) -> Path:
        """The engine graph file that runs the artifact's graph file ``source``.

        Raises: ArtifactError: the engine has none (a fresh engine has one for each: see :meth:`staleness`)."""
        graph = self.graph_for(source)
        if graph is None:
            raise ArtifactError(f"the CPU engine in {Path(artifact) / CPU_ENGINE_DIR} has no graph built from {source}")
        return Path(artifact) / CPU_ENGINE_DIR / graph.engine

    def to_dict(self) -> dict[str, Any]:
        return {"format": RECORD_FORMAT, "format_version": RECORD_VERSION, "onnxruntime": self.host.onnxruntime,
                "machine": self.host.machine, "cpu_features": list(self.host.features),
                "fingerprint": self.fingerprint, "weights_sha256": self.weights_sha256,
                "graphs": [g.to_dict() for g in self.graphs], "session": dict(self.session),
                "prepacked": list(self.prepacked), "created": self.created, "build_seconds": self.build_seconds,
                "operators": self.operators.to_dict()}

    @classmethod
    def from_dict(cls, data: Any, source: str = CPU_ENGINE_RECORD) -> "CpuEngineRecord":
        """Raises: ArtifactError: not a CPU engine record, another format version, or a malformed field."""
        if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT:
            raise ArtifactError(f"{source} is not an mla-deploy CPU engine record")
        if data.get("format_version") != RECORD_VERSION:
            raise ArtifactError(f"{source} was written by another mla-deploy (format_version "
                                f"{data.get('format_version')!r})")
        try:
            for key in ("cpu_features", "graphs", "prepacked"):
                if not isinstance(data.get(key, []), list):
                    raise TypeError(f"{key} must be a list, got {data[key]!r}")
            host = HostCpu(str(data["onnxruntime"]), str(data["machine"]), tuple(map(str, data["cpu_features"])))
            return cls(host, str(data["fingerprint"]), data.get("weights_sha256"),
                       tuple(EngineGraph.from_dict(g) for g in data["graphs"]), dict(data["session"]),
                       tuple(map(str, data.get("prepacked", ()))), str(data.get("created", "")),
                       float(data.get("build_seconds", 0.0)), CpuOperators.from_dict(data["operators"]))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ArtifactError(f"{source} is malformed ({type(exc).__name__}: {exc})") from None

    def staleness(self, root: Path, manifest: Manifest, host: HostCpu) -> str | None:
        """What makes this engine unusable for the artifact at ``root`` (its ``manifest``) on ``host``, or None.

        Compares, in this order: the ONNX Runtime version, the architecture, the CPU features, the baked session
        settings, the model (fingerprint, weights sha256), each source graph (the manifest's sha256 and the file's
        own), each engine file (graph sha256, data file size and sampled digest), its own operators (their source,
        their library)."""
        for differs in (_host_difference(self.host, host), _session_difference(self.session),
                        _model_difference(self, manifest)):
            if differs:
                return differs
        return _files_difference(self, root, manifest) or _operator_difference(self, root)


def _host_difference(built: HostCpu, host: HostCpu) -> str | None:
    if built.onnxruntime != host.onnxruntime:
        return f"it was built with ONNX Runtime {built.onnxruntime}, this is ONNX Runtime {host.onnxruntime}"
    if built.machine != host.machine:
        return f"it was built on {built.machine}, this machine is {host.machine}"
    if built.features != host.features:
        lacks, adds = sorted(set(built.features) - set(host.features)), sorted(set(host.features) - set(built.features))
        parts = ([f"this CPU lacks {', '.join(lacks)}"] if lacks else []) + ([f"has {', '.join(adds)}"] if adds else [])
        return f"it was built on another CPU ({'; '.join(parts)})"
    return None


def _session_difference(session: Mapping[str, Any]) -> str | None:
    changed = sorted(k for k in set(SESSION) | set(session) if session.get(k) != SESSION.get(k))
    if changed:
        return (f"its session settings ({', '.join(f'{k}={session.get(k)!r}' for k in changed)}) are not this "
                f"mla-deploy's ({', '.join(f'{k}={SESSION.get(k)!r}' for k in changed)})")
    return None


def _model_difference(record: CpuEngineRecord, manifest: Manifest) -> str | None:
    if record.fingerprint != manifest.fingerprint:
        return f"it was built for another model (fingerprint {record.fingerprint}, the artifact's {manifest.fingerprint})"
    weights = (manifest.weights_data or {}).get("sha256")
    if record.weights_sha256 != weights:
        return "the artifact's weights file changed since it was built (its sha256 in manifest.json differs)"
    sources = {g.file for g in manifest.graphs.values()}
    if sources != {g.source for g in record.graphs}:
        return f"it was built for the graphs {sorted(g.source for g in record.graphs)}, the artifact has {sorted(sources)}"
    return None


def _files_difference(record: CpuEngineRecord, root: Path, manifest: Manifest) -> str | None:
    folder = root / CPU_ENGINE_DIR
    for graph in record.graphs:
        recorded = {g.sha256 for g in manifest.graphs.values() if g.file == graph.source}
        if recorded != {graph.source_sha256} or sha256_file(root / graph.source) != graph.source_sha256:
            return f"the source graph {graph.source} changed since it was built"
        engine = folder / graph.engine
        if not engine.is_file():
            return f"its graph {engine} is missing"
        if sha256_file(engine) != graph.engine_sha256:
            return f"its graph {engine} was modified (sha256 differs from {CPU_ENGINE_RECORD})"
        if graph.data is None:
            data = folder / f"{Path(graph.engine).stem}.data"
            if data.exists():
                return f"{CPU_ENGINE_RECORD} names no weights file for {engine}, but {data} exists (an edited record)"
            continue
        data = folder / graph.data
        if not data.is_file():
            return f"its weights {data} are missing"
        if data.stat().st_size != graph.data_bytes:
            return (f"its weights {data} have {data.stat().st_size} bytes, {CPU_ENGINE_RECORD} says "
                    f"{graph.data_bytes} (truncated or replaced)")
        if not graph.data_sample:
            return f"{CPU_ENGINE_RECORD} holds no sample digest of {data} (an older mla-deploy built it)"
        if sampled_sha256(data) != graph.data_sample:
            return (f"its weights {data} were modified (a sample of their pages differs from {CPU_ENGINE_RECORD}'s "
                    f"digest)")
    return None


def _operator_difference(record: CpuEngineRecord, root: Path) -> str | None:
    operators = record.operators
    if not operators.used:
        return None
    from .operators import source_path  # no heavy import: paths only

    source = source_path()
    if source.is_file() and sha256_file(source) != operators.source_sha256:
        return f"its operators were compiled from another version of {source.name}"
    library = record.library_path(root)
    if not library.is_file():
        return f"its operator library {library} is missing"
    if sha256_file(library) != operators.library_sha256:
        return f"its operator library {library} was modified (sha256 differs from {CPU_ENGINE_RECORD})"
    return None


def write_cpu_engine_record(folder: str | Path, record: CpuEngineRecord) -> Path:
    """Write ``folder/engine.json`` atomically; returns its path."""
    return atomic_write_text(Path(folder) / CPU_ENGINE_RECORD, json.dumps(record.to_dict(), indent=2) + "\n")


def read_cpu_engine_record(artifact: str | Path) -> CpuEngineRecord | None:
    """The record of ``artifact``'s CPU engine; None when the artifact has no ``cpu/`` folder.

    Raises:
        ArtifactError: a ``cpu/`` folder without a readable record (one line saying how to rebuild it).
    """
    folder = Path(artifact) / CPU_ENGINE_DIR
    if not folder.exists():
        return None
    path = folder / CPU_ENGINE_RECORD
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{folder} holds no {CPU_ENGINE_RECORD}; {rebuild_hint(artifact)}") from None
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{path} is not readable JSON ({exc}); {rebuild_hint(artifact)}") from None
    try:
        return CpuEngineRecord.from_dict(data, str(path))
    except ArtifactError as exc:
        raise ArtifactError(f"{exc}; {rebuild_hint(artifact)}") from None


def rebuild_hint(artifact: str | Path) -> str:
    """How to rebuild (or bypass) the CPU engine of ``artifact``."""
    return (f"`mla-deploy build {artifact} --target cpu` rebuilds it (or --no-engine runs the source graphs)")


def check_cpu_engine(artifact: str | Path, manifest: Manifest, host: HostCpu) -> CpuEngineRecord | None:
    """The record of ``artifact``'s CPU engine when it is fresh for ``manifest`` on ``host``; None when there is none.

    Raises:
        ArtifactError: a stale or foreign engine, in one line naming what differs and how to rebuild it.
    """
    record = read_cpu_engine_record(artifact)
    if record is None:
        return None
    differs = record.staleness(Path(artifact), manifest, host)
    if differs:
        raise ArtifactError(f"the CPU engine {Path(artifact) / CPU_ENGINE_DIR} is stale: {differs}; "
                            f"{rebuild_hint(artifact)}")
    return record
