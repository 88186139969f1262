"""``mla-deploy bench``: two benches over one process harness.

* :mod:`.attention` (``mla-deploy bench attention``): the decode step of N MLA attention layers, against what
  users run today (transformers' own attention) and against this machine's roofline.
* :mod:`.whole_model` (``mla-deploy bench model``): the whole exported model's decode and prefill in ONNX
  Runtime, beside transformers' own model on the same checkpoint, against the bound of the bytes each step reads.

What both share, and neither bench imports from the other: :mod:`.harness` (every measurement in a fresh worker
process with its threads pinned; out-of-memory kills and restarts; job and result files; Ctrl-C kills the worker),
:mod:`.machine` (bandwidth, GEMM and memory probes), :mod:`.bound` (the roofline bound, attention FLOPs),
:mod:`.reporting` (the machine section, versions, atomic report files) and :mod:`.parsing` (option values).
Heavy modules are imported lazily.
"""

from __future__ import annotations

from ..lazy import lazy_getattr

_LAZY = {"BenchSpec": ".attention", "PATHS": ".attention", "run_bench": ".attention", "format_table": ".attention",
         "WholeModelSpec": ".whole_model", "run_whole_model": ".whole_model"}

__all__ = list(_LAZY)
__getattr__ = lazy_getattr(__name__, _LAZY)
