"""The engine base every backend's engine is built on (:class:`~mla_deploy.engines.base.Engine`), which implements
the generation loop's interface (:class:`~mla_deploy.generate.engine.GenerationEngine`). The engines themselves live
with their backend, one folder each:

* :class:`~mla_deploy.ort.engine.OrtEngine`: ONNX Runtime (CPU or CUDA provider), :mod:`mla_deploy.ort`;
* :class:`~mla_deploy.trt.engine.TrtEngine`: TensorRT engines built by ``mla-deploy build``, :mod:`mla_deploy.trt`.

Both names are also importable from here (``from mla_deploy.engines import OrtEngine``). Names are imported lazily,
so importing this package loads neither onnxruntime nor tensorrt.
"""

from __future__ import annotations

from ..lazy import lazy_getattr

_LAZY = {
    "Engine": "mla_deploy.engines.base",
    "OrtEngine": "mla_deploy.ort.engine",
    "TrtEngine": "mla_deploy.trt.engine",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
