"""TensorRT engines: optimisation profiles (:mod:`.profiles`, pure Python), the Polygraphy build
(:mod:`.build`) and the loader of the ``plugins/mla_decode`` sources (:mod:`.plugin_loader`). The engine that
runs the built engines is :class:`mla_deploy.trt.engine.TrtEngine` (also reachable here as ``TrtEngine``).
``tensorrt`` is imported only by the functions that need it.
"""

from __future__ import annotations

from ..lazy import lazy_getattr

_LAZY = {
    "engine_profiles": ".profiles",
    "build_engines": ".build",
    "require_tensorrt": ".build",
    "TrtEngine": "mla_deploy.trt.engine",
    "register_mla_decode_plugin": ".plugin_loader",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
