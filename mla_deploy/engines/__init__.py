"""Engines that run an exported artifact, all on one interface (:class:`~mla_deploy.engines.base.Engine`):

* :class:`~mla_deploy.engines.ort_engine.OrtEngine`: ONNX Runtime (CPU or CUDA provider);
* :class:`~mla_deploy.engines.trt_engine.TrtEngine`: TensorRT engines built by ``mla-deploy build``.

Names are imported lazily, so importing this package loads neither onnxruntime nor tensorrt.
"""

from __future__ import annotations

from ..lazy import lazy_getattr

_LAZY = {
    "Engine": "mla_deploy.engines.base",
    "Generation": "mla_deploy.engines.base",
    "GenerationStream": "mla_deploy.engines.base",
    "StepTokens": "mla_deploy.engines.base",
    "pad_prompts": "mla_deploy.engines.base",
    "OrtEngine": "mla_deploy.engines.ort_engine",
    "TrtEngine": "mla_deploy.engines.trt_engine",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
