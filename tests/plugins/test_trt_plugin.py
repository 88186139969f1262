"""The TensorRT plugin ``mla_deploy::MlaDecode``: a one-node ONNX graph parsed by TensorRT's ONNX parser into
the plugin, built and run, against the PyTorch reference. Needs TensorRT, Triton and a CUDA GPU."""

from __future__ import annotations

import math

import pytest
import torch

trt = pytest.importorskip("tensorrt", reason="needs TensorRT (pip install tensorrt-cu12 or tensorrt-cu13)")
pytest.importorskip("triton", reason="the plugin's kernels are Triton kernels")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

pytestmark = [pytest.mark.trt, pytest.mark.gpu]


def _one_node_onnx(elem: int, heads: int, width: int, rank: int, scale: float) -> bytes:
    from onnx import TensorProto, helper

    from mla_deploy.exporter.decode_plugin import DOMAIN, OP_TYPE

    inputs = [helper.make_tensor_value_info("q", elem, ["B", heads, 1, width]),
              helper.make_tensor_value_info("cache", elem, ["B", 1, "T", width]),
              helper.make_tensor_value_info("lengths", TensorProto.INT64, ["B"])]
    output = helper.make_tensor_value_info("out", elem, ["B", heads, 1, rank])
    node = helper.make_node(OP_TYPE, ["q", "cache", "lengths"], ["out"], domain=DOMAIN, softmax_scale=scale,
                            kv_lora_rank=rank, plugin_namespace=DOMAIN)
    model = helper.make_model(helper.make_graph([node], "mla_decode", inputs, [output]),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    model.ir_version = 8
    return model.SerializeToString()


def test_plugin_is_registered():
    from mla_deploy.trt.plugin_loader import register_mla_decode_plugin

    assert register_mla_decode_plugin() == "mla_deploy::MlaDecode"
    assert trt.get_plugin_registry().get_creator("MlaDecode", "1", "mla_deploy") is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_onnx_node_runs_as_the_plugin(dtype):
    from onnx import TensorProto
    from polygraphy.backend.trt import (CreateConfig, EngineFromNetwork, NetworkFromOnnxBytes, Profile,
                                        TrtRunner)

    from mla_deploy.trt.plugin_loader import load_plugin_module, register_mla_decode_plugin

    register_mla_decode_plugin()
    reference = load_plugin_module("reference")
    heads, rank, width, slots = 16, 512, 576, 1024
    scale = 1.0 / math.sqrt(192)
    elem = TensorProto.FLOAT if dtype == torch.float32 else TensorProto.BFLOAT16
    profile = (Profile().add("q", (1, heads, 1, width), (4, heads, 1, width), (8, heads, 1, width))
               .add("cache", (1, 1, 1, width), (4, 1, slots, width), (8, 1, slots, width))
               .add("lengths", (1,), (4,), (8,)))
    network = NetworkFromOnnxBytes(_one_node_onnx(elem, heads, width, rank, scale), strongly_typed=True)
    engine = EngineFromNetwork(network, CreateConfig(profiles=[profile]))
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn((4, heads, 1, width), generator=gen, device="cuda").to(dtype)
    cache = torch.randn((4, 1, slots, width), generator=gen, device="cuda").to(dtype)
    lengths = torch.tensor([1, 17, 500, slots], device="cuda")
    with TrtRunner(engine) as runner:
        out = runner.infer({"q": q, "cache": cache, "lengths": lengths})["out"]
    ref = reference.mla_decode_reference(q, cache, lengths, scale, rank)
    err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
    assert err < (1e-5 if dtype == torch.float32 else 2e-2)
