"""mla-deploy's own ONNX Runtime CPU operator for the routed experts (``plugins/ort_experts/routed_experts.c``), and
the graph swap that puts it in a CPU engine in place of ONNX Runtime's ``QMoE``.

``mla_deploy.RoutedExperts`` takes ``QMoE``'s weights as they are (int4/int8 blocks of 32, zero point
``2^(bits-1)``, fp32 scales, gate and up rows interleaved) and computes what ``QMoE`` computes at ``accuracy_level``
4 (each token's vector quantized to int8 per block, integer dot products): the same inputs, attributes and
routing (top ``k`` of ``router_probs``, softmax over the chosen). It exists because ``QMoE`` is the
slowest part of a quantized decode step (a layer's six chosen experts at about 25 GB/s on the development machine)
and a kernel written for the product streams faster (``tools/gemv_probe``). It reads the weights where ONNX Runtime
maps them: nothing is packed at open.

The CPU engine build (:mod:`~mla_deploy.engines.cpu_build`) compiles the source for the CPU it runs on
(:func:`compile_library`: ``cc -O3 -march=native``, into the engine folder), swaps every eligible ``QMoE`` node
(:func:`swap_experts`) and records the library in the engine's record; a session opening the engine registers it
(:func:`register`). Where there is no C compiler, no source (an installed wheel: the plugin sources ship with the
source checkout), or the build finds no AVX-512 VNNI (the operator's fast path: without it ``QMoE`` is faster), the
engine keeps ``QMoE`` and its record says why.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

DOMAIN = "mla_deploy"
OP_TYPE = "RoutedExperts"
LIBRARY = "routed_experts.so"
#: the attributes QMoE must have for the swap (absent ones take QMoE's defaults: see :func:`_eligible`)
_ATTRIBUTES = ("k", "expert_weight_bits", "block_size", "normalize_routing_weights")


def source_path() -> Path:
    """``<source checkout>/plugins/ort_experts/routed_experts.c``."""
    return Path(__file__).resolve().parents[2] / "plugins" / "ort_experts" / "routed_experts.c"


@dataclass(frozen=True)
class Library:
    """A compiled operator library, or why there is none.

    Attributes:
        path: the shared library (None: not built, see ``why_not``).
        vnni: it computes with AVX-512 VNNI (its fast path).
        why_not: why the engine keeps ``QMoE`` (None when ``path`` is usable).
    """

    path: Path | None
    vnni: bool = False
    why_not: str | None = None


def compiler() -> str | None:
    """The C compiler used (``$CC``, else ``cc``, ``gcc``, ``clang`` on ``PATH``), or None."""
    return os.environ.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)


def compile_library(into: Path, native: bool = True) -> Library:
    """Compile :func:`source_path` into ``into/routed_experts.so`` for this CPU (``native``: ``-march=native``; False:
    portable C, for the tests of its fallback path). Never raises for a missing compiler or source: the
    :class:`Library` says why there is none."""
    source, cc = source_path(), compiler()
    if not source.is_file():
        return Library(None, why_not=f"the operator source {source} is not here (it ships with the source checkout)")
    if cc is None or shutil.which(cc) is None:
        return Library(None, why_not=f"no C compiler ({'$CC=' + cc if cc else 'cc, gcc, clang or $CC'} not found)")
    out = Path(into) / LIBRARY
    flags = ["-O3", "-fPIC", "-shared", "-std=gnu11"] + (["-march=native"] if native else [])
    done = subprocess.run([cc, *flags, "-o", str(out), str(source), "-lm"], capture_output=True, text=True)
    if done.returncode != 0 or not out.is_file():
        first = (done.stderr.strip().splitlines() or ["no message"])[0]
        return Library(None, why_not=f"{cc} could not compile {source.name}: {first[:200]}")
    vnni = bool(ctypes.CDLL(str(out)).mla_deploy_routed_experts_vnni())
    if native and not vnni:
        out.unlink()
        return Library(None, why_not="this CPU has no AVX-512 VNNI (the operator's fast path); QMoE is faster here")
    return Library(out, vnni)


def register(options, library: Path) -> None:
    """Register the operator library at ``library`` with the ONNX Runtime ``SessionOptions`` ``options``.

    Raises:
        ArtifactError: the library does not load (a missing or foreign file)."""
    from ..errors import ArtifactError

    try:
        options.register_custom_ops_library(str(library))
    except Exception as exc:  # onnxruntime raises its own types
        raise ArtifactError(f"ONNX Runtime cannot load the operator library {library}: "
                            f"{(str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]}") from exc


def _eligible(node) -> dict | None:
    """The RoutedExperts attributes of the ``QMoE`` NodeProto ``node`` when the operator computes exactly what it
    does, else None: int4/int8 blocks of 32, SwiGLU with gate and up interleaved (``swiglu_fusion`` 1, alpha 1,
    beta 0, no limit), no biases, zero points or separate routing weights, ``accuracy_level`` 4, the weights
    normalised over the chosen experts (``normalize_routing_weights`` 1: the only setting the export writes; with 0,
    ONNX Runtime 1.31's CPU ``QMoE`` was measured to normalise all the same, so the operator does not take it)."""
    from onnx import helper

    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    activation = attrs.get("activation_type", b"relu")
    wanted = {"expert_weight_bits": attrs.get("expert_weight_bits", 4) in (4, 8), "block_size": attrs.get("block_size") == 32,
              "activation": (activation.decode() if isinstance(activation, bytes) else activation) == "swiglu",
              "fusion": attrs.get("swiglu_fusion", 0) == 1, "alpha": attrs.get("activation_alpha", 1.0) == 1.0,
              "beta": attrs.get("activation_beta", 0.0) == 0.0, "limit": "swiglu_limit" not in attrs,
              "level": attrs.get("accuracy_level", 0) == 4, "k": attrs.get("k", 1) >= 1,
              "normalize": attrs.get("normalize_routing_weights", 0) == 1}
    inputs = list(node.input) + [""] * (7 - len(node.input))
    used = [i for i, name in enumerate(inputs) if name]
    if not all(wanted.values()) or used != [0, 1, 2, 3, 5, 6]:
        return None
    return {"k": attrs.get("k", 1), "expert_weight_bits": attrs.get("expert_weight_bits", 4), "block_size": 32,
            "normalize_routing_weights": 1}


def swap_experts(model) -> int:
    """Replace, in the ``onnx.ModelProto`` ``model`` (in place), every eligible ``com.microsoft`` ``QMoE`` node by
    ``mla_deploy.RoutedExperts`` over the same inputs (its bias slot dropped) and output; returns how many."""
    from onnx import helper

    swapped = 0
    for at, node in enumerate(list(model.graph.node)):
        attrs = _eligible(node) if (node.domain, node.op_type) == ("com.microsoft", "QMoE") else None
        if attrs is None:
            continue
        inputs = [node.input[i] for i in (0, 1, 2, 3, 5, 6)]
        new = helper.make_node(OP_TYPE, inputs, list(node.output), name=node.name, domain=DOMAIN, **attrs)
        new.metadata_props.extend(node.metadata_props)
        model.graph.node.remove(node)
        model.graph.node.insert(at, new)
        swapped += 1
    if swapped and not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return swapped
