"""ONNX Runtime: everything that runs an artifact on it, in one folder (as :mod:`mla_deploy.trt` is TensorRT's).

* :mod:`.engine`: :class:`OrtEngine` (CPU or CUDA provider) and the session helpers (:func:`open_session`,
  :func:`session_options`, :func:`require_onnxruntime`, the dtype and ``OrtValue`` conversions);
* :mod:`.binding`: the in-place cache's step buffers and IO bindings, made once and refreshed in place (the same
  code on the CPU and CUDA providers), and the token choice on the provider; :mod:`.choice`: its two small graphs;
* :mod:`.cuda`: the CUDA provider's options (:class:`CudaOptions`: CUDA graphs, fpA_intB, strict placement), the
  one-line refusals and the CUDA graphs' ids;
* :mod:`.cpu_build`: ``mla-deploy build ART --target cpu`` (:func:`build_cpu_engine`), the pre-built CPU engine;
* :mod:`.record`: that engine's record (``ART/cpu/engine.json``), what it is tied to and the staleness check;
* :mod:`.operators`: mla-deploy's own CPU operators: their C source (``csrc/cpu_ops.c``, shipped in the wheel), its
  compilation for this CPU, the C API check and the loading into a session;
* :mod:`.swaps`: the graph rewrites that put those operators in an engine's graphs;
* :mod:`.mapped`, :mod:`.huge_pages`: how the engine's weights are mapped and backed;
* :mod:`.cuda_kernels`: which operators the CUDA provider has kernels for, in which types, as data
  (:func:`cuda_kernel_misses`: the nodes of a graph it would place elsewhere).

Importing this package imports neither onnxruntime nor onnx: names are loaded when first used.
"""

from __future__ import annotations

from ..lazy import lazy_getattr

_LAZY = {
    "OrtEngine": ".engine",
    "open_session": ".engine",
    "session_options": ".engine",
    "require_onnxruntime": ".engine",
    "CudaOptions": ".cuda",
    "build_cpu_engine": ".cpu_build",
    "CpuEngineRecord": ".record",
    "read_cpu_engine_record": ".record",
    "check_cpu_engine": ".record",
    "cuda_kernel_misses": ".cuda_kernels",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
