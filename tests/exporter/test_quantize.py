"""Quantized exports: every MatMul weight but the router's as a blocked DequantizeLinear (``qdq``, fused by ONNX
Runtime into MatMulNBits: the optimized graph holds no DequantizeLinear) or as ONNX Runtime's own MatMulNBits
(``matmulnbits``), and the fused experts' stacked weights as QMoE (the ``matmulnbits`` int4 case: ``auto`` makes
the fused form there, the branch form for ``qdq`` and for blocks of 128 wider than the experts); the same numbers
as PyTorch with the same dequantized weights; the manifest's record."""

from __future__ import annotations

import collections
import dataclasses
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from artifacts import tiny_recipe
from cli_run import cli
from mla_deploy.artifact import load_manifest
from mla_deploy.ort.engine import OrtEngine, session_options
from mla_deploy.exporter import export_recipe
from mla_deploy.quant import QDQ
from mla_deploy.validate.reference import load_reference_model


def _moe_recipe(weights: str, block_size: int = 32, **export):
    """The tiny preset, its second layer a MoE of 8 experts (V3 routing), with quantized weights."""
    recipe = tiny_recipe("concat", weights=weights, block_size=block_size, prefill_form="A_CC", **export)
    return recipe.replace(model=recipe.model.replace(
        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=4, topk_group=2, topk_method="noaux_tc", scoring_func="sigmoid",
        norm_topk_prob=True, routed_scaling_factor=2.5))


CASES = [("int4", 32, 64 << 20, "qdq"), ("int8", 64, 0, "qdq"), ("int4", 32, 0, "matmulnbits"),
         ("int8", 128, 64 << 20, "matmulnbits")]


@pytest.fixture(scope="module", params=CASES, ids=[f"{c[3]}-{c[0]}-{'inline' if c[2] else 'file'}" for c in CASES])
def quantized(request, tmp_path_factory):
    weights, block, threshold, quant_format = request.param
    out = tmp_path_factory.mktemp(weights) / "artifact"
    export_recipe(_moe_recipe(weights, block, external_data_threshold=threshold, quant_format=quant_format), out)
    return out, weights, block, threshold == 0


def test_every_matmul_weight_but_the_router_is_quantized(quantized):
    out, weights, block, in_file = quantized
    manifest = load_manifest(out)
    model = onnx.load(str(out / "model.onnx"))
    record = manifest.quantization
    assert (record.weights, record.block_size) == (weights, block)
    written = json.loads((out / "manifest.json").read_text())["quantization"]
    assert (written["weights"], written["block_size"], written["symmetric"]) == (weights, block, True)
    assert (manifest.weights_data is not None) == in_file  # weights.data, or inline in the graph
    inits = {i.name: i for i in model.graph.initializer}
    if record.format is QDQ:
        dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
        assert len(dq) == record.tensors and not [n for n in model.graph.node if n.op_type == "MatMulNBits"]
        for node in dq:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert attrs == {"axis": 0, "block_size": block}
            q, scale = inits[node.input[0]], inits[node.input[1]]
            assert q.data_type == (onnx.TensorProto.INT4 if weights == "int4" else onnx.TensorProto.INT8)
            assert scale.data_type == onnx.TensorProto.FLOAT and scale.dims[0] == -(-q.dims[0] // block)
    else:
        nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
        qmoe = _check_qmoe(model, weights, block, manifest.graph("decode").experts == "fused")
        assert len(nbits) + 2 * len(qmoe) == record.tensors
        assert not [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
        for node in nbits:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert (attrs["bits"], attrs["block_size"], attrs["accuracy_level"]) == (int(weights[3:]), block, 4)
            q, scale = inits[node.input[1]], inits[node.input[2]]
            blocks = -(-attrs["K"] // block)
            assert q.data_type == onnx.TensorProto.UINT8 and list(q.dims) == [attrs["N"], blocks, block * attrs["bits"] // 8]
            assert list(scale.dims) == [attrs["N"] * blocks]
    keys = set(record.keys)
    layer1 = "model.layers.1."
    assert {"lm_head.weight", layer1 + "mlp.experts.gate_up_proj", layer1 + "mlp.experts.down_proj",
            layer1 + "self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight"} <= keys
    assert not [k for k in keys if "embed" in k or "norm" in k or k.endswith("mlp.gate.weight") or "kv_b" in k]
    float_inits = [i for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT]
    assert any("embed_tokens" in i.name for i in float_inits) and any("mlp.gate" in i.name for i in float_inits)


def _check_qmoe(model, weights: str, block: int, fused: bool) -> list:
    """The QMoE nodes of an artifact (one per MoE layer when the manifest says ``fused``, else none) and their
    layout: ``uint8 [E, N, K*bits/8]`` and scales ``[E, N, K/block]``."""
    qmoe = [n for n in model.graph.node if n.op_type == "QMoE"]
    assert len(qmoe) == (1 if fused else 0)
    inits = {i.name: list(i.dims) for i in model.graph.initializer}
    bits = int(weights[3:])
    for node in qmoe:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert (attrs["expert_weight_bits"], attrs["block_size"], attrs["accuracy_level"], attrs["swiglu_fusion"]) == (
            bits, block, 4, 1)
        for slot, (n, k) in ((2, (64, 64)), (5, (64, 32))):  # fc1 [E, 2I, D], fc2 [E, D, I]
            assert inits[node.input[slot]] == [8, n, k * bits // 8]
            assert inits[node.input[slot + 1]] == [8, n, k // block]
    return qmoe


@pytest.mark.parametrize("compute", ["int8", "fp32"])
def test_onnx_runtime_fuses_every_dequantize_into_matmulnbits(quantized, compute, tmp_path):
    out = quantized[0]
    record = load_manifest(out).quantization
    if record.format is not QDQ:
        pytest.skip("the matmulnbits format holds MatMulNBits already")
    options = session_options(1)
    model, entries = record.session(out / "model.onnx", compute)  # the session option of the exact compute
    for key, value in entries.items():
        options.add_session_config_entry(key, value)
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(str(tmp_path / "optimized.onnx"), load_external_data=False)
    ops = collections.Counter(n.op_type for n in optimized.graph.node)
    assert ops["DequantizeLinear"] == 0
    assert ops["MatMulNBits"] == record.tensors


def test_exact_compute_equals_pytorch_with_the_dequantized_weights(quantized):
    """fp32 arithmetic on the quantized weights is PyTorch's on the same dequantized weights (fp32 tolerance);
    the unquantized model is farther off (the check can tell them apart), and int8 activations farther still."""
    out = quantized[0]
    manifest = load_manifest(out)
    ids = torch.randint(0, manifest.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9).expand(2, 9)
    logits = {}
    for compute in ("fp32", "int8"):
        engine = OrtEngine(out, threads=1, quantized_compute=compute)
        logits[compute] = engine.forward("prefill", ids.numpy(), pos.numpy(), engine.new_state(2))["logits"]
    with torch.no_grad():
        for name, flag in (("dequantized", True), ("float", False)):
            model = load_reference_model(out, manifest, quantized=flag)
            logits[name] = model(ids, pos, model.empty_cache(2, 0))[0].numpy()
    np.testing.assert_allclose(logits["fp32"], logits["dequantized"], atol=1e-4, rtol=1e-4)
    exact = np.abs(logits["fp32"] - logits["dequantized"]).max()
    assert np.abs(logits["float"] - logits["dequantized"]).max() > 50 * exact
    assert np.abs(logits["int8"] - logits["dequantized"]).max() > 10 * exact


def test_block_size_without_quantized_weights_is_one_line(tmp_path):
    result = cli("export", "--preset", "tiny", "--out", str(tmp_path / "a"), "--block-size", "64")
    assert result.returncode == 1 and result.stderr.strip().count("\n") == 0
    assert "--block-size needs --weights int8 or int4" in result.stderr
    assert not (tmp_path / "a").exists()


def test_tensorrt_build_refuses_matmulnbits_in_one_line(quantized):
    """Before TensorRT is looked for: such an artifact could never be parsed by it."""
    out = quantized[0]
    if load_manifest(out).quantization.format.tensorrt:
        pytest.skip("qdq artifacts are TensorRT's format")
    result = cli("build", str(out))
    assert result.returncode == 1 and result.stderr.strip().count("\n") == 0
    if load_manifest(out).graph("decode").experts == "fused":  # said first: the experts
        assert "MoE/QMoE operators, which TensorRT cannot parse; re-export with --experts branches" in result.stderr
    else:
        assert "MatMulNBits nodes, which TensorRT cannot parse; export with --quant-format qdq" in result.stderr


def test_quant_format_without_quantized_weights_is_one_line(tmp_path):
    result = cli("export", "--preset", "tiny", "--out", str(tmp_path / "a"), "--quant-format", "qdq")
    assert result.returncode == 1 and "--quant-format needs --weights int8 or int4" in result.stderr
    assert not (tmp_path / "a").exists()


def test_the_record_describes_the_graphs_and_their_bytes(quantized):
    """The graphs hold what the record says (read from their nodes and initializers, as the artifact check does),
    and the bytes the record counts are what the format says each quantized key stores (the bench's bound)."""
    from mla_deploy.model import MLAForCausalLM
    from mla_deploy.quant import observe_graphs

    out = quantized[0]
    manifest = load_manifest(out)
    record = manifest.quantization
    graphs = observe_graphs(onnx.load(str(out / g.file), load_external_data=False) for g in manifest.graphs.values())
    assert record.disagreement(graphs) is None
    kind = (int(record.weights[3:]), record.block_size)
    fused = manifest.graph("decode").experts == "fused"
    assert (("qmoe", *kind) in graphs.held) == fused  # the fused experts' weights, whatever the format
    assert graphs.counted_as(record.format.name).held == {(record.format.name, *kind): record.tensors}
    edited = dataclasses.replace(graphs, held={**graphs.held, (record.format.name, *kind): 1})
    assert "its quantization record says" in record.disagreement(edited)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in MLAForCausalLM(manifest.config, "CC").state_dict().items()}
    assert record.quantized_nbytes(shapes, 4) == record.bytes


def _heads_recipe(weights: str, quant_format: str, prefill_form: str = "A_CC"):
    """The tiny preset with per-head products whose input features fill blocks of 32 (``w_uk`` sums over
    ``qk_nope_head_dim`` 32, ``w_uv`` over ``kv_lora_rank`` 64), quantized in blocks of 32."""
    recipe = tiny_recipe("concat", weights=weights, block_size=32, prefill_form=prefill_form, quant_format=quant_format)
    return recipe.replace(model=recipe.model.replace(kv_lora_rank=64, qk_nope_head_dim=32, v_head_dim=32))


@pytest.fixture(scope="module", params=["int4", "int8"])
def per_head(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("heads") / "artifact"
    export_recipe(_heads_recipe(request.param, "matmulnbits"), out)
    return out


def test_matmulnbits_quantizes_the_absorbed_halves_per_head(per_head, tmp_path):
    """Each layer's w_uk and w_uv: signed integers [H, N, K] and scales [H, N, K/32] read by DequantizeLinear along
    axis 2, transposed into the product; recorded per head; the plain session folds them into float constants once
    (its optimised graph holds no DequantizeLinear); the record describes the graphs and counts their bytes as the
    bench's absorbed model names them."""
    from mla_deploy.model import MLAForCausalLM
    from mla_deploy.quant import observe_graphs

    manifest = load_manifest(per_head)
    record, config = manifest.quantization, manifest.config
    layers = [f"model.layers.{i}.self_attn.kv_b_proj.weight" for i in range(config.num_hidden_layers)]
    assert record.per_head == tuple(layers) and not set(layers) & set(record.keys)
    assert json.loads((per_head / "manifest.json").read_text())["quantization"]["per_head"] == layers
    model = onnx.load(str(per_head / "model.onnx"), load_external_data=False)
    inits = {i.name: i for i in model.graph.initializer}
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == 2 * config.num_hidden_layers
    h, r, dn, dv = config.num_attention_heads, config.kv_lora_rank, config.qk_nope_head_dim, config.v_head_dim
    shapes = sorted(tuple(inits[n.input[0]].dims) for n in dq)
    assert shapes == sorted([(h, r, dn), (h, dv, r)] * config.num_hidden_layers)  # [H, N, K]
    int_type = onnx.TensorProto.INT4 if record.weights == "int4" else onnx.TensorProto.INT8
    for node in dq:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        q, scale = inits[node.input[0]], inits[node.input[1]]
        assert attrs == {"axis": 2, "block_size": 32} and q.data_type == int_type
        assert list(scale.dims) == [q.dims[0], q.dims[1], q.dims[2] // 32]
    graphs = observe_graphs([model])
    assert graphs.held[("headwise", record.scheme.bits, 32)] == 2 * config.num_hidden_layers
    assert record.disagreement(graphs) is None
    with torch.device("meta"):
        absorbed = {k: tuple(v.shape) for k, v in MLAForCausalLM(config, "A_CC").state_dict().items()}
    assert record.quantized_nbytes(absorbed, 4) == record.bytes

    options = session_options(1)
    path, entries = record.session(per_head / "model.onnx", "int8")
    for key, value in entries.items():
        options.add_session_config_entry(key, value)
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    ops = collections.Counter(n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx"),
                                                            load_external_data=False).graph.node)
    assert ops["DequantizeLinear"] == 0 and ops["Transpose"] < collections.Counter(
        n.op_type for n in model.graph.node)["Transpose"]


def test_per_head_weights_compute_what_pytorch_does_with_them_dequantized(per_head):
    """fp32 arithmetic equals PyTorch's with kv_b_proj quantized per head (w_uk in blocks of qk_nope_head_dim): the
    same weights quantized along kv_b_proj's own input features (as a Linear) are measurably farther off."""
    from mla_deploy.quant import fake_quantize

    manifest = load_manifest(per_head)
    ids = torch.randint(0, manifest.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9).expand(2, 9)
    engine = OrtEngine(per_head, threads=1, quantized_compute="fp32")
    got = engine.forward("prefill", ids.numpy(), pos.numpy(), engine.new_state(2))["logits"]
    with torch.no_grad():
        model = load_reference_model(per_head, manifest)
        want = model(ids, pos, model.empty_cache(2, 0))[0].numpy()
        state = load_reference_model(per_head, manifest, quantized=False).state_dict()
        for key in manifest.quantization.per_head:  # the same halves, quantized the Linear's way
            model.state_dict()[key].copy_(fake_quantize(state[key], manifest.quantization.scheme))
        linear_way = model(ids, pos, model.empty_cache(2, 0))[0].numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert np.abs(linear_way - want).max() > 50 * np.abs(got - want).max()


def test_bf16_graph_dequantizes_the_per_head_weights_in_float32(tmp_path):
    """ONNX Runtime has no DequantizeLinear producing bf16 on any provider (a CUDA session refused to load such a
    graph): a bf16 export stores the per-head scales in float32, dequantizes in float32 and casts the transposed
    weight to bf16; that chain runs in ONNX Runtime and gives each stored weight rounded once to bf16."""
    recipe = _heads_recipe("int4", "matmulnbits")
    export_recipe(recipe.replace(export=dataclasses.replace(recipe.export, precision="bf16")), tmp_path / "a")
    model = onnx.load(str(tmp_path / "a" / "model.onnx"))
    inits = {i.name: i for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == 2 * load_manifest(tmp_path / "a").config.num_hidden_layers
    for node in dq:
        q, scale = (onnx.numpy_helper.to_array(inits[name]) for name in node.input[:2])
        assert inits[node.input[1]].data_type == onnx.TensorProto.FLOAT
        (transpose,) = [n for n in model.graph.node if node.output[0] in n.input]
        (cast,) = [n for n in model.graph.node if transpose.output[0] in n.input]
        assert transpose.op_type == "Transpose" and cast.op_type == "Cast"
        assert onnx.helper.get_attribute_value(cast.attribute[0]) == onnx.TensorProto.BFLOAT16
        assert producer[cast.output[0]] is cast and cast.output[0].endswith(".weight")
        # the chain alone, its bf16 result widened back to float32 (exact) to be read
        widen = onnx.helper.make_node("Cast", [cast.output[0]], ["widened"], to=onnx.TensorProto.FLOAT)
        graph = onnx.helper.make_graph(
            [node, transpose, cast, widen], "chain", [],
            [onnx.helper.make_tensor_value_info("widened", onnx.TensorProto.FLOAT, None)],
            [inits[name] for name in node.input[:2]])
        chain = onnx.helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
        got = ort.InferenceSession(chain.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {})[0]
        weight = q.astype(np.float32) * np.repeat(scale, 32, axis=2)[..., :q.shape[2]]
        want = torch.from_numpy(weight.transpose(0, 2, 1).copy()).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("quant_format, prefill_form", [("qdq", "A_CC"), ("matmulnbits", "CC")])
def test_absorbed_halves_stay_float_where_they_cannot_be_held_per_head(quant_format, prefill_form, tmp_path):
    """qdq (TensorRT's format) keeps them in the float type; so does a CC prefill, which multiplies with kv_b_proj
    whole (its blocks would run along another axis than the decode's)."""
    export_recipe(_heads_recipe("int4", quant_format, prefill_form), tmp_path / "a")
    record = load_manifest(tmp_path / "a").quantization
    assert record.per_head == () and not [k for k in record.keys if "kv_b" in k] and record.keys
    assert "per_head" not in json.loads((tmp_path / "a" / "manifest.json").read_text())["quantization"]
