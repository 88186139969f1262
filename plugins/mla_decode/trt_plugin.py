"""TensorRT Python plugin ``mla_deploy::MlaDecode`` (``tensorrt.plugin``, JIT): the ONNX node that
``[export] decode_attention = "plugin"`` writes, executed by the Triton kernels of :mod:`.triton_kernel`.

Importing this module registers the plugin creator with TensorRT's plugin registry; do it before parsing
the ONNX graph (``mla-deploy build`` does) and before deserialising an engine that holds the plugin (the
TensorRT runner does): a JIT plugin runs this module's Python at inference time.

I/O (see :mod:`mla_deploy.exporter.decode_plugin`): ``q [B, H, S, C]``, ``cache [B, 1, T, C]`` (same float
type: FP32, FP16 or BF16), ``lengths [B]`` INT64 -> ``[B, H, S, kv_lora_rank]`` of q's type; attributes
``softmax_scale`` (float) and ``kv_lora_rank`` (int).

No ``from __future__ import annotations`` here: ``tensorrt.plugin`` reads the annotations as classes.
"""

from typing import List, Tuple

import tensorrt as trt
import tensorrt.plugin as trtp

PLUGIN_ID = "mla_deploy::MlaDecode"
TYPES = "FP32|FP16|BF16, FP32|FP16|BF16, INT64, FP32|FP16|BF16"


@trtp.register(PLUGIN_ID)
def mla_decode_desc(q: trtp.TensorDesc, cache: trtp.TensorDesc, lengths: trtp.TensorDesc, softmax_scale: float,
                    kv_lora_rank: int) -> trtp.TensorDesc:
    """Output descriptor: ``[B, H, S, kv_lora_rank]`` with q's dtype."""
    dims = q.shape_expr
    return trtp.from_shape_expr((dims[0], dims[1], dims[2], kv_lora_rank), dtype=q.dtype)


@trtp.autotune(PLUGIN_ID)
def mla_decode_autotune(q: trtp.TensorDesc, cache: trtp.TensorDesc, lengths: trtp.TensorDesc,
                        outputs: Tuple[trtp.TensorDesc]) -> List[trtp.AutoTuneCombination]:
    """q, cache and the output share FP32, FP16 or BF16; lengths is INT64; all LINEAR."""
    return [trtp.AutoTuneCombination(TYPES, "LINEAR")]


class _Int16View:
    """``__cuda_array_interface__`` of a BF16 plugin tensor seen as int16 (TensorRT's own interface refuses BF16)."""

    def __init__(self, tensor: trtp.Tensor):
        itemsize = 2
        self.__cuda_array_interface__ = {
            "shape": tuple(tensor.shape), "typestr": "<i2", "data": (tensor.data_ptr, False), "version": 3,
            "strides": tuple(s * itemsize for s in tensor.strides), "stream": None,
        }


def as_torch(tensor: trtp.Tensor):
    """A zero-copy CUDA ``torch.Tensor`` over a plugin tensor's buffer (BF16 included)."""
    import torch

    if tensor.dtype == trt.DataType.BF16:
        return torch.as_tensor(_Int16View(tensor), device="cuda").view(torch.bfloat16)
    return torch.as_tensor(tensor, device="cuda")


@trtp.impl(PLUGIN_ID)
def mla_decode_impl(q: trtp.Tensor, cache: trtp.Tensor, lengths: trtp.Tensor, softmax_scale: float,
                    kv_lora_rank: int, outputs: Tuple[trtp.Tensor], stream: int) -> None:
    """Launch the split-K kernels on TensorRT's ``stream``, writing into ``outputs[0]``."""
    import torch

    from .triton_kernel import mla_decode

    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        mla_decode(as_torch(q), as_torch(cache), as_torch(lengths), float(softmax_scale), int(kv_lora_rank),
                   out=as_torch(outputs[0]))


__all__ = ["PLUGIN_ID", "TYPES", "as_torch"]
