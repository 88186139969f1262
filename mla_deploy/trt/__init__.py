"""TensorRT engines: optimisation profiles (:mod:`.profiles`, pure Python), the Polygraphy build
(:mod:`.build`) and the loader of the ``plugins/mla_decode`` sources (:mod:`.plugin_loader`). The engine that
runs the built engines is :class:`mla_deploy.engines.trt_engine.TrtEngine` (also reachable here as ``TrtEngine``).
``tensorrt`` is imported only by the functions that need it.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {
    "engine_profiles": ".profiles",
    "build_engines": ".build",
    "require_tensorrt": ".build",
    "TrtEngine": "mla_deploy.engines.trt_engine",
    "register_mla_decode_plugin": ".plugin_loader",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'mla_deploy.trt' has no attribute {name!r}")
