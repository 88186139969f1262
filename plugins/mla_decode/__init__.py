"""The MLA decode attention: a pure-PyTorch reference (:mod:`.reference`), split-K Triton kernels
(:mod:`.triton_kernel`), the TensorRT Python plugin ``mla_deploy::MlaDecode`` (:mod:`.trt_plugin`, needs
``tensorrt``) and a bandwidth benchmark (:mod:`.bench`).

Importing this package imports nothing heavy; import the submodule you need.
"""
