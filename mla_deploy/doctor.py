"""``mla-deploy doctor``: what is installed, what really loads (each ONNX Runtime provider is tried with a real
session: :mod:`mla_deploy.ort.providers`), and which commands will work here.
"""

from __future__ import annotations

import os
import sys
from typing import Any


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
    from .ort.providers import listed_providers, probe_providers

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
        "serve": all(_version(m) for m in ("fastapi", "uvicorn")),
        "onnxruntime": probe_providers() if providers else listed_providers(),
        "huge_pages": _huge_pages(),
        "cpu_operators": _cpu_operators(),
        "cpu_operators_isa": _cpu_operators_isa(),
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


def _cpu_operators_isa() -> str | None:
    """The instruction set a CPU engine built here compiles mla-deploy's operators for (the best of
    :data:`mla_deploy.ort.operators.FAST_PATHS` this CPU has), or None."""
    from .ort.record import host_cpu
    from .ort import operators as cpu_ops

    isa = cpu_ops.fast_path(host_cpu("").features)
    return isa.name if isa else None


def commands(info: dict[str, Any]) -> dict[str, str]:
    """Which commands work with what ``info`` found: ``{command: "yes..." | "no: <what is missing>"}``, every
    command of ``mla-deploy`` (``build`` twice: its TensorRT and its CPU target)."""
    ort = info.get("onnxruntime") or {}
    loaded = ort.get("loaded")
    cuda_ep = None if loaded is None else loaded.get("CUDAExecutionProvider", {}).get("ok", False)
    gpu = info.get("cuda_available")
    missing_trt = [m for m, ok in (("TensorRT", info.get("tensorrt")), ("a CUDA GPU", gpu)) if not ok]
    missing_kernel = [m for m, ok in (("triton", info.get("triton")), ("a CUDA GPU", gpu)) if not ok]
    cuda = {True: ", cuda)", False: "; cuda: no, ONNX Runtime's CUDA provider does not load)",
            None: "; cuda: not probed)"}[cuda_ep]
    no_ort = "no: onnxruntime is not installed"
    run = ("yes (cpu" + cuda) if ort.get("version") else no_ort
    operators = info.get("cpu_operators", "not checked")
    cpu_build = (no_ort if not ort.get("version") else
                 f"yes, with mla-deploy's operators ({info.get('cpu_operators_isa')})"
                 if operators is None else f"yes, with ONNX Runtime's kernels ({operators})")
    serve = run if info.get("serve") else "no: needs the serve extra (pip install 'mla-deploy[serve]')"
    return {
        "inspect": "yes",
        "export": "yes",
        "run": run,
        "serve": serve,
        "validate": "yes" if ort.get("version") else no_ort,
        "bench": "yes" if ort.get("version") else no_ort,
        "build --target cpu": cpu_build,
        "build (TensorRT)": "yes" if not missing_trt else "no: needs " + " and ".join(missing_trt),
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
        lines.append("cpu ops      " + ("yes: `build --target cpu` compiles mla-deploy's own operators (C compiler; "
                                        f"instruction set: {info.get('cpu_operators_isa')})" if why is None else
                                        f"no: the CPU engine keeps ONNX Runtime's kernels ({why})"))
    lines += [
        f"tensorrt     {info['tensorrt'] or 'not installed'}",
        f"polygraphy   {info['polygraphy'] or 'not installed'}",
        f"triton       {info['triton'] or 'not installed'}",
        "commands:",
    ]
    lines += [f"  {name:<26} {state}" for name, state in info["commands"].items()]
    return "\n".join(lines)
