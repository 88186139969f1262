"""The whole-model bench (``mla-deploy bench model``): the exported model's decode and prefill speed and memory
in ONNX Runtime, beside transformers' own model on the same checkpoint, each step against the bound of the
bytes it must read (routed experts counted per step) at this machine's measured bandwidth.

Modules: :mod:`.spec` (what is measured), :mod:`.driver` (prepares the artifacts, runs every role in processes
of its own), :mod:`.worker` (the roles: ``ours``, ``transformers``, ``routing``, ``probe``), :mod:`.cost` (the
cost model) and :mod:`.report`. Heavy modules are imported lazily.
"""

from __future__ import annotations

from ...lazy import lazy_getattr

_LAZY = {"WholeModelSpec": ".spec", "run_whole_model": ".driver", "format_table": ".report"}

__all__ = list(_LAZY)
__getattr__ = lazy_getattr(__name__, _LAZY)
