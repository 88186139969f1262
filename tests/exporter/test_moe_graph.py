"""The routed experts in ONNX, in both graph forms: one branch per expert with its own 2-D weights, or one ONNX
Runtime ``MoE``/``QMoE`` node per layer (fused), each equal to PyTorch in ONNX Runtime and to each other; and the
export's dense-MoE check (``dense_expert_products``, which follows what the expert weights feed) refuses every dense
formulation planted in the one export pipeline and passes the sparse ones, the fused node and attention products
shaped like an expert's."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from artifacts import tiny_recipe
from helpers import TOL, rel_err
from mla_deploy.errors import ExportError
from mla_deploy.exporter import GraphPlan, check_onnx_file, dense_expert_products, export_recipe, run_export, trace_to_onnx
from mla_deploy.exporter.export import refuse_dense_experts
from mla_deploy.exporter.weights import ModuleTensors
from mla_deploy.io_spec import TensorSpec
from mla_deploy.model.decoder import init_random_
from mla_deploy.model.layers import Experts, MoE, dense_experts_reference, moe_experts

K = 2
TOKENS = "tokens"


def _config():
    """The tiny preset with MoE layers after the first: 8 experts of width 32 in 4 groups, V3 routing."""
    return tiny_recipe().model.replace(
        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=K,
        first_k_dense_replace=1, n_group=4, topk_group=2, topk_method="noaux_tc", scoring_func="sigmoid",
        norm_topk_prob=True, routed_scaling_factor=2.5)


class _Experts(torch.nn.Module):
    """``(x [T, D], weights [T, k], idx [T, k]) -> [T, D]`` through ``experts`` (``moe_experts`` or the dense
    reference) with stacked weights N(0, 0.1); the last expert's weights are NaN (no test routes to it)."""

    def __init__(self, config, experts=moe_experts):
        super().__init__()
        e, i, d = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
        gen = torch.Generator().manual_seed(0)
        self.gate_up_proj = torch.nn.Parameter(0.1 * torch.randn(e, 2 * i, d, generator=gen))
        self.down_proj = torch.nn.Parameter(0.1 * torch.randn(e, d, i, generator=gen))
        with torch.no_grad():
            self.gate_up_proj[-1], self.down_proj[-1] = float("nan"), float("nan")
        self.experts = experts

    def forward(self, x, weights, idx):
        return self.experts(x, weights, idx, self.gate_up_proj, self.down_proj)


def _export_experts(module: torch.nn.Module, path: Path, config, experts: str = "branches") -> Path:
    from torch.export import Dim

    d = config.hidden_size
    inputs = [TensorSpec("x", "float32", (TOKENS, d)), TensorSpec("weights", "float32", (TOKENS, K)),
              TensorSpec("idx", "int64", (TOKENS, K))]
    tokens = Dim(TOKENS, min=1, max=4096)
    args = _inputs(config, 5, seed=0)
    with torch.no_grad():
        trace_to_onnx(module.eval(), args, path, inputs, [TensorSpec("y", "float32", (TOKENS, d))],
                      ({0: tokens}, {0: tokens}, {0: tokens}), 24, experts)
    return path


def _inputs(config, tokens: int, seed: int, idx=None):
    """``x [T, D]``, weights ``[T, k]`` and idx ``[T, k]`` (distinct experts per token, never the last one)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, config.hidden_size, generator=gen)
    if idx is None:
        idx = torch.stack([torch.randperm(config.n_routed_experts - 1, generator=gen)[:K] for _ in range(tokens)])
    return x, torch.rand(tokens, K, generator=gen), idx.reshape(tokens, K)


@pytest.fixture(scope="module", params=["branches", "fused"])
def sparse(request, tmp_path_factory):
    """The sparse experts module and an ONNX Runtime session of its export in each graph form (2 threads)."""
    from mla_deploy.ort.engine import open_session

    config = _config()
    module = _Experts(config)
    path = _export_experts(module, tmp_path_factory.mktemp("moe") / "experts.onnx", config, request.param)
    return module, open_session(path, threads=2)


CASES = {
    "one-token": (1, None),
    "two-tokens-same-experts": (2, torch.tensor([[3, 5], [5, 3]])),
    "seventeen-tokens": (17, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_onnx_runtime_equals_pytorch(sparse, case):
    """Equal within 1e-5, and finite although the last expert's weights are NaN: unrouted experts are not read."""
    module, session = sparse
    tokens, idx = CASES[case]
    x, w, idx = _inputs(_config(), tokens, seed=tokens, idx=idx)
    got = session.run(None, {"x": x.numpy(), "weights": w.numpy(), "idx": idx.numpy()})[0]
    with torch.no_grad():
        want = module(x, w, idx)
    assert np.isfinite(got).all()
    assert rel_err(torch.from_numpy(got), want) <= TOL
    ref = dense_experts_reference(x, w, idx, *(p.nan_to_num() for p in (module.gate_up_proj, module.down_proj)))
    assert rel_err(torch.from_numpy(got), ref.detach()) <= TOL


def test_onnx_runtime_takes_no_token(sparse):
    _, session = sparse
    x, w, idx = _inputs(_config(), 0, seed=0, idx=torch.zeros(0, K, dtype=torch.long))
    assert session.run(None, {"x": x.numpy(), "weights": w.numpy(), "idx": idx.numpy()})[0].shape == (0, 64)


def test_each_expert_is_one_branch_of_standard_ops(tmp_path):
    model = onnx.load(str(_export_experts(_Experts(_config()), tmp_path / "e.onnx", _config())))
    ops = [n.op_type for n in model.graph.node]
    assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}
    assert ops.count("NonZero") == 8 and ops.count("MatMul") == 16
    assert not {"Einsum", "ScatterND"} & set(ops)
    reductions = [onnx.helper.get_attribute_value(a) for n in model.graph.node if n.op_type == "ScatterElements"
                  for a in n.attribute if a.name == "reduction"]
    assert ops.count("ScatterElements") == 1 and set(reductions) <= {b"none"}  # the mask only, no scatter-add


def test_the_fused_experts_are_one_moe_node(tmp_path):
    """One ONNX Runtime MoE node reading the stacked weights (gate and up rows interleaved), a few standard ops
    around it to hand it our routing, no per-expert branch."""
    model = onnx.load(str(_export_experts(_Experts(_config()), tmp_path / "e.onnx", _config(), "fused")))
    ops = [(n.domain, n.op_type) for n in model.graph.node]
    assert ops.count(("com.microsoft", "MoE")) == 1 and len(ops) <= 14 and ("", "NonZero") not in ops
    [moe] = [n for n in model.graph.node if n.op_type == "MoE"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in moe.attribute}
    assert (attrs["k"], attrs["activation_type"], attrs["swiglu_fusion"], attrs["normalize_routing_weights"]) == (
        K, b"swiglu", 1, 1)


@pytest.mark.parametrize("weights", ["float", "int4", "int8"])
def test_fused_equals_branches_in_exact_compute(tmp_path, weights):
    """Through the export pipeline (float, and quantized: QMoE against MatMulNBits branches), both computing in fp32
    with the same (dequantized) weights: equal within 1e-5, although the fused kernel sums the experts in another
    order. int8 activations (the engines' default) are farther off, not equal. The export's dense-MoE check passes
    the fused node (it routes each token inside)."""
    import onnxruntime as ort

    config = _config()
    x, w, idx = _inputs(config, 17, seed=5)
    feeds = {"x": x.numpy(), "weights": w.numpy(), "idx": idx.numpy()}
    got = {}
    for experts in ("branches", "fused"):
        graph = _export_planted("sparse-branches", tmp_path / experts, weights, experts=experts).graphs["experts.onnx"]
        quantization = tiny_recipe(weights=weights).export.quantization
        fused = [n.op_type for n in graph.proto.graph.node if n.domain == "com.microsoft" and "MoE" in n.op_type]
        assert fused == ([] if experts == "branches" else ["MoE" if weights == "float" else "QMoE"])
        assert dense_expert_products(graph.proto, graph.experts) == []  # the fused node routes inside
        for compute in ("fp32", "int8"):
            model, entries = quantization.session(tmp_path / experts / "experts.onnx", compute)
            options = ort.SessionOptions()
            for key, value in entries.items():
                options.add_session_config_entry(key, value)
            session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
            got[experts, compute] = torch.from_numpy(session.run(None, feeds)[0])
    assert rel_err(got["fused", "fp32"], got["branches", "fp32"]) <= TOL
    if weights != "float":
        assert rel_err(got["fused", "int8"], got["branches", "fp32"]) > 10 * TOL


def test_the_full_moe_layer_equals_pytorch_in_onnx_runtime(tmp_path):
    """Router, routed experts and shared expert together, exported with their weights, at 17 tokens."""
    from torch.export import Dim

    from mla_deploy.ort.engine import open_session
    from mla_deploy.model.decoder import init_random_

    config = _config()
    with torch.no_grad():
        layer = init_random_(MoE(config), std=0.3, seed=1).eval()
    d = config.hidden_size
    batch, seq = Dim("batch", min=1, max=64), Dim("seq", min=1, max=4096)
    path = tmp_path / "moe.onnx"
    x = torch.randn(2, 5, d, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        trace_to_onnx(layer, (x,), path, [TensorSpec("x", "float32", ("batch", "seq", d))],
                      [TensorSpec("y", "float32", ("batch", "seq", d))], ({0: batch, 1: seq},), 24)
        x = torch.randn(1, 17, d, generator=torch.Generator().manual_seed(3))
        want = layer(x)
    got = open_session(path, threads=2).run(None, {"x": x.numpy()})[0]
    assert rel_err(torch.from_numpy(got), want) <= TOL


@pytest.fixture(scope="module")
def moe_artifact(tmp_path_factory) -> Path:
    """The tiny MoE model exported by ``export_recipe`` in the branch form (traced on the meta device, weights
    streamed)."""
    out = tmp_path_factory.mktemp("moe-artifact") / "art"
    export_recipe(tiny_recipe(experts="branches").replace(model=_config()), out)
    return out


def test_exported_decode_graph_computes_experts_on_their_tokens_with_per_expert_weights(moe_artifact):
    from mla_deploy.artifact import load_manifest

    manifest = load_manifest(moe_artifact)
    config = manifest.config
    decode = check_onnx_file(moe_artifact / manifest.graph("decode").file)
    shapes = {t.name: list(t.dims) for t in decode.graph.initializer}
    prefix = "model.model.layers.1.mlp.experts"
    d, i = config.hidden_size, config.moe_intermediate_size
    for e in range(config.n_routed_experts):  # each expert's weights on their own, stored as MatMul's B
        assert shapes[f"{prefix}.gate_up_proj.{e}.T"] == [d, 2 * i]
        assert shapes[f"{prefix}.down_proj.{e}.T"] == [i, d]
    assert not any(name in shapes for name in (f"{prefix}.gate_up_proj", f"{prefix}.down_proj"))
    matmul_b = {n.input[1] for n in decode.graph.node if n.op_type == "MatMul"}
    assert f"{prefix}.gate_up_proj.0.T" in matmul_b and f"{prefix}.down_proj.7.T" in matmul_b
    experts = [name for name in shapes if name.startswith(prefix)]
    assert len(experts) == 2 * config.n_routed_experts
    for role in ("prefill", "decode"):
        graph = check_onnx_file(moe_artifact / manifest.graph(role).file)
        assert dense_expert_products(graph, experts) == [], role


#: artifacts of the fused form over each routing method: (routing, weights, quant_format, decoder layers)
FUSED = {"v2-greedy-float": ({"topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False,
                              "routed_scaling_factor": 1.0}, "float", "matmulnbits", 2),
         "v2-group-limited-int4": ({"topk_method": "group_limited_greedy", "scoring_func": "softmax"}, "int4",
                                   "matmulnbits", 2),
         "v3-noaux-tc-int8-qdq": ({}, "int8", "qdq", 2)}


@pytest.fixture(scope="module", params=list(FUSED))
def fused_artifact(request, tmp_path_factory) -> Path:
    """The tiny MoE model (one graph for prefill and decode) with its experts fused, over each routing method and
    weight type (the qdq case asks for the fused form; ``auto`` gives it in the others)."""
    routing, weights, quant_format, layers = FUSED[request.param]
    recipe = tiny_recipe("concat", prefill_form="A_CC", weights=weights, quant_format=quant_format,
                         experts="fused" if quant_format == "qdq" else "auto")
    out = tmp_path_factory.mktemp("fused") / "art"
    export_recipe(recipe.replace(model=_config().replace(num_hidden_layers=layers, **routing)), out)
    return out


def test_the_fused_artifact_holds_one_operator_per_moe_layer(fused_artifact):
    """Recorded per graph; one MoE (float) or QMoE node per MoE layer and at most 12 nodes for a layer's experts
    (the branch form: about 11 per expert); the dense-MoE check passes it."""
    from mla_deploy.artifact import load_manifest

    manifest = load_manifest(fused_artifact)
    entry = manifest.graph("decode")
    assert entry.experts == "fused" and json.loads((fused_artifact / "manifest.json").read_text())["graphs"][
        "decode"]["experts"] == "fused"
    graph = check_onnx_file(fused_artifact / entry.file)
    moe_layers = range(manifest.config.first_k_dense_replace, manifest.config.num_hidden_layers)
    fused = [n for n in graph.graph.node if n.domain == "com.microsoft" and n.op_type in ("MoE", "QMoE")]
    op = "MoE" if manifest.quantization.weights == "float" else "QMoE"
    assert [n.op_type for n in fused] == [op] * len(moe_layers)
    for layer in moe_layers:
        scope = f"model.model.layers.{layer}.mlp.experts"
        assert 1 <= sum(scope in _namespace(n) for n in graph.graph.node) <= 12
    experts = [i.name for i in graph.graph.initializer if ".mlp.experts." in i.name]
    assert experts and dense_expert_products(graph, experts) == []


def _namespace(node) -> str:
    """The module scope the exporter recorded for ``node``."""
    return next((p.value for p in node.metadata_props if p.key == "namespace"), "")


def test_the_fused_artifact_equals_pytorch(fused_artifact):
    """Prefill and a decode step, fp32 compute on the (dequantized) weights, against PyTorch with the same weights."""
    from mla_deploy.artifact import load_manifest
    from mla_deploy.ort.engine import OrtEngine
    from mla_deploy.validate.reference import load_reference_model

    manifest = load_manifest(fused_artifact)
    ids = torch.randint(0, manifest.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(10).expand(2, 10)
    engine = OrtEngine(fused_artifact, threads=1, quantized_compute="fp32")
    state = engine.new_state(2)
    prefill = engine.forward("prefill", ids[:, :9].numpy(), pos[:, :9].numpy(), state)["logits"]
    decode = engine.forward("decode", ids[:, 9:].numpy(), pos[:, 9:].numpy(), state)["logits"]
    model = load_reference_model(fused_artifact, manifest, quantized=manifest.quantization.quantized)
    with torch.no_grad():
        want = model(ids, pos, model.empty_cache(2, 0))[0]
    got = torch.from_numpy(np.concatenate([prefill, decode], axis=1))
    assert rel_err(got, want) <= TOL


def test_tensorrt_build_refuses_the_fused_form_in_one_line(fused_artifact):
    """Before TensorRT is looked for: its parser cannot read ONNX Runtime's MoE/QMoE."""
    from cli_run import cli

    result = cli("build", str(fused_artifact))
    assert result.returncode == 1 and result.stderr.strip().count("\n") == 0
    assert "MoE/QMoE operators, which TensorRT cannot parse; re-export with --experts branches" in result.stderr


def _gathered_experts(x, weights, idx, gate_up_proj, down_proj):
    """Sparse another way: each token's own experts' weights gathered (``W[idx]``), k products per token."""
    gate, up = torch.einsum("td,tkid->tki", x, gate_up_proj[idx]).chunk(2, dim=-1)  # [T, k, I] each
    h = torch.einsum("tki,tkdi->tkd", torch.nn.functional.silu(gate) * up, down_proj[idx])  # [T, k, D]
    return (h * weights.unsqueeze(-1)).sum(1)


def _dense_loop(x, weights, idx, gate_up_proj, down_proj):
    """Dense: each expert's own 2-D weights on every token (quantizable MatMuls), weighted by the routing mask."""
    mask = torch.zeros(x.shape[0], gate_up_proj.shape[0], dtype=weights.dtype, device=x.device).scatter_add(-1, idx, weights)
    out = torch.zeros_like(x)
    for e in range(gate_up_proj.shape[0]):
        gate, up = torch.nn.functional.linear(x, gate_up_proj[e]).chunk(2, dim=-1)
        out = out + mask[:, e:e + 1] * torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down_proj[e])
    return out


def _dense_broadcast(x, weights, idx, gate_up_proj, down_proj):
    """Dense: every token times every expert's weights by broadcasting (Mul + ReduceSum, no MatMul)."""
    mask = torch.zeros(x.shape[0], gate_up_proj.shape[0], dtype=weights.dtype, device=x.device).scatter_add(-1, idx, weights)
    gate, up = (x[:, None, None, :] * gate_up_proj[None]).sum(-1).chunk(2, dim=-1)  # [T, E, I] each
    h = (((torch.nn.functional.silu(gate) * up)[:, :, None, :]) * down_proj[None]).sum(-1)  # [T, E, D]
    return (mask.unsqueeze(-1) * h).sum(1)


FORMS = {"sparse-branches": moe_experts, "sparse-gathered-weights": _gathered_experts,
         "dense-einsum": dense_experts_reference, "dense-loop": _dense_loop, "dense-broadcast": _dense_broadcast}


class _PlantedExperts(torch.nn.Module):
    """``(x [T, D], weights [T, k], idx [T, k]) -> [T, D]``: one of :data:`FORMS` over an ``Experts`` module's
    stacked weights (which is how the export knows them as routed-expert weights)."""

    def __init__(self, config, form: str):
        super().__init__()
        self.experts = init_random_(Experts(config), std=0.1, seed=0)
        self.form = form

    def forward(self, x, weights, idx):
        return FORMS[self.form](x, weights, idx, self.experts.gate_up_proj, self.experts.down_proj)


@dataclasses.dataclass
class _ExpertsTarget:
    """A target of the one export pipeline holding one graph of :class:`_PlantedExperts`, with the dense-MoE check."""

    module: torch.nn.Module
    config: object
    quantization: object = None
    quant_format: str = "matmulnbits"
    external_data_threshold: int = 1 << 30
    experts: str = "branches"
    per_head_weights: bool = False

    def prepare(self, out, overwrite):
        return []

    def graphs(self):
        from torch.export import Dim

        d, tokens = self.config.hidden_size, Dim(TOKENS, min=1, max=4096)
        inputs = [TensorSpec("x", "float32", (TOKENS, d)), TensorSpec("weights", "float32", (TOKENS, K)),
                  TensorSpec("idx", "int64", (TOKENS, K))]
        args = tuple(a.to("meta") for a in _inputs(self.config, 5, seed=0))
        module = copy.deepcopy(self.module).to("meta").eval()
        return [GraphPlan("experts.onnx", "planted experts", module, args, ({0: tokens},) * 3, inputs,
                          [TensorSpec("y", "float32", (TOKENS, d))], 24, (refuse_dense_experts,), self.experts)]

    def finish(self, tmp, exported):
        return exported


def _export_planted(form: str, out: Path, weights: str = "float", quant_format: str = "matmulnbits",
                    experts: str = "branches"):
    config = _config()
    module = _PlantedExperts(config, form)
    scheme = tiny_recipe(weights=weights, quant_format=quant_format).export.quantization
    target = _ExpertsTarget(module, config, scheme, quant_format, experts=experts)
    return run_export(target, out, ModuleTensors(module))


QUANT = {"float": ("float", "matmulnbits"), "int4-matmulnbits": ("int4", "matmulnbits"), "int8-qdq": ("int8", "qdq")}


@pytest.mark.parametrize("quant", list(QUANT))
@pytest.mark.parametrize("form", [f for f in FORMS if f.startswith("dense")])
def test_a_dense_moe_is_refused_in_every_form(tmp_path, form, quant):
    """Planted dense formulations through the export pipeline (float, and quantized in both formats where the
    expert weights are 2-D products): refused in one line naming the product and its expert weight."""
    with pytest.raises(ExportError) as refused:
        _export_planted(form, tmp_path / "out", *QUANT[quant])
    message = str(refused.value)
    assert "\n" not in message and "computes every expert for every token" in message
    assert "experts.gate_up_proj" in message and "every token of" in message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("quant", list(QUANT))
@pytest.mark.parametrize("form", [f for f in FORMS if f.startswith("sparse")])
def test_a_sparse_moe_passes(tmp_path, form, quant):
    """Controls: each expert on its routed tokens (the export's branches), or each token's experts gathered."""
    exported = _export_planted(form, tmp_path / "out", *QUANT[quant])
    graph = exported.graphs["experts.onnx"]
    assert graph.experts and dense_expert_products(graph.proto, graph.experts) == []
    if quant != "float" and form == "sparse-branches":  # the quantized parts are followed too
        assert any(name.endswith((".nbits", ".q")) for name in graph.experts)


def test_the_scan_follows_expert_weights_not_shapes():
    """Hand-built graphs: an attention product shaped like an expert's (``[E, T, I]`` with heads == experts) is
    not an expert; an expert weight reaching every token through views (transpose, dequantize, expand) is; one
    reaching the tokens its routing chose (``Gather(x, NonZero(...))``) is not."""
    from onnx import TensorProto, helper

    def graph(nodes, inits):
        inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 8]),
                  helper.make_tensor_value_info("column", TensorProto.FLOAT, ["T"])]
        return helper.make_model(helper.make_graph(
            nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
            initializer=[helper.make_tensor(n, TensorProto.FLOAT, [8, 8], [0.0] * 64) for n in inits]))

    attention = graph([helper.make_node("MatMul", ["x", "w_uk"], ["y"])], ["w_uk", "expert"])
    assert dense_expert_products(attention, ["expert"]) == []
    dense = graph([helper.make_node("Transpose", ["expert"], ["t"]), helper.make_node("Expand", ["t", "shape"], ["e"]),
                   helper.make_node("Shape", ["x"], ["shape"]), helper.make_node("Mul", ["x", "e"], ["y"])],
                  ["expert"])
    assert dense_expert_products(dense, ["expert"]) == ["Mul y (expert with every token of x)"]
    routed = graph([helper.make_node("NonZero", ["column"], ["nz"]), helper.make_node("Reshape", ["nz", "flat"], ["tok"]),
                    helper.make_node("Gather", ["x", "tok"], ["x_e"], axis=0),
                    helper.make_node("MatMul", ["x_e", "expert"], ["y"])], ["expert"])
    routed.graph.initializer.append(onnx.numpy_helper.from_array(np.array([-1], dtype=np.int64), "flat"))
    assert dense_expert_products(routed, ["expert"]) == []
    assert dense_expert_products(routed, []) == []  # no expert weights: nothing to follow


def test_a_fused_node_is_dense_when_it_takes_every_expert():
    """ONNX Runtime's MoE with k fewer than its experts routes inside (passes); with k = E it runs every expert on
    every token (refused)."""
    from onnx import TensorProto, helper

    def graph(k):
        inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["T", w]) for n, w in (("x", 8), ("probs", 4))]
        moe = helper.make_node("MoE", ["x", "probs", "fc1", "", "fc2"], ["y"], domain="com.microsoft", k=k)
        inits = [helper.make_tensor(n, TensorProto.FLOAT, dims, [0.0] * int(np.prod(dims)))
                 for n, dims in (("fc1", [4, 16, 8]), ("fc2", [4, 8, 8]))]
        return helper.make_model(helper.make_graph(
            [moe], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits))

    assert dense_expert_products(graph(2), ["fc1", "fc2"]) == []
    assert dense_expert_products(graph(4), ["fc1", "fc2"]) == ["MoE y (fc1 with every token of x)"]


def test_export_refuses_a_dense_moe_and_exports_heads_equal_to_experts(tmp_path, monkeypatch):
    """Through export_recipe: a model whose head count equals its expert count and whose latent width equals its
    expert width exports (the absorbed attention's ``[H, T, r]`` product is no expert's), and the same model with
    its experts computed densely is refused, nothing left behind."""
    config = _config().replace(n_routed_experts=4, n_group=2, topk_group=1, kv_lora_rank=32)  # 4 heads (tiny)
    assert config.num_attention_heads == config.n_routed_experts and config.kv_lora_rank == config.moe_intermediate_size
    export_recipe(tiny_recipe().replace(model=config), tmp_path / "ok")
    monkeypatch.setattr(Experts, "forward", lambda self, x, w, idx: dense_experts_reference(
        x, w, idx, self.gate_up_proj, self.down_proj))
    with pytest.raises(ExportError, match=r"decode graph decode\.onnx computes every expert for every token: \w+ "):
        export_recipe(tiny_recipe().replace(model=config), tmp_path / "dense")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok"]
