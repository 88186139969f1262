"""Engines that run an exported artifact, all on one base (:class:`~mla_deploy.engines.base.Engine`), which
implements the generation loop's interface (:class:`~mla_deploy.generate.engine.GenerationEngine`):

* :class:`~mla_deploy.engines.ort_engine.OrtEngine`: ONNX Runtime (CPU or CUDA provider);
* :class:`~mla_deploy.engines.trt_engine.TrtEngine`: TensorRT engines built by ``mla-deploy build``.

Names are imported lazily, so importing this package loads neither onnxruntime nor tensorrt.
"""

from __future__ import annotations

from ..lazy import lazy_getattr

_LAZY = {
    "Engine": "mla_deploy.engines.base",
    "OrtEngine": "mla_deploy.engines.ort_engine",
    "TrtEngine": "mla_deploy.engines.trt_engine",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
