"""The exported graphs: the I/O contract, the ONNX checks, the latent-only decode graph, the manifest."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from artifacts import tiny_artifact, tiny_recipe
from mla_deploy.errors import ExportError
from mla_deploy.artifact import Manifest, load_manifest
from mla_deploy.exporter import check_onnx_file, export_recipe, per_head_kv_tensors

MODES = ("static", "concat")


def _dims(value) -> list:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


@pytest.mark.parametrize("mode", MODES)
def test_manifest_names_every_input_and_output(mode):
    """manifest.json names each tensor with dtype and symbolic shape, the cache layout, roles, opset, versions."""
    root = tiny_artifact(mode)
    manifest = load_manifest(root)
    config = manifest.config
    c = config.latent_dim
    assert manifest.precision == "fp32" and manifest.opset == 24
    assert set(manifest.versions) >= {"mla_deploy", "torch", "onnx", "python"}
    assert manifest.cache["channels"] == {"c_kv": [0, config.kv_lora_rank], "k_pe": [config.kv_lora_rank, c]}
    assert [layer["past"] for layer in manifest.cache["layers"]] == ["past_latent.0", "past_latent.1"]
    assert {r: g.form for r, g in manifest.graphs.items()} == {"prefill": "CC", "decode": "A_CC"}
    inputs = {t.name: t.to_dict() for t in manifest.graphs["decode"].inputs}
    if mode == "concat":
        assert inputs["past_latent.0"]["shape"] == ["batch_size", "past_sequence_length", c]
        assert inputs["attention_mask"]["shape"] == ["batch_size", "total_sequence_length"]
    else:
        assert inputs["past_latent.0"]["shape"] == ["batch_size", 1, "max_cache_length", c]
        assert inputs["write_indices"] == {"name": "write_indices", "dtype": "int64", "shape": ["batch_size"]}
    for role, graph in manifest.graphs.items():
        model = onnx.load(str(root / graph.file), load_external_data=False)
        for value, spec in zip(list(model.graph.input) + list(model.graph.output), graph.inputs + graph.outputs):
            assert value.name == spec.name and _dims(value) == list(spec.shape), (role, value.name)


@pytest.mark.parametrize("mode", MODES)
def test_graphs_pass_full_checker_and_strict_shape_inference(mode):
    root = tiny_artifact(mode)
    for name in ("prefill.onnx", "decode.onnx"):
        inferred = check_onnx_file(root / name)
        assert inferred.ir_version <= 13, "ONNX Runtime 1.31 reads IR <= 13"
        assert len(inferred.graph.value_info) > 50


@pytest.mark.parametrize("mode", MODES)
def test_decode_graph_holds_no_per_head_kv_but_the_cc_prefill_does(mode):
    """The check is real: the CC-form prefill re-expands K/V per head over the cache and is flagged."""
    root = tiny_artifact(mode)
    config = load_manifest(root).config
    assert per_head_kv_tensors(check_onnx_file(root / "decode.onnx"), config) == []
    flagged = per_head_kv_tensors(check_onnx_file(root / "prefill.onnx"), config)
    assert flagged, "the CC prefill re-expands K and V per head; the detector must see it"


def test_static_graph_writes_the_cache_with_tensorscatter_and_concat_graph_concatenates():
    static = onnx.load(str(tiny_artifact("static") / "decode.onnx"))
    ops = [n.op_type for n in static.graph.node]
    assert ops.count("TensorScatter") == 2
    scatter = next(n for n in static.graph.node if n.op_type == "TensorScatter")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in scatter.attribute}
    assert attrs["axis"] == -2 and attrs["mode"] == b"linear"
    concat = onnx.load(str(tiny_artifact("concat") / "decode.onnx"))
    assert "TensorScatter" not in [n.op_type for n in concat.graph.node]


@pytest.mark.parametrize("precision,elem", [("fp16", onnx.TensorProto.FLOAT16), ("bf16", onnx.TensorProto.BFLOAT16)])
def test_low_precision_exports_carry_their_dtype(precision, elem):
    """Every float input, output and weight carries the dtype; only rope frequencies and scalar constants of the
    float32 internals (rope angles, softmax, RMSNorm statistics) stay float32."""
    root = tiny_artifact("static", precision)
    for name in ("prefill.onnx", "decode.onnx"):
        check_onnx_file(root / name)
        model = onnx.load(str(root / name))
        floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
        for value in list(model.graph.input) + list(model.graph.output):
            if value.type.tensor_type.elem_type in floats:
                assert value.type.tensor_type.elem_type == elem, value.name
        weights = [i for i in model.graph.initializer if i.data_type == elem]
        assert len(weights) > 20 and sum(int(np.prod(w.dims)) for w in weights) > 10_000
        fp32 = [i for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT]
        assert all(int(np.prod(i.dims)) <= load_manifest(root).config.qk_rope_head_dim // 2 for i in fp32)


def test_export_refuses_a_directory_holding_another_model(tmp_path):
    out = tmp_path / "art"
    (out).mkdir()
    (out / "manifest.json").write_text(json.dumps({"format": "mla-deploy-artifact", "fingerprint": "other"}))
    with pytest.raises(ExportError, match="already holds a different model"):
        export_recipe(tiny_recipe(), out)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="not empty"):
        export_recipe(tiny_recipe(), tmp_path / "busy")


def test_export_returns_the_manifest_it_writes(tmp_path):
    """export_recipe returns the Manifest saved as manifest.json; --overwrite replaces another model's folder."""
    out = tmp_path / "art"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"format": "mla-deploy-artifact", "fingerprint": "other"}))
    manifest = export_recipe(tiny_recipe("concat"), out, overwrite=True)
    assert isinstance(manifest, Manifest) and manifest.layout.mode == "concat" and manifest.capacity is None
    assert json.loads((out / "manifest.json").read_text()) == json.loads(json.dumps(manifest.to_dict()))
    assert load_manifest(out).graphs == manifest.graphs and manifest.weights.kind == "random"
    assert (manifest.weights.file, manifest.weights.seed) == (None, tiny_recipe().export.seed)  # rebuilt, not stored
    assert not (out / "reference.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # no temporary folder left beside it


def test_failed_export_leaves_nothing_behind(tmp_path, monkeypatch):
    import mla_deploy.exporter.export as export

    def fail(*args, **kwargs):
        raise ExportError("simulated failure")

    monkeypatch.setattr(export, "save_graph", fail)  # after the weights are written
    with pytest.raises(ExportError, match="simulated"):
        export_recipe(tiny_recipe(), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("mode", MODES)
def test_public_tracing_pieces_export_a_fixed_length_head(tmp_path, mode):
    """DecoderGraph + cached_dynamic_shapes + trace_to_onnx (what the bench reuses) trace a graph whose head inputs
    have one new token ([batch_size, 1]) with the layout's control input and caches; the I/O is the layout's."""
    import torch

    from mla_deploy.cache_layout import get_layout
    from mla_deploy.exporter import DecoderGraph, cached_dynamic_shapes, trace_to_onnx
    from mla_deploy.io_spec import BATCH, TensorSpec
    from mla_deploy.model import build_model

    layout = get_layout(mode)
    config = tiny_recipe().model.replace(num_hidden_layers=1)
    model = build_model(config, "A_CC", seed=0).eval()
    head = [TensorSpec("input_ids", "int64", (BATCH, 1)), TensorSpec("position_ids", "int64", (BATCH, 1))]
    inputs, outputs = layout.io(config, "fp32", head_inputs=head,
                                head_outputs=[TensorSpec("logits", "float32", (BATCH, 1, config.vocab_size))])
    control, caches = layout.example_state(2, 5, 1, config.latent_dim, 1, 8, torch.float32)
    args = (torch.zeros(2, 1, dtype=torch.long), torch.full((2, 1), 5), control, *caches)
    path = tmp_path / "step.onnx"
    with torch.no_grad():
        trace_to_onnx(DecoderGraph(model, layout).eval(), args, path, inputs, outputs,
                      cached_dynamic_shapes(layout, ({0: BATCH}, {0: BATCH}), 1, steps=1), 24)
    graph = check_onnx_file(path).graph
    assert [v.name for v in graph.input] == [t.name for t in inputs]
    assert [_dims(v) for v in graph.input] == [list(t.shape) for t in inputs]


def test_weights_that_overflow_the_export_precision_are_refused(tmp_path):
    """A weight finite in float32 but past float16's range would be written as Inf: refused, named, as an
    overflow (a NaN in the source itself is 'holds NaN', tested through the CLI); nothing is left behind."""
    import torch

    from mla_deploy.model import build_model

    recipe = tiny_recipe("static", "fp16")
    model = build_model(recipe.model)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, :3] = 1e6
    out = tmp_path / "x"
    with pytest.raises(ExportError, match=r"weight model\.layers\.1\.mlp\.down_proj\.weight overflows float16 with "
                                          r"Inf \(3 of \d+ values\)"):
        export_recipe(recipe, out, model=model)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_moe_model_cut_to_its_dense_layers_runs(tmp_path):
    """`export --layers N` of a MoE model keeping only its first (dense) layers: the graph holds no expert, and the
    artifact check accepts it (it refused it as fused experts missing); `run` generates."""
    from cli_run import cli, ok

    recipe = tmp_path / "moe.toml"
    recipe.write_text('[model]\nname = "moe"\nmodel_type = "deepseek_v3"\nvocab_size = 64\nhidden_size = 32\n'
                      'intermediate_size = 48\nnum_hidden_layers = 3\nnum_attention_heads = 2\nq_lora_rank = 16\n'
                      'kv_lora_rank = 8\nqk_nope_head_dim = 4\nqk_rope_head_dim = 4\nv_head_dim = 4\n'
                      'moe_intermediate_size = 16\nn_routed_experts = 4\nn_shared_experts = 1\nnum_experts_per_tok = 2\n'
                      'first_k_dense_replace = 2\ntopk_method = "noaux_tc"\nscoring_func = "sigmoid"\n')
    ok(cli("export", "--recipe", recipe, "--layers", 1, "--out", tmp_path / "art"))
    assert "sequence 0:" in ok(cli("run", tmp_path / "art", "--no-engine", "--prompt-ids", "1,2,3", "--max-new-tokens", 2,
                                   "--threads", 1))
