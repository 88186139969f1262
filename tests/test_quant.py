"""Block quantization (mla_deploy.quant): symmetric scales per block of input features, ONNX's INT4 packing."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from mla_deploy.errors import ConfigError
from mla_deploy.quant import (WeightQuantization, dequantize, fake_quantize, matmulnbits_layout, pack_int4, plan,
                              quantize)


@pytest.mark.parametrize("weights,block", [("int8", 32), ("int4", 32), ("int4", 128), ("int8", 64)])
def test_quantize_is_symmetric_per_block_along_k(weights, block):
    scheme = WeightQuantization(weights, block)
    k, n = 200, 7  # 200 is no multiple of the block: the last block is shorter
    w = torch.randn(k, n, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(torch.bfloat16)
    q, scale = quantize(w.T.contiguous().T, scheme)  # any strides
    assert q.dtype == torch.int8 and q.shape == (k, n) and scale.shape == (-(-k // block), n)
    assert int(q.abs().max()) == scheme.qmax  # each block's largest magnitude maps to qmax ...
    for b in range(scale.shape[0]):  # ... with scale = max|W| / qmax over exactly that block of rows
        rows = w[b * block:(b + 1) * block].float()
        torch.testing.assert_close(scale[b], rows.abs().amax(0) / scheme.qmax)
    error = (dequantize(q, scale, scheme) - w.float()).abs()
    assert bool((error <= torch.repeat_interleave(scale, block, 0)[:k] / 2 + 1e-7).all())  # rounding: half a step


def test_zero_block_has_zero_scale():
    q, scale = quantize(torch.zeros(64, 3), WeightQuantization("int4", 32))
    assert not q.any() and not scale.any()


def test_fake_quantize_matches_the_graph_layout():
    """The reference's quantization of a checkpoint tensor [..., N, K] equals the export's of its [K, N] view."""
    scheme = WeightQuantization("int4", 32)
    experts = torch.randn(3, 5, 96, generator=torch.Generator().manual_seed(1))  # [E, out, in]
    fake = fake_quantize(experts, scheme)
    for e in range(3):
        q, scale = quantize(experts[e].T, scheme)
        torch.testing.assert_close(fake[e], dequantize(q, scale, scheme).T, rtol=0, atol=0)


def test_pack_int4_is_onnx_packing():
    values = torch.tensor([[-7, 7, 0], [3, -1, 5], [-8, 1, 2]], dtype=torch.int8)  # odd count: padded
    packed = pack_int4(values).numpy().tobytes()
    proto = onnx.TensorProto(name="q", data_type=onnx.TensorProto.INT4, dims=[3, 3], raw_data=packed)
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(proto).astype(np.int8), values.numpy())


@pytest.mark.parametrize("weights,block,message", [("int3", None, "weights must be"), ("int8", 48, "block size"),
                                                   ("float", 64, "needs quantized weights")])
def test_bad_schemes_are_refused(weights, block, message):
    with pytest.raises(ConfigError, match=message):
        plan(weights, block)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_matmulnbits_layout_and_its_bytes(weights):
    """MatMulNBits' layout holds each output row's blocks whole (the zero point pads a short last block), with the
    values offset by 2^(bits-1); nbytes(whole_blocks=True) counts exactly what it stores."""
    scheme = WeightQuantization(weights, 32)
    k, n = 200, 5
    q, scale = quantize(torch.randn(k, n, generator=torch.Generator().manual_seed(2)), scheme)
    packed, scales = matmulnbits_layout(q, scale, scheme)
    assert packed.dtype == torch.uint8 and packed.shape == (n, 7, 32 * scheme.bits // 8) and scales.shape == (n * 7,)
    assert packed.numel() + scales.numel() * 4 == scheme.nbytes(k, n, 4, whole_blocks=True)
    assert scheme.nbytes(k, n, 4) < scheme.nbytes(k, n, 4, whole_blocks=True)
    zero = 1 << (scheme.bits - 1)
    values = packed.to(torch.int16) if scheme.bits == 8 else torch.stack([packed & 15, packed >> 4], -1).to(torch.int16)
    values = values.reshape(n, -1) - zero  # [N, 7 * 32], the pad included
    assert torch.equal(values[:, :k], q.T.to(torch.int16)) and not values[:, k:].any()
    torch.testing.assert_close(scales.reshape(n, 7), scale.T)
