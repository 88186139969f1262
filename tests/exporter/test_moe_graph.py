"""The routed experts in ONNX: one branch per expert with its own 2-D weights, equal to PyTorch in ONNX Runtime,
and no tensor in the exported graphs spans all experts for every token (``all_expert_tensors``), which the
dense formulation does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from artifacts import tiny_recipe
from helpers import TOL, rel_err
from mla_deploy.exporter import all_expert_tensors, check_onnx_file, export_recipe, trace_to_onnx
from mla_deploy.io_spec import TensorSpec
from mla_deploy.model.layers import MoE, dense_experts_reference, moe_experts

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


def _export_experts(module: torch.nn.Module, path: Path, config) -> Path:
    from torch.export import Dim

    d = config.hidden_size
    inputs = [TensorSpec("x", "float32", (TOKENS, d)), TensorSpec("weights", "float32", (TOKENS, K)),
              TensorSpec("idx", "int64", (TOKENS, K))]
    tokens = Dim(TOKENS, min=1, max=4096)
    args = _inputs(config, 5, seed=0)
    with torch.no_grad():
        trace_to_onnx(module.eval(), args, path, inputs, [TensorSpec("y", "float32", (TOKENS, d))],
                      ({0: tokens}, {0: tokens}, {0: tokens}), 24)
    return path


def _inputs(config, tokens: int, seed: int, idx=None):
    """``x [T, D]``, weights ``[T, k]`` and idx ``[T, k]`` (distinct experts per token, never the last one)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, config.hidden_size, generator=gen)
    if idx is None:
        idx = torch.stack([torch.randperm(config.n_routed_experts - 1, generator=gen)[:K] for _ in range(tokens)])
    return x, torch.rand(tokens, K, generator=gen), idx.reshape(tokens, K)


@pytest.fixture(scope="module")
def sparse(tmp_path_factory):
    """The sparse experts module and an ONNX Runtime session of its export (2 threads)."""
    from mla_deploy.engines.ort_engine import open_session

    config = _config()
    module = _Experts(config)
    path = _export_experts(module, tmp_path_factory.mktemp("moe") / "experts.onnx", config)
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


def test_the_full_moe_layer_equals_pytorch_in_onnx_runtime(tmp_path):
    """Router, routed experts and shared expert together, exported with their weights, at 17 tokens."""
    from torch.export import Dim

    from mla_deploy.engines.ort_engine import open_session
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
    """The tiny MoE model exported by ``export_recipe`` (traced on the meta device, weights streamed)."""
    out = tmp_path_factory.mktemp("moe-artifact") / "art"
    export_recipe(tiny_recipe().replace(model=_config()), out)
    return out


def test_exported_decode_graph_holds_no_all_expert_tensor_and_per_expert_weights(moe_artifact):
    from mla_deploy.artifact import load_manifest

    manifest = load_manifest(moe_artifact)
    config = manifest.config
    decode = check_onnx_file(moe_artifact / manifest.graph("decode").file)
    assert all_expert_tensors(decode, config) == []
    shapes = {t.name: list(t.dims) for t in decode.graph.initializer}
    prefix = "model.model.layers.1.mlp.experts"
    d, i = config.hidden_size, config.moe_intermediate_size
    for e in range(config.n_routed_experts):  # each expert's weights on their own, stored as MatMul's B
        assert shapes[f"{prefix}.gate_up_proj.{e}.T"] == [d, 2 * i]
        assert shapes[f"{prefix}.down_proj.{e}.T"] == [i, d]
    assert not any(name in shapes for name in (f"{prefix}.gate_up_proj", f"{prefix}.down_proj"))
    matmul_b = {n.input[1] for n in decode.graph.node if n.op_type == "MatMul"}
    assert f"{prefix}.gate_up_proj.0.T" in matmul_b and f"{prefix}.down_proj.7.T" in matmul_b
    for role in ("prefill", "decode"):
        graph = check_onnx_file(moe_artifact / manifest.graph(role).file)
        assert all_expert_tensors(graph, config) == [], role


def test_the_scan_flags_the_dense_formulation(tmp_path):
    """Control: the dense formulation, exported the same way, holds ``[T, E, I]`` tensors and is flagged."""
    config = _config()
    dense = check_onnx_file(_export_experts(_Experts(config, dense_experts_reference), tmp_path / "dense.onnx",
                                            config))
    flagged = all_expert_tensors(dense, config)
    assert flagged and all(str(config.n_routed_experts) in f for f in flagged)
    assert all_expert_tensors(check_onnx_file(_export_experts(_Experts(config), tmp_path / "s.onnx", config)),
                              config) == []


def test_the_scan_needs_experts_a_width_and_a_token_axis():
    """Flagged: all experts x a per-expert width x a dynamic axis. Not flagged: the routing mask ``[T, E]`` (no
    width), the stacked weights ``[E, 2I, D]`` (no token axis), a branch ``[n_e, 2I]`` (no expert axis)."""
    config = _config()
    e, i, d = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
    shapes = {"mask": [TOKENS, e], "stacked": [e, 2 * i, d], "branch": [None, 2 * i], "logits": ["s0", e],
              "gate": [TOKENS, e, i], "gate_up": ["batch*seq", 2 * i, e], "unnamed": [None, e, 2 * i]}
    values = [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, dims) for name, dims in shapes.items()]
    graph = onnx.helper.make_graph([], "scan", [], [], value_info=values)
    flagged = [f.split()[0] for f in all_expert_tensors(onnx.helper.make_model(graph), config)]
    assert flagged == ["gate", "gate_up", "unnamed"]
    assert all_expert_tensors(onnx.helper.make_model(graph), tiny_recipe().model) == []  # no routed experts
