"""MLAConfig and from_hf_config: Hugging Face config.json in both rope spellings, and clear ConfigErrors."""

from __future__ import annotations

import copy
import math
import json
import warnings

import pytest

from mla_deploy import MLAConfig, YarnScaling, from_hf_config, load_recipe
from mla_deploy.config import LongRopeScaling
from mla_deploy.errors import ConfigError

# deepseek-ai/DeepSeek-V3 config.json as published (transformers 4.x spelling: rope_theta + rope_scaling.type)
V3_CONFIG_JSON = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.33.1",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}


def _v5_spelling(raw: dict) -> dict:
    """The same config as transformers 5 writes it: one rope_parameters block with rope_type and rope_theta."""
    out = copy.deepcopy(raw)
    block = out.pop("rope_scaling")
    block["rope_type"] = block.pop("type")
    block["rope_theta"] = float(out.pop("rope_theta"))
    out["rope_parameters"] = block
    return out


def _load_quietly(source) -> MLAConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no key of a real config.json may be silently unknown
        return from_hf_config(source, name="deepseek-v3")


@pytest.mark.parametrize("spelling", ["rope_theta+rope_scaling", "rope_parameters"])
def test_published_v3_config_json_equals_preset(spelling):
    """DeepSeek-V3's published config.json, in either rope spelling, reads to the deepseek-v3 preset."""
    raw = V3_CONFIG_JSON if spelling == "rope_theta+rope_scaling" else _v5_spelling(V3_CONFIG_JSON)
    assert _load_quietly(raw) == load_recipe("deepseek-v3").model


def test_published_config_through_transformers_autoconfig_equals_preset(tmp_path):
    """transformers 5 turns a published legacy ``rope_scaling`` into ``rope_parameters`` holding both ``type`` and
    ``rope_type``; the config it hands over (``AutoConfig`` -> ``to_dict()``, what ``absorb(hf_model)`` reads) is
    read as the published file is. Disagreeing spellings are refused."""
    transformers = pytest.importorskip("transformers")
    raw = {k: v for k, v in V3_CONFIG_JSON.items() if k not in ("auto_map", "quantization_config")}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    converted = transformers.AutoConfig.from_pretrained(tmp_path).to_dict()
    block = converted.get("rope_parameters") or converted.get("rope_scaling")
    assert {"type", "rope_type"} <= set(block)  # the spelling that used to be refused
    assert from_hf_config(converted, name="deepseek-v3") == load_recipe("deepseek-v3").model
    bad = copy.deepcopy(converted)
    (bad.get("rope_parameters") or bad["rope_scaling"])["type"] = "linear"
    with pytest.raises(ConfigError, match="disagree"):
        from_hf_config(bad)


def test_both_spellings_agree_on_yarn_values():
    """rope_theta and every YaRN field come through either spelling (spot check of non-default values)."""
    raw = copy.deepcopy(V3_CONFIG_JSON)
    raw["rope_theta"] = 50000
    raw["rope_scaling"].update(factor=8, mscale=0.707, mscale_all_dim=0.5, beta_fast=16)
    old, new = _load_quietly(raw), _load_quietly(_v5_spelling(raw))
    assert old == new
    assert old.rope_theta == 50000.0
    assert old.rope_scaling == YarnScaling(factor=8.0, original_max_position_embeddings=4096, beta_fast=16.0,
                                           beta_slow=1.0, mscale=0.707, mscale_all_dim=0.5)


def test_q_lora_rank_zero_or_null_means_plain_q_proj():
    """DeepSeek writes q_lora_rank null (V2-Lite) or 0: both mean no query compression."""
    for value in (None, 0):
        assert _load_quietly({**V3_CONFIG_JSON, "q_lora_rank": value}).q_lora_rank is None


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("yarn", [False, True], ids=["rope", "yarn"])
def test_transformers_save_pretrained_config_loads(tmp_path, version, yarn):
    """A config.json written by transformers' own save_pretrained loads (folder or file) with its values."""
    pytest.importorskip("transformers")
    import hf_oracle

    hf = hf_oracle.hf_config(version, yarn=yarn)
    hf.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in raw
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = from_hf_config(tmp_path)
        assert from_hf_config(tmp_path / "config.json") == config
    assert config.name == tmp_path.name
    assert config.model_type == f"deepseek_v{version}"
    for field in ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                  "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_group",
                  "topk_group", "routed_scaling_factor"):
        assert getattr(config, field) == getattr(hf, field), field
    if yarn:
        assert (config.rope_scaling.factor, config.rope_scaling.mscale, config.rope_scaling.mscale_all_dim) == (
            8.0, 0.707, 1.0)
    else:
        assert config.rope_scaling is None


@pytest.mark.parametrize("change, message", [
    pytest.param({"num_key_value_heads": 1}, r"num_key_value_heads \(1\) must equal num_attention_heads \(128\)",
                 id="kv_heads"),
    pytest.param({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported", id="hidden_act"),
    pytest.param({"qk_rope_head_dim": 63}, "qk_rope_head_dim must be even", id="odd_rope_dim"),
    pytest.param({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope scaling type 'linear' is not supported",
                 id="rope_type"),
    pytest.param({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope scaling type 'dynamic'",
                 id="rope_type_dynamic"),
    pytest.param({"topk_group": 9}, r"topk_group must be in 1..n_group \(8\), got 9", id="topk_group_gt_n_group"),
    pytest.param({"n_group": 7}, r"must be a multiple of n_group \(7\)", id="n_group_divides"),
    pytest.param({"n_routed_experts": 8}, r"each of the n_group \(8\) groups needs at least 2 of the 8 experts",
                 id="noaux_tc_one_expert_per_group"),
    pytest.param({"n_routed_experts": 16, "topk_group": 3}, r"the topk_group \(3\) groups kept hold 6 experts, "
                 r"fewer than num_experts_per_tok \(8\)", id="kept_groups_too_small"),
    pytest.param({"num_experts_per_tok": 300}, "num_experts_per_tok must be in 1..256", id="topk_gt_experts"),
    pytest.param({"model_type": "deepseek_v2", "rope_interleave": False},
                 "rope_interleave=false is not supported for deepseek_v2", id="rope_interleave_v2"),
    pytest.param({"attention_bias": True}, "attention_bias=True is not supported", id="attention_bias"),
    pytest.param({"model_type": "llama"}, "model_type 'llama' is not an MLA model mla-deploy reads", id="model_type"),
    pytest.param({"model_type": "kimi_linear"}, r"kimi_linear: linear-attention layers \(KDA\) are not supported",
                 id="refused_kimi_linear"),
    pytest.param({"model_type": "mistral_large4"}, r"mistral_large4: DeepSeek Sparse Attention, cross-layer latent",
                 id="refused_mistral_large4"),
    pytest.param({"model_type": "deepseek_v32", "index_topk": 0},
                 r"index_topk must be a positive integer \(DeepSeek Sparse Attention\), got 0", id="dsa_topk_zero"),
    pytest.param({"model_type": "glm_moe_dsa", "index_n_heads": True}, "index_n_heads must be an integer, got true",
                 id="dsa_heads_bool"),
    pytest.param({"model_type": "kimi_k25"}, "holds its text model's config in text_config, which is missing",
                 id="wrapper_without_text_config"),
    pytest.param({"model_type": "kimi_k25", "text_config": {"model_type": "llama"}},
                 "model_type 'llama' is not an MLA model", id="wrapper_of_other_model"),
    pytest.param({"rope_scaling": 5}, "rope_scaling must be a JSON object, got 5", id="rope_scaling_number"),
    pytest.param({"rope_theta": "big"}, 'rope_theta must be a number, got "big"', id="rope_theta_string"),
    pytest.param({"quantization_config": "x"}, 'quantization_config must be a JSON object, got "x"',
                 id="quantization_config_string"),
    pytest.param({"quantization_config": {"weight_block_size": {}}},
                 r"weight_block_size must be two positive integers, got \{\}", id="block_size_object"),
    pytest.param({"n_group": "8"}, 'n_group must be an integer, got "8"', id="n_group_string"),
    pytest.param({"norm_topk_prob": 1}, "norm_topk_prob must be true or false, got 1", id="bool_as_int"),
    pytest.param({"mlp_layer_types": ["dense"] * 61}, "contradictory MoE schedules", id="schedules_contradict"),
    pytest.param({"mlp_layer_types": ["dense", "moe"] + ["sparse"] * 59, "first_k_dense_replace": None},
                 "mlp_layer_types holds 'moe'", id="schedule_bad_word"),
    pytest.param({"mlp_layer_types": ["sparse"] * 3, "first_k_dense_replace": None},
                 "mlp_layer_types names 3 layers, num_hidden_layers is 61", id="schedule_length"),
    pytest.param({"moe_layer_freq": 0}, "moe_layer_freq must be a positive integer", id="moe_layer_freq_zero"),
    pytest.param({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 32, "long_factor": [2.0] * 32,
                                   "original_max_position_embeddings": 4096}},
                 r"longrope past original_max_position_embeddings \(4096 < max_position_embeddings 163840\)",
                 id="dynamic_longrope"),
    pytest.param({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [2.0] * 3,
                                   "original_max_position_embeddings": 163840}},
                 r"short_factor has 3 values, the rope has 32 pairs", id="longrope_factor_count"),
    pytest.param({"kv_lora_rank": None}, r"missing field\(s\) kv_lora_rank", id="missing_field"),
])
def test_hf_config_errors(change, message):
    """An unsupported or inconsistent config.json is a ConfigError with a one-line message naming the key."""
    raw = {**V3_CONFIG_JSON, **change}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ConfigError, match=message) as info:
        from_hf_config(raw)
    assert "\n" not in str(info.value)


def test_unreadable_hf_config(tmp_path):
    """A folder without config.json, or one that is not JSON, is a ConfigError."""
    with pytest.raises(ConfigError, match="no Hugging Face config"):
        from_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a readable JSON config"):
        from_hf_config(tmp_path)


@pytest.mark.parametrize("change, message", [
    pytest.param({"qk_rope_head_dim": 7}, "qk_rope_head_dim must be even", id="odd_rope_dim"),
    pytest.param({"topk_group": 3}, r"topk_group must be in 1..n_group \(2\)", id="topk_group_gt_n_group"),
    pytest.param({"scoring_func": "sigmoid"}, "scoring_func 'sigmoid' goes with topk_method 'noaux_tc'",
                 id="method_vs_scoring"),
    pytest.param({"model_type": "deepseek_v4"}, "model_type must be one of", id="model_type"),
    pytest.param({"q_lora_rank": 0}, "q_lora_rank must be a positive integer", id="q_lora_zero"),
])
def test_mla_config_validation(change, message):
    """MLAConfig itself rejects inconsistent values (here on a small MoE config) with a ConfigError."""
    base = load_recipe("tiny").model.replace(n_routed_experts=8, moe_intermediate_size=32, num_experts_per_tok=2,
                                             n_group=2, topk_group=1)
    with pytest.raises(ConfigError, match=message):
        base.replace(**change)


def test_first_layers_keeps_dense_layers_and_refuses_out_of_range():
    v2l = load_recipe("deepseek-v2-lite").model  # layer 0 dense, the rest MoE
    two = v2l.first_layers(2)
    assert (two.num_hidden_layers, two.first_k_dense_replace) == (2, 1)
    assert [two.is_moe_layer(i) for i in range(2)] == [False, True]
    v3 = load_recipe("deepseek-v3").model.first_layers(2)  # the first 3 layers of V3 are dense
    assert (v3.num_hidden_layers, v3.first_k_dense_replace) == (2, 2)
    for bad in (0, v2l.num_hidden_layers + 1, 999, True, 2.0):
        with pytest.raises(ConfigError, match="layers must be an integer in 1..27"):
            v2l.first_layers(bad)


def test_replace_rejects_unknown_fields():
    """replace() with a misspelt field is a ConfigError, not a silent no-op."""
    with pytest.raises(ConfigError, match="unknown config field"):
        load_recipe("tiny").model.replace(kv_lora_rnak=8)


def test_yarn_betas():
    """beta_fast may equal beta_slow (Kimi K2's release: 1 and 1; transformers accepts it), never be below it."""
    kimi = YarnScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0)
    assert (kimi.beta_fast, kimi.beta_slow) == (1.0, 1.0)
    with pytest.raises(ConfigError, match="beta_fast >= beta_slow > 0, got 1.0 and 2.0"):
        YarnScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=2.0)
    with pytest.raises(ConfigError, match="beta_fast >= beta_slow > 0"):
        YarnScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=0.0)


def test_yarn_scale_properties():
    """YaRN: softmax scale multiplier mscale(s, mscale_all_dim)**2; cos/sin amplitude mscale ratio (1 for V3)."""
    v3 = load_recipe("deepseek-v3").model.rope_scaling
    assert v3.cos_sin_scale == pytest.approx(1.0)
    assert v3.softmax_mscale == pytest.approx((0.1 * math.log(40) + 1) ** 2)
    odd = YarnScaling(factor=40.0, original_max_position_embeddings=4096, mscale=0.707, mscale_all_dim=1.0)
    assert odd.cos_sin_scale == pytest.approx(0.921042, abs=1e-6)  # value measured with transformers
    assert YarnScaling(factor=40.0, original_max_position_embeddings=4096).softmax_mscale == 1.0


@pytest.mark.parametrize("preset", ["tiny", "deepseek-v2-lite", "deepseek-v2", "deepseek-v3"])
def test_to_hf_config_round_trips(preset):
    """to_hf_config is the inverse of from_hf_config for every preset: a JSON dict in transformers 5's spelling
    (one rope_parameters block), every key known to from_hf_config (no warning), the same MLAConfig back."""
    from mla_deploy.config import to_hf_config
    from mla_deploy.recipe import preset_names

    assert preset in preset_names()
    config = load_recipe(preset).model
    raw = json.loads(json.dumps(to_hf_config(config)))
    assert raw["model_type"] == config.model_type and raw["num_key_value_heads"] == config.num_attention_heads
    assert "rope_scaling" not in raw and raw["rope_parameters"]["rope_theta"] == config.rope_theta
    assert raw["rope_parameters"]["rope_type"] == ("default" if config.rope_scaling is None else "yarn")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert from_hf_config(raw, name=config.name) == config
    assert to_hf_config(config, num_hidden_layers=3)["num_hidden_layers"] == 3


def test_to_hf_config_without_yarn_or_experts():
    """Plain rope and a dense model: rope_type default; no MoE keys, first_k_dense_replace = every layer."""
    from mla_deploy.config import to_hf_config

    config = load_recipe("tiny").model.replace(model_type="deepseek_v2", rope_scaling=None, rope_theta=5000.0)
    assert not config.is_moe
    raw = to_hf_config(config, num_hidden_layers=4)
    assert raw["rope_parameters"] == {"rope_type": "default", "rope_theta": 5000.0}
    assert "n_routed_experts" not in raw and raw["first_k_dense_replace"] == 4
    assert from_hf_config(raw, name=config.name) == config.replace(num_hidden_layers=4)


@pytest.mark.parametrize("preset", ["tiny", "deepseek-v2-lite", "deepseek-v3"])
def test_to_hf_config_builds_the_transformers_config(preset):
    """transformers accepts the dict (AutoConfig.for_model picks V2 or V3) and describes the same model: equal
    for MoE presets; a dense preset gets transformers' MoE defaults but no MoE layer."""
    transformers = pytest.importorskip("transformers")
    from mla_deploy.config import to_hf_config

    config = load_recipe(preset).model
    hf = transformers.AutoConfig.for_model(**to_hf_config(config))
    expected = {"deepseek_v2": "DeepseekV2Config", "deepseek_v3": "DeepseekV3Config"}[config.model_type]
    assert type(hf).__name__ == expected
    back = from_hf_config(hf.to_dict(), name=config.name)
    if config.is_moe:
        assert back == config
    else:
        moe = ("moe_intermediate_size", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group",
               "topk_group", "topk_method", "scoring_func", "routed_scaling_factor", "norm_topk_prob",
               "first_k_dense_replace")
        assert back.replace(**{k: getattr(config, k) for k in moe}) == config
        assert not any(back.is_moe_layer(i) for i in range(back.num_hidden_layers))


def test_family_config_fields_round_trip():
    """The fields the other MLA types add (a schedule, the MoE output norm, static longrope, MiniCPM3's scales)
    survive to_dict / from_dict (a manifest's config), and first_layers keeps the whole model's residual scale."""
    config = MLAConfig(name="x", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                       num_attention_heads=2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6,
                       moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2, topk_method="noaux_tc",
                       scoring_func="sigmoid", n_group=2, topk_group=1, mlp_layer_types=["dense", "sparse", "dense"],
                       post_mlp_layernorm=True, scale_emb=12, scale_depth=1.4, dim_model_base=8,
                       max_position_embeddings=256,
                       rope_scaling=LongRopeScaling([1.0, 2.0], [3.0, 4.0], original_max_position_embeddings=256))
    assert config.mlp_layer_types == ("dense", "sparse", "dense")
    assert [config.is_moe_layer(i) for i in range(3)] == [False, True, False]
    assert MLAConfig.from_dict(config.to_dict()) == config
    assert config.first_layers(2).residual_scale == pytest.approx(config.residual_scale)
    assert config.first_layers(2).mlp_layer_types == ("dense", "sparse")



def test_moe_schedules_of_the_family():
    """DeepSeek's moe_layer_freq (layer i is MoE when i >= first_k_dense_replace and i % freq == 0, as DeepSeek's
    own code builds it), GLM-4.7-Flash's mlp_layer_types and its default (the first layer dense), all read into
    one schedule; a schedule that is the first k layers dense stays first_k_dense_replace."""
    v3 = from_hf_config({**V3_CONFIG_JSON, "num_hidden_layers": 6, "moe_layer_freq": 2})
    assert [v3.is_moe_layer(i) for i in range(6)] == [False, False, False, False, True, False]
    assert v3.mlp_layer_types == ("dense",) * 4 + ("sparse", "dense")
    glm = {**V3_CONFIG_JSON, "model_type": "glm4_moe_lite", "num_hidden_layers": 3, "first_k_dense_replace": None}
    glm = {k: v for k, v in glm.items() if v is not None}
    assert from_hf_config(glm).first_k_dense_replace == 1 and from_hf_config(glm).mlp_layer_types is None
    listed = from_hf_config({**glm, "mlp_layer_types": ["dense", "sparse", "dense"]})
    assert [listed.is_moe_layer(i) for i in range(3)] == [False, True, False]
    assert from_hf_config({**glm, "mlp_layer_types": ["dense", "dense", "sparse"]}).first_k_dense_replace == 2
