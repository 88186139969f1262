"""``mla-deploy bench``: decode-step speed and memory of MLA attention against what users run today
(transformers' own attention) and against this machine's roofline.

Modules: :mod:`.spec` (what is measured), :mod:`.stack` (the benched unit), :mod:`.graph` (its ONNX export),
:mod:`.inputs`, one timed-path class per family of paths (:mod:`.hf_path`, :mod:`.torch_paths`,
:mod:`.ort_path`, :mod:`.trt_path`), :mod:`.worker` (one process per variant and pass), :mod:`.machine`
(bandwidth, GEMM and memory probes), :mod:`.roofline`, :mod:`.driver` and :mod:`.report`. Heavy modules are
imported lazily.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {"BenchSpec": ".spec", "PATHS": ".spec", "run_bench": ".driver", "format_table": ".output"}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'mla_deploy.bench' has no attribute {name!r}")
