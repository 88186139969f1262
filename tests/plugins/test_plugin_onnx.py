"""``[export] decode_attention = "plugin"``: the decode graph's attention as one ``mla_deploy::MlaDecode`` node.

No TensorRT needed: the node, its inputs, attributes and shapes are read from the exported ONNX (which passes
``onnx.checker`` with full_check and strict shape inference), and the eager op that pins its semantics is
compared with the standard absorbed attention.
"""

from __future__ import annotations

import dataclasses

import onnx
import pytest
import torch

from mla_deploy import load_recipe
from mla_deploy.cache_layout import STATIC
from mla_deploy.errors import ConfigError
from mla_deploy.exporter import check_onnx_file
from mla_deploy.exporter.decode_plugin import DOMAIN, OP_TYPE, PluginDecodeAttention, use_decode_plugin
from mla_deploy.exporter.graphs import DecoderGraph
from mla_deploy.model import build_model
from mla_deploy.recipe import recipe_from_dict


def plugin_recipe(layers: int = 1):
    recipe = load_recipe("tiny")
    return recipe.replace(model=recipe.model.replace(num_hidden_layers=layers),
                          export=dataclasses.replace(recipe.export, decode_attention="plugin"))


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """A one-layer tiny export (static cache) with the plugin decode attention."""
    from mla_deploy.exporter import export_recipe

    out = tmp_path_factory.mktemp("plugin") / "tiny-plugin"
    export_recipe(plugin_recipe(), out)
    return out


def _dims(value) -> list:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def test_decode_graph_holds_one_mla_decode_node_per_layer(artifact):
    config = plugin_recipe().model
    inferred = check_onnx_file(artifact / "decode.onnx")  # onnx.checker full_check + strict shape inference
    nodes = [n for n in inferred.graph.node if n.op_type == OP_TYPE]
    assert len(nodes) == config.num_hidden_layers
    assert {(o.domain, o.version) for o in inferred.opset_import} >= {(DOMAIN, 1), ("", 24)}
    node = nodes[0]
    assert node.domain == DOMAIN and len(node.input) == 3 and len(node.output) == 1
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["kv_lora_rank"] == config.kv_lora_rank
    assert attrs["softmax_scale"] == pytest.approx(config.softmax_scale, rel=1e-6)
    assert attrs["plugin_namespace"] == DOMAIN.encode()  # what TensorRT's ONNX parser looks the plugin up by
    values = {v.name: v for v in list(inferred.graph.value_info) + list(inferred.graph.input)
              + list(inferred.graph.output)}
    q, cache, lengths = (values[name] for name in node.input)
    h, c, r = config.num_attention_heads, config.latent_dim, config.kv_lora_rank
    assert _dims(q) == ["batch_size", h, "sequence_length", c]
    assert cache.name == "present_latent.0"  # the cache after this step's in-place write
    assert _dims(cache) == ["batch_size", 1, "max_cache_length", c]
    assert _dims(lengths) == ["batch_size"] and lengths.type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert _dims(values[node.output[0]]) == ["batch_size", h, "sequence_length", r]
    # no softmax over the cache is left in the decode graph: the plugin does it
    assert not [n for n in inferred.graph.node if n.op_type == "Softmax"]


def test_prefill_stays_standard_and_the_manifest_says_so(artifact):
    prefill = onnx.load(str(artifact / "prefill.onnx"), load_external_data=False)
    assert not [n for n in prefill.graph.node if n.op_type == OP_TYPE]
    from mla_deploy.artifact import load_manifest

    graphs = load_manifest(artifact).graphs
    assert graphs["decode"].attention == "plugin" and graphs["prefill"].attention == "standard"


@pytest.mark.parametrize("form", ["A_CC", "A_CC_ME"])
@torch.no_grad()
def test_plugin_attention_equals_the_standard_absorbed_attention(form):
    """Decode steps through the static cache: the eager MlaDecode op gives the standard graph's logits and cache."""
    from mla_deploy.model.cache import StaticCache

    config = plugin_recipe(layers=2).model
    standard = build_model(config, form, std=0.3, seed=0)
    plugin = use_decode_plugin(build_model(config, form, std=0.3, seed=0))
    assert all(isinstance(layer.self_attn, PluginDecodeAttention) for layer in plugin.model.layers)
    batch, capacity = 3, 16
    past_a = standard.empty_cache(batch, capacity, layout=STATIC)
    past_b = plugin.empty_cache(batch, capacity, layout=STATIC)
    lengths = torch.tensor([0, 2, 5])
    for step, width in enumerate([3, 1, 1, 2]):
        ids = torch.randint(0, config.vocab_size, (batch, width), generator=torch.Generator().manual_seed(step))
        pos = lengths.view(-1, 1) + torch.arange(width)
        logits_a, past_a = standard(ids, pos, past_a, StaticCache(lengths))
        logits_b, past_b = plugin(ids, pos, past_b, StaticCache(lengths))
        scale = logits_a.abs().max()
        assert ((logits_a - logits_b).abs().max() / scale) < 1e-5
        for a, b in zip(past_a, past_b):  # A_CC: identical ops; A_CC_ME sums its two score terms apart
            assert ((a - b).abs().max() / a.abs().max()) < 1e-5
        lengths = lengths + width


def test_plugin_graph_wrapper_keeps_the_io_contract():
    model = use_decode_plugin(build_model(plugin_recipe().model, "A_CC", std=0.3))
    wrapper = DecoderGraph(model, STATIC)
    past = model.empty_cache(2, 8, layout=STATIC)
    logits, present = wrapper(torch.zeros(2, 1, dtype=torch.long), torch.tensor([[1], [4]]), torch.tensor([1, 4]),
                              *past)
    assert logits.shape == (2, 1, model.config.vocab_size) and present.shape == past[0].shape


def test_recipe_field_is_checked():
    model = load_recipe("tiny").model.to_dict()
    with pytest.raises(ConfigError, match="decode_attention must be standard or plugin"):
        recipe_from_dict({"model": model, "export": {"decode_attention": "fused"}}, "x.toml", "x")
    with pytest.raises(ConfigError, match="needs cache_mode"):
        recipe_from_dict({"model": model, "export": {"decode_attention": "plugin", "cache_mode": "concat"}},
                         "x.toml", "x")
    ok = recipe_from_dict({"model": model, "export": {"decode_attention": "plugin", "cache_mode": "static"}},
                          "x.toml", "x")
    assert ok.export.decode_attention == "plugin"
    assert load_recipe("tiny").export.decode_attention == "standard"


def test_plugin_needs_an_absorbed_form_and_the_static_cache():
    from mla_deploy.model.cache import ConcatCache

    with pytest.raises(ConfigError, match="absorbed decode_form"):
        use_decode_plugin(build_model(plugin_recipe().model, "CC"))
    model = use_decode_plugin(build_model(plugin_recipe().model, "A_CC"))
    with pytest.raises(ConfigError, match="static cache"):
        model(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), model.empty_cache(1, 0),
              ConcatCache())


def test_real_manifest_gives_static_profiles_and_a_plugin_build_plan(artifact):
    """The exported manifest (static cache, plugin decode) feeds the TensorRT profiles and build plan."""
    from mla_deploy.artifact import load_manifest
    from mla_deploy.trt.build import build_plan

    plan = build_plan(load_manifest(artifact), None, "11.4.0.106")
    decode, prefill = plan["decode.engine"], plan["prefill.engine"]  # two graphs: an engine each
    assert decode["attention"] == "plugin" and decode["strongly_typed"] and decode["roles"] == ["decode"]
    assert decode["profiles"][0]["past_latent.0"] == ((1, 1, 64, 24), (2, 1, 64, 24), (4, 1, 64, 24))
    assert decode["profiles"][0]["write_indices"] == ((1,), (2,), (4,))
    assert prefill["profiles"][0]["input_ids"] == ((1, 1), (2, 8), (4, 32))


def test_onnx_runtime_refuses_a_plugin_artifact_with_one_clear_error(artifact):
    from mla_deploy.errors import RuntimeMissingError
    from mla_deploy.ort.engine import OrtEngine

    with pytest.raises(RuntimeMissingError, match='decode_attention = "standard"'):
        OrtEngine(artifact)
