"""``mla-deploy doctor``: what is installed, what really loads, and which commands will work here.

ONNX Runtime's GPU wheel lists the CUDA and TensorRT execution providers even on a machine without a GPU
or without their libraries, so each listed provider is tried: a one-node session is created with it alone
and counted only if ``session.get_providers()`` still names it (ONNX Runtime silently falls back to CPU).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import tempfile
from typing import Any


@contextlib.contextmanager
def _captured_output():
    """Capture Python's and the C++ libraries' stdout/stderr (file descriptors 1 and 2); yields a list that
    receives the captured text on exit."""
    text: list[str] = []
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        python = io.StringIO()
        try:
            with contextlib.redirect_stdout(python), contextlib.redirect_stderr(python):
                yield text
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            sink.seek(0)
            text.append(sink.read().decode(errors="replace") + python.getvalue())


def _reason(log: str) -> str:
    """The most telling line of a provider's failure log (a missing library, a missing GPU)."""
    for pattern in (r"with error: ([^\n\x1b]+)", r"(Failed to create \w+)", r"(Please install [^\n\x1b.]+)"):
        found = re.search(pattern, log)
        if found:
            return found.group(1).strip()
    return "fell back to CPUExecutionProvider"


def _tiny_model() -> bytes:
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def probe_providers() -> dict[str, Any]:
    """ONNX Runtime's version, its listed providers, and for each whether a session really runs on it."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        return {"version": None, "error": str(exc), "listed": [], "loaded": {}}
    model = _tiny_model()
    options = ort.SessionOptions()
    options.log_severity_level = 4
    loaded: dict[str, dict[str, Any]] = {}
    for provider in ort.get_available_providers():
        with _captured_output() as log:
            try:
                session = ort.InferenceSession(model, options, providers=[provider])
                used, error = session.get_providers(), None
            except Exception as exc:  # onnxruntime raises its own types
                used, error = [], str(exc).splitlines()[0]
        ok = bool(used) and used[0] == provider
        loaded[provider] = {"ok": ok, "reason": None if ok else (error or _reason(log[0] if log else ""))}
    return {"version": ort.__version__, "listed": ort.get_available_providers(), "loaded": loaded}


def _listed_providers() -> dict[str, Any]:
    """ONNX Runtime's version and listed providers, without trying them (``loaded`` is None)."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        return {"version": None, "error": str(exc), "listed": [], "loaded": None}
    return {"version": ort.__version__, "listed": ort.get_available_providers(), "loaded": None}


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except Exception:  # not installed, or its native libraries are missing
        return None
    return getattr(mod, "__version__", "unknown")


def collect(providers: bool = True) -> dict[str, Any]:
    """Everything ``doctor`` reports, as plain data.

    Args:
        providers: probe ONNX Runtime's providers with real sessions (a second or two).
    """
    import torch

    from . import __version__

    gpu = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
               "compute_capability": f"{props.major}.{props.minor}", "count": torch.cuda.device_count()}
    info = {
        "mla_deploy": __version__, "python": sys.version.split()[0],
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "gpu": gpu, "onnx": _version("onnx"), "polygraphy": _version("polygraphy"),
        "tensorrt": _version("tensorrt"), "triton": _version("triton"),
        "onnxruntime": probe_providers() if providers else _listed_providers(),
        "huge_pages": _huge_pages(),
        "cpu_operators": _cpu_operators(),
    }
    info["commands"] = commands(info)
    return info


def _huge_pages() -> dict[str, Any]:
    """Whether this process's large allocations (ONNX Runtime's weights) land on huge pages, with the system's THP
    setting and ``GLIBC_TUNABLES`` (see :mod:`mla_deploy.ort.huge_pages`)."""
    from .ort import huge_pages

    state = huge_pages.huge_pages()
    return {"in_use": huge_pages.probe(), "setting": state.setting, "requested": state.requested,
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES")}


def _cpu_operators() -> str | None:
    """Why a CPU engine built here would keep ONNX Runtime's kernels, or None when it gets mla-deploy's own
    operators (:mod:`mla_deploy.ort.operators`)."""
    from .ort.record import host_cpu
    from .ort import operators as cpu_ops

    return cpu_ops.why_not_here(host_cpu("").features)


def commands(info: dict[str, Any]) -> dict[str, str]:
    """Which commands work with what ``info`` found: ``{command: "yes" | "no: <what is missing>"}``."""
    ort = info.get("onnxruntime") or {}
    loaded = ort.get("loaded")
    cuda_ep = None if loaded is None else loaded.get("CUDAExecutionProvider", {}).get("ok", False)
    gpu = info.get("cuda_available")
    missing_trt = [m for m, ok in (("TensorRT", info.get("tensorrt")), ("a CUDA GPU", gpu)) if not ok]
    missing_kernel = [m for m, ok in (("triton", info.get("triton")), ("a CUDA GPU", gpu)) if not ok]
    cuda = {True: ", cuda)", False: "; cuda: no, ONNX Runtime's CUDA provider does not load)",
            None: "; cuda: not probed)"}[cuda_ep]
    run = "yes (cpu" + cuda
    return {
        "export": "yes",
        "run": run if ort.get("version") else "no: onnxruntime is not installed",
        "validate": "yes" if ort.get("version") else "no: onnxruntime is not installed",
        "build": "yes" if not missing_trt else "no: needs " + " and ".join(missing_trt),
        "mla_decode plugin kernel": "yes" if not missing_kernel else "no: needs " + " and ".join(missing_kernel),
    }


def format_report(info: dict[str, Any]) -> str:
    """The human-readable report."""
    gpu = info["gpu"]
    lines = [
        f"mla-deploy   {info['mla_deploy']} (Python {info['python']})",
        f"torch        {info['torch']} (CUDA build: {info['torch_cuda'] or 'none'}; "
        f"CUDA available: {'yes' if info['cuda_available'] else 'no'})",
        "GPU          " + (f"{gpu['name']}, {gpu['memory_gib']} GiB, compute capability {gpu['compute_capability']}"
                           f" ({gpu['count']} device(s))" if gpu else "none"),
        f"onnx         {info['onnx'] or 'not installed'}",
    ]
    ort = info.get("onnxruntime") or {}
    if not ort.get("version"):
        lines.append("onnxruntime  not installed")
    else:
        lines.append(f"onnxruntime  {ort['version']}; listed providers: {', '.join(ort['listed'])}")
        if ort.get("loaded") is None:
            lines.append("  (not tried; run without --no-providers to see which really load)")
        for name, state in (ort.get("loaded") or {}).items():
            lines.append(f"  {name:<28} " + ("loads" if state["ok"] else f"does not load ({state['reason']})"))
    pages = info.get("huge_pages") or {}
    if pages:
        how = f"THP {pages['setting']}, GLIBC_TUNABLES={pages['glibc_tunables'] or '(unset)'}"
        lines.append("huge pages   " + ("yes: weights load on 2 MiB pages" if pages["in_use"] else
                                         "no: weights load on 4 KiB pages") + f" ({how})")
    if "cpu_operators" in info:
        why = info["cpu_operators"]
        lines.append("cpu ops      " + ("yes: `build --target cpu` compiles mla-deploy's own operators (C compiler, "
                                        "AVX-512 VNNI)" if why is None else
                                        f"no: the CPU engine keeps ONNX Runtime's kernels ({why})"))
    lines += [
        f"tensorrt     {info['tensorrt'] or 'not installed'}",
        f"polygraphy   {info['polygraphy'] or 'not installed'}",
        f"triton       {info['triton'] or 'not installed'}",
        "commands:",
    ]
    lines += [f"  {name:<26} {state}" for name, state in info["commands"].items()]
    return "\n".join(lines)
