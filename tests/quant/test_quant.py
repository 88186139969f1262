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
    for b in range(scale.shape[0]):  # ... with scale = max|W| / qmax over exactly that block of rows, a float16 value
        rows = w[b * block:(b + 1) * block].float()
        want = (rows.abs().amax(0) / scheme.qmax).half().float()
        torch.testing.assert_close(scale[b], want, rtol=0, atol=0)
    error = (dequantize(q, scale, scheme) - w.float()).abs()
    assert bool((error <= torch.repeat_interleave(scale, block, 0)[:k] / 2 + 1e-7).all())  # rounding: half a step


def test_scales_below_float16s_normal_range_stay_float32():
    """A block whose scale a float16 would hold with less precision (below 2^-14) keeps its float32 scale; the
    others are rounded to float16 values (the CPU engine stores those as float16, exactly)."""
    w = torch.full((64, 2), 0.5)
    w[32:, 0] = 1e-4  # scale 1e-4 / 7: below 2^-14
    q, scale = quantize(w, WeightQuantization("int4", 32))
    assert scale[1, 0] == torch.tensor(1e-4) / 7 and scale[1, 0].half().float() != scale[1, 0]
    assert scale[0, 0] == torch.tensor(0.5 / 7).half().float() and int(q[40, 0]) == 7


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


# --- the formats and the manifest's record (mla_deploy.quant.formats, .record) -------------------------------------
from mla_deploy.errors import ArtifactError, InputError  # noqa: E402
from mla_deploy.quant import (FLOAT, FORMATS, MATMULNBITS, QDQ, Quantized, from_manifest,  # noqa: E402
                              weights_list)


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_format_counts_the_bytes_its_layout_stores(fmt, weights):
    """What a format says a weight takes (the bench's bound reads it) is the bytes of the tensors it lays out:
    qdq's int4 packed two per byte, matmulnbits' whole blocks."""
    scheme = WeightQuantization(weights, 32)
    k, n = 200, 5  # no multiple of the block
    q, scale = quantize(torch.randn(k, n, generator=torch.Generator().manual_seed(3)), scheme)
    parts = fmt.layout(q, scale, scheme)
    stored = [pack_int4(t) if fmt is QDQ and scheme.bits == 4 and t.dtype == torch.int8 else t for t in parts]
    assert sum(t.numel() * t.element_size() for t in stored) == fmt.nbytes(k, n, scheme, 4)


def test_the_record_keeps_the_manifest_format():
    """manifest.json's record is unchanged: an artifact written before the record was typed loads, and is written
    back as it was; a record without a format is the one format there was (qdq)."""
    written = {"weights": "int4", "block_size": 64, "symmetric": True, "axis": "input features",
               "format": "matmulnbits", "ops": MATMULNBITS.ops, "tensors": 3, "bytes": 120, "keys": ["a.weight"]}
    record = from_manifest(written, "m.json")
    assert (record.weights, record.block_size, record.format, record.keys) == ("int4", 64, MATMULNBITS, ("a.weight",))
    assert record.to_manifest() == {"quantization": written}
    first = {**{k: v for k, v in written.items() if k != "ops"}, "format": "DequantizeLinear(axis=0, block_size) -> MatMul"}
    assert from_manifest(first, "m.json").format is QDQ  # the first release wrote the ops as the format
    assert from_manifest({k: v for k, v in first.items() if k != "format"}, "m.json").format is QDQ
    assert from_manifest(None, "m.json") is FLOAT and FLOAT.to_manifest() == {}


@pytest.mark.parametrize("record,message", [
    ([], "must be a table"), ({"weights": "int8"}, "must be a table"),
    ({"weights": "int3", "keys": []}, "weights must be"), ({"weights": "int8", "block_size": 48, "keys": []}, "block"),
    ({"weights": "int8", "format": "nf4", "keys": []}, "format must be"),
    ({"weights": "int8", "tensors": "15", "keys": []}, "must be counts"),
    ({"weights": "int8", "colour": "red", "keys": []}, "unknown field(s) colour"),
    ({"weights": "int8", "keys": [], "per_head": "a.kv_b_proj.weight"}, "per_head must be a list"),
    ({"weights": "int8", "format": "qdq", "keys": [], "per_head": ["a.kv_b_proj.weight"]},
     "the qdq format holds no per-head weights")])
def test_a_malformed_record_is_refused_naming_the_manifest(record, message):
    with pytest.raises(ArtifactError, match="^m.json: quantization") as info:
        from_manifest(record, "m.json")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_float_is_a_quantization_that_changes_nothing(tmp_path):
    assert not FLOAT.quantized and FLOAT.weights == "float" and FLOAT.keys == ()
    assert FLOAT.stored_nbytes("x", (3, 5), 2) == 30 and FLOAT.quantized_nbytes({"x": (3, 5)}, 2) == 0
    assert FLOAT.session(tmp_path / "g.onnx", "fp32") == (str(tmp_path / "g.onnx"), {})
    assert FLOAT.variant("ours") == "ours" and FLOAT.fingerprint() == {}
    with pytest.raises(InputError, match="quantized_compute"):
        FLOAT.session(tmp_path / "g.onnx", "fp16")
    int4 = Quantized(WeightQuantization("int4", 32), QDQ, keys=("x",))
    assert int4.stored_nbytes("x", (2, 5, 64), 4) == 2 * QDQ.nbytes(64, 5, int4.scheme, 4)  # per expert
    assert int4.stored_nbytes("y", (5, 64), 4) == 5 * 64 * 4 and int4.variant("ours") == "ours-int4"
    half = int4.with_scale_bytes(2)  # as the CPU engine stores the scales: 2 bytes each, the float tensors unchanged
    assert half.stored_nbytes("x", (2, 5, 64), 4) == 2 * (5 * 32 + 5 * 2 * 2) and half.stored_nbytes("y", (5, 64), 4) == 5 * 64 * 4


def test_the_bench_weights_list():
    assert weights_list("float,int4,float", None) == (("float", "int4"), None)
    assert weights_list(("int8",), "64") == (("int8",), 64)
    for value, block, message in [("float,fp8", None, "comma list"), ("float", 64, "--block-size needs --weights"),
                                  ("int8", 48, "--block-size must be one of")]:
        with pytest.raises(ConfigError, match=message):
            weights_list(value, block)
