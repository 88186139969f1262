"""The attention bench (``mla-deploy bench attention``): decode-step speed and memory of N MLA attention layers,
transformers' own attention beside this project's PyTorch forms, its exported graph in ONNX Runtime and
TensorRT, against this machine's roofline.

Modules: :mod:`.spec` (what is measured), :mod:`.graph` (the benched unit's ONNX export), :mod:`.inputs`, one
timed-path class per family of paths (:mod:`.hf_path`, :mod:`.torch_paths`, :mod:`.ort_path`, :mod:`.trt_path`),
:mod:`.worker` (one process per variant and pass), :mod:`.roofline` (the cost model), :mod:`.driver`,
:mod:`.report` and :mod:`.output`. Heavy modules are imported lazily.
"""

from __future__ import annotations

from ...lazy import lazy_getattr

_LAZY = {"BenchSpec": ".spec", "PATHS": ".spec", "run_bench": ".driver", "format_table": ".output"}

__all__ = list(_LAZY)
__getattr__ = lazy_getattr(__name__, _LAZY)
