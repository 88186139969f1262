"""ONNX Runtime's CUDA provider as the engine opens it: the provider options and session entries (one owner of
their names), the refusal of a graph whose nodes would fall back to the CPU, and the CUDA graphs' ids.

Names are ONNX Runtime 1.31's documented ones (docs/execution-providers/CUDA-ExecutionProvider.md, the session and
run option config keys): provider options ``device_id``, ``enable_cuda_graph``, ``use_tf32``; session entries
``session.disable_cpu_ep_fallback`` and ``ep.cuda.fpa_intb_gemm`` (``MatMulNBits``' fpA_intB GEMM, off by
default in 1.31); run entry ``gpu_graph_id`` (``-1``: run without capture or replay).

A CUDA graph is captured by the first run under a new ``gpu_graph_id`` and replayed by the later ones: no kernel
is launched from the host, so every input must be at the address it was captured with (the engine's step buffers
and caches are allocated once per ``(batch, capacity)`` and updated in place, :mod:`.binding`). An id can be
captured once; :class:`GraphIds` hands out one per binding and says why a step runs without one.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from ..errors import PlacementError, RuntimeMissingError

CUDA = "CUDAExecutionProvider"
#: what ONNX Runtime 1.31 raises when ``session.disable_cpu_ep_fallback`` meets a node only the CPU runs
FALLBACK_REFUSED = "fallback to CPU EP has been explicitly disabled"
#: the most CUDA graphs one engine captures (each keeps its own memory); further bindings run without a graph
MAX_GRAPHS = 16
#: run option: no capture, no replay
EAGER = -1


@dataclass(frozen=True)
class CudaOptions:
    """How the engine uses ONNX Runtime's CUDA provider.

    Attributes:
        device_id: the GPU.
        cuda_graph: capture each decode binding as a CUDA graph and replay it (``enable_cuda_graph``).
        fpa_intb: ``MatMulNBits``' fpA_intB GEMM (``ep.cuda.fpa_intb_gemm``): True on, False off, None ONNX
            Runtime's default (off in 1.31, unless the ``ORT_FPA_INTB_GEMM`` environment variable says on).
        strict_placement: refuse a graph any of whose nodes would run on the CPU
            (``session.disable_cpu_ep_fallback``): such a node copies through the host every step and forbids
            CUDA graphs. False: let ONNX Runtime place them (an older artifact of the branches experts form).
    """

    device_id: int = 0
    cuda_graph: bool = True
    fpa_intb: bool | None = None
    strict_placement: bool = True

    def provider(self, precision: str, capture: bool) -> tuple[str, dict[str, str]]:
        """The providers-list entry of a session; ``capture``: the session may capture CUDA graphs. TF32 is off for
        fp32 artifacts: ONNX Runtime's default lets an fp32 MatMul round its inputs to 10 mantissa bits."""
        options = {"device_id": str(self.device_id), "enable_cuda_graph": "1" if capture and self.cuda_graph else "0"}
        if precision == "fp32":
            options["use_tf32"] = "0"
        return CUDA, options

    def session_entries(self, strict: bool = True) -> dict[str, str]:
        """The session config entries these options set; ``strict`` False: without the refusal of CPU nodes (the
        session that finds which nodes they are)."""
        entries = {}
        if self.strict_placement and strict:
            entries["session.disable_cpu_ep_fallback"] = "1"
        if self.fpa_intb is not None:
            entries["ep.cuda.fpa_intb_gemm"] = "1" if self.fpa_intb else "0"
        return entries

    def describe(self) -> dict:
        return {"device_id": self.device_id, "cuda_graph": self.cuda_graph,
                "fpa_intb": "default" if self.fpa_intb is None else self.fpa_intb,
                "strict_placement": self.strict_placement}


@dataclass(frozen=True)
class CudaSession:
    """What one CUDA session is opened with: the options, the artifact's precision (fp32 turns TF32 off) and whether
    the session may capture CUDA graphs (the one serving decode)."""

    options: CudaOptions = CudaOptions()
    precision: str = "fp32"
    capture: bool = False

    @property
    def capturing(self) -> bool:
        return self.capture and self.options.cuda_graph


def providers(provider: str, cuda: CudaSession | None, capture: bool) -> list:
    """The ``providers`` argument of a session on ``provider`` (``CPUExecutionProvider`` or CUDA's; ``capture``:
    it may capture CUDA graphs). With strict placement the CPU provider is not listed: ONNX Runtime refuses the
    pair (it would be the fallback refused)."""
    if provider != CUDA:
        return [provider]
    cuda = cuda or CudaSession()
    entry = cuda.options.provider(cuda.precision, capture)
    return [entry] if cuda.options.strict_placement else [entry, "CPUExecutionProvider"]


def off_device_nodes(ort, model, options) -> collections.Counter:
    """Op types of the nodes ONNX Runtime places off the CUDA provider when ``model`` is opened with CPU fallback
    allowed (``session.record_ep_graph_assignment_info``, ONNX Runtime >= 1.31); empty where it cannot tell."""
    options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    session = ort.InferenceSession(model, options, providers=[CUDA, "CPUExecutionProvider"])
    found = collections.Counter()
    for subgraph in session.get_provider_graph_assignment_info():
        if subgraph.ep_name != CUDA:
            found.update(node.op_type for node in subgraph.get_nodes())
    return found


def placement_error(file: str, counts: collections.Counter) -> PlacementError:
    """The one line that refuses ``file`` for nodes that would run on the CPU."""
    listed = ", ".join(f"{op} x{n}" for op, n in counts.most_common(4)) or "which ones could not be read back"
    more = f" and {len(counts) - 4} more kinds" if len(counts) > 4 else ""
    return PlacementError(f"{file} has {sum(counts.values()) or 'some'} nodes ONNX Runtime's CUDA provider cannot run "
                          f"({listed}{more}): they would fall back to the CPU, copy through the host every step and "
                          f"forbid CUDA graphs. Re-export for the GPU (--precision bf16|fp16 --experts auto), or "
                          f"allow them with --allow-cpu-nodes")


def provider_missing(fallback: str) -> RuntimeMissingError:
    return RuntimeMissingError(f"ONNX Runtime could not use {CUDA} (it fell back to {fallback}); run "
                               f"`mla-deploy doctor`")


def require_cuda(ort) -> None:
    """Refuse, in one line, an ONNX Runtime whose CUDA provider does not load here (a session of a two-node graph:
    the provider is loaded, not only listed as built in).

    Raises: RuntimeMissingError."""
    from .choice import greedy_graph

    options = ort.SessionOptions()
    options.log_severity_level = 4
    probe = ort.InferenceSession(greedy_graph(1, 2, 1).SerializeToString(), options,
                                 providers=[CUDA, "CPUExecutionProvider"])
    if probe.get_providers()[0] != CUDA:
        raise provider_missing(probe.get_providers()[0])


class GraphIds:
    """The ``gpu_graph_id`` of each binding that may be captured, and why a binding runs without one.

    Attributes:
        enabled: CUDA graphs are on (the provider option, and a session that accepted it).
        reason: why they are off for the whole engine (None while on, or never asked for).
        failed: per binding key, why its capture failed (it runs without a graph from then on).
    """

    def __init__(self, enabled: bool, reason: str | None = None):
        self.enabled, self.reason = enabled, reason
        self.ids: dict = {}
        self.failed: dict = {}

    def id_for(self, key) -> int:
        """The binding's graph id (1, 2, ...; 0 is ONNX Runtime's default graph, never used), or :data:`EAGER`."""
        if not self.enabled or key in self.failed:
            return EAGER
        if key not in self.ids:
            if len(self.ids) >= MAX_GRAPHS:
                return EAGER
            self.ids[key] = len(self.ids) + 1
        return self.ids[key]

    def capture_failed(self, key, why: str) -> None:
        self.failed[key] = why

    def describe(self) -> str:
        if not self.enabled:
            return f"off ({self.reason})" if self.reason else "off"
        text = f"on, {len(self.ids)} captured"
        if self.failed:
            text += f"; {len(self.failed)} failed to capture, run without a graph ({next(iter(self.failed.values()))})"
        return text
