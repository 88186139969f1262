"""The GPU export (fp16/bf16): the routed experts in the fused form's ``cuda`` layout, one ONNX Runtime operator per MoE
layer, proved on the CPU.

* the decode graphs of DeepSeek-V2-Lite (4 layers: 1 dense + 3 MoE of 64 experts) and of DeepSeek-V3's shapes (256
  experts, ``noaux_tc``), traced on the meta device at their real sizes (no weights written): one ``QMoE``/``MoE``
  per MoE layer, no data-dependent operator, a node budget, every node with a CUDA kernel for its type;
* the layout's fp32 twin (the same graph form with fp32 activations) on ONNX Runtime's CPU provider equals PyTorch
  for V2's greedy and group-limited routing and V3's ``noaux_tc``, with float and quantized experts;
* the CUDA layout's stored weights, dequantized in NumPy, are exactly ``quant.dequantize(quant.quantize(w))``;
* a tiny MoE model exported in fp16 with int4 weights passes the artifact check, and one whose ``QMoE`` is in the
  other layout does not.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from artifacts import tiny_recipe
from helpers import TOL, rel_err
from mla_deploy import load_recipe
from mla_deploy.artifact import WeightsSource
from mla_deploy.exporter import GraphPlan, run_export, trace_to_onnx
from mla_deploy.exporter.artifact import ArtifactTarget
from mla_deploy.exporter.export import refuse_dense_experts, trace_meta_graph
from mla_deploy.exporter.weights import ModuleTensors
from mla_deploy.io_spec import TensorSpec
from mla_deploy.model.decoder import init_random_
from mla_deploy.model.layers import MoE, moe_experts
from mla_deploy.ort.cuda_kernels import cuda_kernel_misses
from mla_deploy.quant import dequantize, quantize

#: operators whose output shape or control flow depends on the data: each forces a device-to-host sync on CUDA and
#: rules out capturing the step as a CUDA graph
DATA_DEPENDENT = {"NonZero", "If", "Loop", "Scan", "Compress", "Unique"}
#: the V2-Lite 4-layer decode graph as exported (before ONNX Runtime fuses anything at load): measured 471 nodes
#: (the branches form it replaces: 2,415, 192 of them NonZero). ONNX Runtime fuses each RMSNorm and folds the
#: per-head weights' dequantization when the session loads: the same structure at small widths, optimised by its CPU
#: provider, is 405 nodes (docs/gpu-export.md)
V2_LITE_BUDGET = 480
#: DeepSeek-V3's shapes, 1 dense + 1 MoE layer, as exported: measured 300 (query compression and the group-limited
#: choice add to V2-Lite's layer)
V3_BUDGET = 310


def _decode_graph(preset: str, precision: str, weights: str, layers: int, **model):
    """The decode graph of ``preset`` cut to ``layers`` layers, exported in ``precision`` with ``weights``: traced on
    the meta device and quantized as the export does, its weights never made. Returns ``(onnx_ir model, plan)``."""
    recipe = load_recipe(preset)
    recipe = recipe.replace(
        model=recipe.model.replace(num_hidden_layers=layers, **model),
        export=dataclasses.replace(recipe.export, precision=precision, weights=weights, cache_mode="static",
                                   max_cache_length=256))
    target = ArtifactTarget(recipe, WeightsSource(kind="random", seed=0, std=0.02), "meta")
    [plan] = [p for p in target.graphs() if "decode" in p.label]
    traced = trace_meta_graph(plan)
    recipe.export.quantization.quantize_graphs([(traced.model, traced.placeholders, traced.specs)], lambda _: None,
                                               True, plan.fused_layout)
    return traced.model, plan


def _attrs(node) -> dict:
    return {name: attr.value for name, attr in node.attributes.items()}


@pytest.fixture(scope="module")
def v2_lite_int4():
    return _decode_graph("deepseek-v2-lite", "fp16", "int4", 4)


def test_v2_lite_decode_is_one_qmoe_per_moe_layer_and_no_data_dependent_op(v2_lite_int4):
    """fp16, int4: three ``QMoE`` nodes in CUDA's layout (raw weights marked ``weights_prepacked=0``, fp16 scales,
    SwiGLU interleaved, top 6 of 64), nothing that depends on the data, within the node budget."""
    model, plan = v2_lite_int4
    nodes = list(model.graph.all_nodes())
    ops = collections.Counter(n.op_type for n in nodes)
    assert (plan.experts, plan.fused_layout) == ("fused", "cuda")
    assert not DATA_DEPENDENT & set(ops), ops
    assert len(nodes) <= V2_LITE_BUDGET, len(nodes)
    qmoe = [n for n in nodes if n.op_type == "QMoE"]
    assert len(qmoe) == 3 and ops["MoE"] == 0
    for node in qmoe:
        attrs = _attrs(node)
        assert [attrs[a] for a in ("weights_prepacked", "expert_weight_bits", "block_size", "k")] == [0, 4, 32, 6]
        assert [attrs[a] for a in ("swiglu_fusion", "normalize_routing_weights", "activation_type")] == [1, 1, "swiglu"]
        assert [node.inputs[i].dtype.name for i in (0, 1, 3, 6)] == ["FLOAT16"] * 4
        assert [int(d) for d in node.inputs[2].shape] == [64, 2 * 1408, 2048 // 2]


def test_v2_lite_routing_weights_are_handled_in_float32_and_clamped_before_the_cast(v2_lite_int4):
    """The hand-off to ``QMoE``'s ``router_probs``: ``Log`` of the weights in float32, clamped at -60 by a ``Max``,
    scattered over -1e4 and only then cast to float16 (a 1e-30 floor in float16 is 0 and its log -inf)."""
    model, _ = v2_lite_int4
    for qmoe in [n for n in model.graph.all_nodes() if n.op_type == "QMoE"]:
        cast = qmoe.inputs[1].producer()
        scatter = cast.inputs[0].producer()
        clamp = scatter.inputs[2].producer()
        log = clamp.inputs[0].producer()
        assert (cast.op_type, _attrs(cast)["to"]) == ("Cast", onnx.TensorProto.FLOAT16)
        assert scatter.op_type == "ScatterElements" and scatter.inputs[0].producer().op_type == "ConstantOfShape"
        assert float(scatter.inputs[0].producer().attributes["value"].value.numpy()[0]) == -1e4
        assert (clamp.op_type, float(clamp.inputs[1].const_value.numpy())) == ("Max", -60.0)
        assert log.op_type == "Log" and log.inputs[0].dtype.name == "FLOAT"


@pytest.mark.parametrize("precision,weights", [("fp16", "int4"), ("bf16", "float")])
def test_every_decode_node_has_a_cuda_kernel_for_its_type(v2_lite_int4, precision, weights):
    """Read against ONNX Runtime's CUDA kernel registry (:mod:`mla_deploy.ort.cuda_kernels`): no node of the
    V2-Lite decode graph would be placed on the CPU provider for want of a kernel; bf16 float experts are one float
    ``MoE`` per layer."""
    model = v2_lite_int4[0] if (precision, weights) == ("fp16", "int4") else \
        _decode_graph("deepseek-v2-lite", precision, weights, 4)[0]
    assert cuda_kernel_misses(model) == []
    if weights == "float":
        assert collections.Counter(n.op_type for n in model.graph.all_nodes())["MoE"] == 3


def test_an_fp32_exports_qmoe_has_no_cuda_kernel():
    """The fp32 export's ``QMoE`` (the CPU layout) would be placed on the CPU provider, and only it: why GPU exports
    are fp16/bf16 and carry the other layout."""
    fp32 = _decode_graph("deepseek-v2-lite", "fp32", "int4", 2)[0]
    assert {m.split()[0] for m in cuda_kernel_misses(fp32)} == {"QMoE"}


def test_deepseek_v3_shapes_decode_is_one_qmoe_per_moe_layer(tmp_path):
    """DeepSeek-V3's shapes (hidden 7168, 256 routed experts, top 8 after ``noaux_tc``'s group choice), one dense and
    one MoE layer: one ``QMoE`` over 256 experts, the group-limited choice in standard ops, nothing data-dependent,
    every node with a CUDA kernel."""
    model, plan = _decode_graph("deepseek-v3", "bf16", "int4", 2, first_k_dense_replace=1)
    nodes = list(model.graph.all_nodes())
    ops = collections.Counter(n.op_type for n in nodes)
    assert not DATA_DEPENDENT & set(ops) and cuda_kernel_misses(model) == []
    [qmoe] = [n for n in nodes if n.op_type == "QMoE"]
    assert (_attrs(qmoe)["k"], int(qmoe.inputs[2].shape[0]), qmoe.inputs[0].dtype.name) == (8, 256, "BFLOAT16")
    assert ops["TopK"] >= 3  # the groups' top-2 scores, the best groups, the experts
    assert len(nodes) <= V3_BUDGET, len(nodes)


# the fp32 twin: the cuda layout with fp32 activations, on ONNX Runtime's CPU provider ------------------------------

ROUTINGS = {
    "v2-greedy": dict(topk_method="greedy", scoring_func="softmax", n_group=1, topk_group=1, norm_topk_prob=False,
                      routed_scaling_factor=1.0),
    "v2-group-limited": dict(topk_method="group_limited_greedy", scoring_func="softmax", n_group=4, topk_group=2,
                             norm_topk_prob=False, routed_scaling_factor=16.0),
    "v3-noaux-tc": dict(topk_method="noaux_tc", scoring_func="sigmoid", n_group=4, topk_group=2, norm_topk_prob=True,
                        routed_scaling_factor=2.5),
}
K = 3


def _config(routing: str):
    """The tiny preset with 16 experts of width 64 (CUDA's ``QMoE`` tiles by 64), 3 chosen per token."""
    return tiny_recipe().model.replace(
        moe_intermediate_size=64, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=K,
        first_k_dense_replace=1, **ROUTINGS[routing])


def _layer(config) -> MoE:
    """A MoE layer with random weights; V3's score-correction bias random too (it changes which experts win)."""
    with torch.no_grad():
        layer = init_random_(MoE(config), std=0.3, seed=1).eval()
        if hasattr(layer.gate, "e_score_correction_bias"):
            layer.gate.e_score_correction_bias.copy_(0.1 * torch.randn(config.n_routed_experts,
                                                                       generator=torch.Generator().manual_seed(4)))
    return layer


@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_the_fp32_twin_of_the_cuda_layout_equals_pytorch(tmp_path, routing):
    """Router, routed experts (one float ``MoE`` given the cuda layout's hand-off) and shared expert, exported with
    fp32 activations and run by ONNX Runtime's CPU provider at 1 and 17 tokens: equal to PyTorch within 1e-5."""
    from torch.export import Dim

    from mla_deploy.ort.engine import open_session

    config = _config(routing)
    layer, d = _layer(config), config.hidden_size
    path = tmp_path / "moe.onnx"
    batch, seq = Dim("batch", min=1, max=64), Dim("seq", min=1, max=4096)
    with torch.no_grad():
        trace_to_onnx(layer, (torch.randn(2, 5, d),), path, [TensorSpec("x", "float32", ("batch", "seq", d))],
                      [TensorSpec("y", "float32", ("batch", "seq", d))], ({0: batch, 1: seq},), 24, "fused", "cuda")
    model = onnx.load(str(path))
    assert [n.op_type for n in model.graph.node if n.domain == "com.microsoft"] == ["MoE"]
    assert not DATA_DEPENDENT & {n.op_type for n in model.graph.node}
    assert any(n.op_type == "Max" and n.output[0] in {i for m in model.graph.node if m.op_type == "ScatterElements"
                                                       for i in m.input} for n in model.graph.node)  # the clamp
    session = open_session(path, threads=2)
    for tokens, seed in ((1, 3), (17, 5)):
        x = torch.randn(1, tokens, d, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            want = layer(x)
        got = torch.from_numpy(session.run(None, {"x": x.numpy()})[0])
        assert rel_err(got, want) <= TOL, (routing, tokens)


class _Experts(torch.nn.Module):
    """``(x [T, D], weights [T, k], idx [T, k]) -> [T, D]``, the routed experts alone, weights N(0, 0.1)."""

    def __init__(self, config):
        super().__init__()
        from mla_deploy.model.layers import Experts

        self.experts = init_random_(Experts(config), std=0.1, seed=0)

    def forward(self, x, weights, idx):
        return self.experts(x, weights, idx)


@dataclasses.dataclass
class _ExpertsTarget:
    """A target of the one export pipeline: one graph of :class:`_Experts` in the fused form's ``layout`` with
    ``dtype`` activations."""

    module: torch.nn.Module
    config: object
    quantization: object
    dtype: str = "float32"
    layout: str = "cuda"
    external_data_threshold: int = 1 << 30
    per_head_weights: bool = False

    def prepare(self, out, overwrite):
        return []

    def graphs(self):
        from torch.export import Dim

        d, tokens, float_type = self.config.hidden_size, Dim("tokens", min=1, max=4096), getattr(torch, self.dtype)
        inputs = [TensorSpec("x", self.dtype, ("tokens", d)), TensorSpec("weights", "float32", ("tokens", K)),
                  TensorSpec("idx", "int64", ("tokens", K))]
        args = (torch.zeros(5, d, dtype=float_type, device="meta"), torch.zeros(5, K, device="meta"),
                torch.zeros(5, K, dtype=torch.long, device="meta"))
        module = copy.deepcopy(self.module).to("meta").to(float_type).eval()
        return [GraphPlan("experts.onnx", "experts", module, args, ({0: tokens},) * 3, inputs,
                          [TensorSpec("y", self.dtype, ("tokens", d))], 24, (refuse_dense_experts,), "fused",
                          self.layout)]

    def finish(self, tmp, exported):
        return exported


def _export_experts(out: Path, weights: str, dtype: str = "float32", routing: str = "v3-noaux-tc"):
    config = _config(routing)
    module = _Experts(config)
    quantization = tiny_recipe(weights=weights).export.quantization
    run_export(_ExpertsTarget(module, config, quantization, dtype), out, ModuleTensors(module))
    return module, quantization, out / "experts.onnx"


def _routing(config, tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, config.hidden_size, generator=gen)
    idx = torch.stack([torch.randperm(config.n_routed_experts, generator=gen)[:K] for _ in range(tokens)])
    return x, torch.rand(tokens, K, generator=gen), idx


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_the_fp32_twin_with_quantized_experts_equals_pytorch(tmp_path, weights):
    """The cuda layout's ``QMoE`` (``weights_prepacked=0``) with fp32 activations, computed exactly (ONNX Runtime's
    CPU kernel ignores the attribute and reads the same raw bytes): equal within 1e-5 to PyTorch's experts on the
    weights ``quant.fake_quantize`` gives."""
    import onnxruntime as ort

    from mla_deploy.quant import fake_quantize

    module, quantization, path = _export_experts(tmp_path / "out", weights)
    [qmoe] = [n for n in onnx.load(str(path)).graph.node if n.op_type == "QMoE"]
    assert {a.name: a.i for a in qmoe.attribute}["weights_prepacked"] == 0
    model, entries = quantization.session(path, "fp32")
    options = ort.SessionOptions()
    for key, value in entries.items():
        options.add_session_config_entry(key, value)
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    scheme = quantization.scheme
    x, w, idx = _routing(_config("v3-noaux-tc"), 17, seed=2)
    with torch.no_grad():
        want = moe_experts(x, w, idx, fake_quantize(module.experts.gate_up_proj, scheme),
                           fake_quantize(module.experts.down_proj, scheme))
    got = session.run(None, {"x": x.numpy(), "weights": w.numpy(), "idx": idx.numpy()})[0]
    assert rel_err(torch.from_numpy(got), want) <= TOL


# the CUDA weight layout, read back in NumPy ------------------------------------------------------------------------

def _unpack(stored: np.ndarray, scales: np.ndarray, bits: int, block: int):
    """``QMoE``'s raw layout read back: ``uint8 [E, N, K*bits/8]`` (int4: two per byte, the first in the low nibble;
    zero point ``2^(bits-1)``) and scales ``[E, N, K/block]`` -> integers ``int [E, N, K]`` and the weights
    ``float64 [E, N, K]``."""
    if bits == 4:
        values = np.stack([stored & 0x0F, stored >> 4], axis=-1).reshape(*stored.shape[:-1], -1)
    else:
        values = stored
    q = values.astype(np.int64) - (1 << (bits - 1))
    return q, q * np.repeat(scales.astype(np.float64), block, axis=-1)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_the_cuda_weight_layout_dequantizes_to_the_checkpoints_weights(tmp_path, weights, dtype):
    """Each expert's stored ``QMoE`` weights, unpacked in NumPy: the integers are exactly ``quant.quantize``'s of the
    checkpoint's weights (gate and up rows interleaved for fc1), the scales its scales in the graph's type (exact
    for float16, which the scheme rounds them to; rounded for bfloat16), so the weights are
    ``quant.dequantize(quant.quantize(w))`` (exactly, in float16) and within half a step of the checkpoint's."""
    import ml_dtypes
    from onnx import numpy_helper

    module, quantization, path = _export_experts(tmp_path / "out", weights, dtype)
    scheme, model = quantization.scheme, onnx.load(str(path))
    inits = {t.name: t for t in model.graph.initializer}
    [qmoe] = [n for n in model.graph.node if n.op_type == "QMoE"]
    attrs = {a.name: a.i for a in qmoe.attribute}
    assert (attrs["weights_prepacked"], attrs["expert_weight_bits"], attrs["block_size"]) == (
        0, scheme.bits, scheme.block_size)
    gate_up, down = module.experts.gate_up_proj.detach(), module.experts.down_proj.detach()
    inter = gate_up.shape[1] // 2
    interleaved = torch.stack([gate_up[:, :inter], gate_up[:, inter:]], dim=2).reshape(gate_up.shape)
    for slot, checkpoint in ((2, interleaved), (5, down)):
        stored, scales = (numpy_helper.to_array(inits[qmoe.input[i]]) for i in (slot, slot + 1))
        assert stored.dtype == np.uint8 and inits[qmoe.input[slot + 1]].data_type == getattr(onnx.TensorProto,
                                                                                                 dtype.upper())
        scales = scales.view(ml_dtypes.bfloat16) if dtype == "bfloat16" and scales.dtype == np.uint16 else scales
        q, weight = _unpack(stored, scales, scheme.bits, scheme.block_size)
        for e, w in enumerate(checkpoint):
            want_q, want_scale = quantize(w.T, scheme)  # [K, N], [K/B, N]
            assert np.array_equal(q[e], want_q.T.numpy())
            typed = torch.from_numpy(scales[e].astype(np.float32)).T  # [K/B, N]
            assert torch.equal(typed, want_scale.to(getattr(torch, dtype)).float())
            if dtype == "float16":
                assert np.array_equal(weight[e], dequantize(want_q, want_scale, scheme).T.double().numpy())
            # the quantization's own error: half a step of the scheme's scale, plus, where the stored scale is
            # rounded (bfloat16), qmax times that rounding
            exact = want_scale.T.double().numpy()
            bound = 0.5 * exact + scheme.qmax * np.abs(exact - scales[e].astype(np.float64))
            error = np.abs(weight[e] - w.double().numpy())
            assert (error <= np.repeat(bound, scheme.block_size, axis=-1) * (1 + 1e-6)).all()


# an fp16 int4 export through the command line, its artifact check ------------------------------------------------

#: the tiny preset's [model] with MoE layers after the first: V3 routing, 16 experts of width 64
TINY_MOE = """
moe_intermediate_size = 64
n_routed_experts = 16
n_shared_experts = 1
num_experts_per_tok = 3
first_k_dense_replace = 1
n_group = 4
topk_group = 2
topk_method = "noaux_tc"
scoring_func = "sigmoid"
norm_topk_prob = true
routed_scaling_factor = 2.5
"""


def test_an_fp16_int4_export_of_a_tiny_moe_model_is_checked_and_runs_on_the_cpu(tmp_path):
    """``mla-deploy export --recipe tiny-moe.toml --precision fp16 --weights int4``: the manifest records fused
    experts, the decode graph holds one ``QMoE`` in the cuda layout (fp16 scales, ``weights_prepacked=0``), the
    artifact check passes, and ``mla-deploy run`` decodes with it on ONNX Runtime's CPU provider (whose fp16
    ``QMoE`` reads the same raw bytes; the CUDA kernel itself needs a GPU). A graph whose ``QMoE`` is edited out of
    the cuda layout (the attribute dropped, the manifest's digest re-recorded) is refused in one line."""
    import hashlib
    import json

    from click.testing import CliRunner

    from mla_deploy.artifact import check_artifact, load_manifest
    from mla_deploy.cli import main
    from mla_deploy.errors import ArtifactError
    from mla_deploy.recipe import presets_dir

    recipe = tmp_path / "tiny-moe.toml"
    text = (presets_dir() / "tiny.toml").read_text().replace('name = "tiny"', 'name = "tiny-moe"')
    recipe.write_text(text.replace("num_hidden_layers = 2\n", "num_hidden_layers = 2\n" + TINY_MOE.lstrip()))
    art = tmp_path / "art"
    result = CliRunner().invoke(main, ["export", "--recipe", str(recipe), "--out", str(art), "--precision", "fp16",
                                       "--weights", "int4"])
    assert result.exit_code == 0, result.output
    manifest = check_artifact(art)
    decode = manifest.graph("decode")
    assert (manifest.precision, decode.experts) == ("fp16", "fused")
    model = onnx.load(str(art / decode.file))
    [qmoe] = [n for n in model.graph.node if n.op_type == "QMoE"]
    assert {a.name: a.i for a in qmoe.attribute}["weights_prepacked"] == 0
    inits = {t.name: t.data_type for t in model.graph.initializer}
    assert inits[qmoe.input[3]] == inits[qmoe.input[6]] == onnx.TensorProto.FLOAT16
    assert cuda_kernel_misses(onnx.shape_inference.infer_shapes(model)) == []

    result = CliRunner().invoke(main, ["run", str(art), "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--json"])
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["sequences"][0]["tokens"]) == 4

    for attr in [a for a in qmoe.attribute if a.name == "weights_prepacked"]:
        qmoe.attribute.remove(attr)
    onnx.save(model, str(art / decode.file))
    data = json.loads((art / "manifest.json").read_text())
    blob = (art / decode.file).read_bytes()
    data["graphs"]["decode"].update(bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    (art / "manifest.json").write_text(json.dumps(data, indent=2))
    assert load_manifest(art).graph("decode").experts == "fused"
    with pytest.raises(ArtifactError, match=r"decode graph .*: its QMoE node .* is not in the cuda layout of a fp16 "
                                            r"export \(edited\?\)"):
        check_artifact(art)
