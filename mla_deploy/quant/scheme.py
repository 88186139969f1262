"""The quantization scheme: symmetric int8 / int4 weights with one scale per block of input features.

A quantized weight ``W [N, K]`` (a Linear's ``[out, in]``; a stacked expert tensor ``[E, out, in]`` likewise,
expert by expert) is cut along its input axis ``K`` into blocks of ``block_size`` (32, 64 or 128; a last block
may be shorter). Each block ``b`` of each output row ``n`` has one scale ``s = max|W[n, b]| / qmax``
(``qmax`` = 127 for int8, 7 for int4; a block of zeros has scale 0), rounded to the nearest float16 where that is a
normal float16 (``2^-14 <= s <= 65504``; outside that range it stays float32), and integers ``q = round(W / s)`` in
``[-qmax, qmax]``; the weight the model computes with is ``q * s``. This is what ONNX's ``DequantizeLinear``
computes with blocked scales (opset >= 21), what ONNX Runtime's ``MatMulNBits`` and TensorRT's weight-only
quantization read, and the scheme of llama.cpp's ``Q8_0``/``Q4_0`` (block 32), whose scales are float16 too.

The graphs store the scales as float32 (the type ``MatMulNBits``, ``QMoE`` and ``DequantizeLinear`` take with
float32 activations); being float16 values, they are stored as float16 by the CPU engine's build, exactly
(:mod:`mla_deploy.ort.cpu_build`): a decode step streams 2 bytes of scale per block instead of 4, 10% of an
int4 weight's bytes.

:func:`quantize` gives a weight as the graph multiplies with it, ``q [K, N]`` and ``scale [ceil(K/B), N]`` (blocks
on axis 0), which each format (:mod:`.formats`) lays out its own way; :func:`fake_quantize` gives the same
numbers in the checkpoint's layout, for the PyTorch reference that validation compares the graph with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from ..errors import ConfigError

if TYPE_CHECKING:
    import torch

#: bits per weight of each scheme (``--weights``; ``float``, nothing quantized, is :data:`~.plan.FLOAT`)
SCHEMES = {"int8": 8, "int4": 4}
BLOCK_SIZES = (32, 64, 128)
DEFAULT_BLOCK_SIZE = 32
#: the smallest normal float16: a scale below it would lose precision as a float16, so it stays float32
HALF_MIN_NORMAL = 2.0 ** -14
HALF_MAX = 65504.0
#: columns quantized at a time: the float copy a quantization makes stays near 64 MiB whatever the tensor
_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class WeightQuantization:
    """A weight-only quantization scheme.

    Attributes:
        weights: ``int8`` or ``int4``.
        block_size: input features per scale (32, 64 or 128).
    """

    weights: str
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        if self.weights not in SCHEMES:
            raise ConfigError(f"weights must be float, {' or '.join(SCHEMES)}, got {self.weights!r}")
        if self.block_size not in BLOCK_SIZES:
            raise ConfigError(f"block size must be one of {', '.join(map(str, BLOCK_SIZES))}, got {self.block_size!r}")

    @property
    def bits(self) -> int:
        return SCHEMES[self.weights]

    @property
    def qmax(self) -> int:
        """The largest integer magnitude: 127 (int8) or 7 (int4); symmetric, so -qmax is the smallest."""
        return (1 << (self.bits - 1)) - 1

    def blocks(self, k: int) -> int:
        """Scales per output feature for ``k`` input features."""
        return -(-k // self.block_size)

    def nbytes(self, k: int, n: int, scale_itemsize: int, whole_blocks: bool = False) -> int:
        """Bytes of a quantized ``[K, N]`` weight: packed integers plus scales; ``whole_blocks``: the integers
        stored in whole blocks (``MatMulNBits``' layout pads ``K`` to a multiple of the block size)."""
        stored_k = self.blocks(k) * self.block_size if whole_blocks else k
        return -(-stored_k * n * self.bits // 8) + self.blocks(k) * n * scale_itemsize

    def to_dict(self) -> dict[str, Any]:
        return {"weights": self.weights, "block_size": self.block_size}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "WeightQuantization":
        return cls(str(data.get("weights")), int(data.get("block_size", DEFAULT_BLOCK_SIZE)))


def quantize(weight: "torch.Tensor", scheme: WeightQuantization) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Quantize ``weight [K, N]`` (any float dtype, any strides) in blocks along ``K`` (axis 0).

    Returns:
        ``(q, scale)``: ``q [K, N]`` int8 in ``[-qmax, qmax]`` and ``scale [ceil(K/B), N]`` float32 (float16
        values where in float16's normal range), so that ``dequantize(q, scale, scheme)`` is the weight the model
        computes with.
    """
    import torch

    k, n = weight.shape
    b, blocks = scheme.block_size, scheme.blocks(k)
    rows = weight.T  # [N, K]: a checkpoint's own layout (a Linear's [out, in]), blocks contiguous
    q = torch.empty((n, k), dtype=torch.int8)
    scale = torch.empty((n, blocks), dtype=torch.float32)
    step = max(1, _CHUNK_ELEMENTS // max(k, 1))
    for lo in range(0, n, step):  # a chunk of output rows: the float copy stays small for the largest tensor
        w = torch.nn.functional.pad(rows[lo: lo + step].to(torch.float32), (0, blocks * b - k))  # zeros: no max
        w = w.view(w.shape[0], blocks, b)
        s = w.abs().amax(dim=2)  # [rows, blocks]
        s.div_(scheme.qmax)
        s = torch.where((s >= HALF_MIN_NORMAL) & (s <= HALF_MAX), s.to(torch.float16).to(torch.float32), s)
        inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
        w.mul_(inv.unsqueeze(2)).round_().clamp_(-scheme.qmax, scheme.qmax)
        q[lo: lo + step] = w.view(w.shape[0], -1)[:, :k]
        scale[lo: lo + step] = s
    return q.T, scale.T


def dequantize(q: "torch.Tensor", scale: "torch.Tensor", scheme: WeightQuantization) -> "torch.Tensor":
    """``q [K, N]`` int8 times ``scale [ceil(K/B), N]`` repeated over each block: the weight ``[K, N]`` float32."""
    import torch

    return q.to(torch.float32) * torch.repeat_interleave(scale, scheme.block_size, dim=0)[: q.shape[0]]


def fake_quantize(weight: "torch.Tensor", scheme: WeightQuantization) -> "torch.Tensor":
    """The weight the quantized graph computes with, in the checkpoint's layout: ``weight [..., N, K]`` (a Linear's
    ``[out, in]``, or stacked experts ``[E, out, in]``) quantized in blocks along its last axis ``K``, then
    dequantized. Returns float32 of the same shape."""
    import torch

    flat = weight.reshape(-1, weight.shape[-1])  # [rows, K]
    out = torch.empty(flat.shape, dtype=torch.float32)
    rows = max(1, _CHUNK_ELEMENTS // max(flat.shape[1], 1))
    for lo in range(0, flat.shape[0], rows):
        q, scale = quantize(flat[lo: lo + rows].T, scheme)
        out[lo: lo + rows] = dequantize(q, scale, scheme).T
    return out.reshape(weight.shape)


def pack_int4(q: "torch.Tensor") -> "torch.Tensor":
    """ONNX's ``INT4`` storage of ``q`` (int8 values in [-8, 7], any shape, row-major): two values per byte, the
    first in the low nibble; ``uint8 [ceil(numel / 2)]``."""
    import torch

    flat = q.reshape(-1).to(torch.uint8) & 0x0F
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    return flat[0::2] | (flat[1::2] << 4)
