"""Tiny checkpoints of the MLA model types mla-deploy reads besides plain DeepSeek-V2/V3, each written by
transformers' own class (random weights, fixed seed, ``save_pretrained``), sized so each switch matters: a dense
layer among MoE ones, group-limited ``noaux_tc`` routing where the type routes so, v_head_dim != qk_nope_head_dim,
YaRN where the type's models use it.

:func:`write` returns the transformers model that computes what the folder holds (the reference) and the folder.
Where a released checkpoint is laid out or spelled otherwise than transformers writes it (Sarvam's legacy config
keys, A.X-K1's ``moe_layer_freq``, GLM-4.7-Flash's multi-token-prediction layer, Kimi K2's ``kimi_k2`` name), the
writer rewrites the saved folder into that form; transformers reads each of those forms into the same model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hf_oracle import randomize_

#: dimensions shared by every case: 4 heads, latent 16 + rope 8, nope 8 != v 12, q_lora 32, 8 experts in 4 groups
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
             v_head_dim=12, max_position_embeddings=512, rms_norm_eps=1e-6, moe_intermediate_size=32,
             n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
             norm_topk_prob=True, routed_scaling_factor=2.5, tie_word_embeddings=False, bos_token_id=0,
             eos_token_id=1, pad_token_id=None)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 1.0}
DENSE_KEYS = ("moe_intermediate_size", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group",
              "topk_group", "norm_topk_prob", "routed_scaling_factor")


def edit_json(path: Path, change) -> None:
    """Rewrite the JSON file ``path`` after ``change(data)``: how a test makes a bad checkpoint of a good one."""
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data, indent=2))


def _v3(**kw):
    import transformers

    cfg = transformers.DeepseekV3Config(**{**SMALL, "first_k_dense_replace": 1, "num_nextn_predict_layers": 0,
                                           **kw})
    return transformers.DeepseekV3ForCausalLM, cfg


def _sarvam_legacy(folder: Path) -> None:
    """sarvam-105b's own config.json spelling: ``num_experts``, ``num_shared_experts`` and a legacy
    ``rope_scaling`` of type ``deepseek_yarn``."""
    def change(d):
        d["num_experts"], d["num_shared_experts"] = d.pop("n_routed_experts"), d.pop("n_shared_experts")
        rope = d.pop("rope_parameters")
        d["rope_theta"] = rope.pop("rope_theta")
        d["rope_scaling"] = {**{k: v for k, v in rope.items() if k != "rope_type"}, "type": "deepseek_yarn"}
    edit_json(folder / "config.json", change)


def _axk1_legacy(folder: Path) -> None:
    """A.X-K1's released layout: ``first_k_dense_replace`` and ``moe_layer_freq`` instead of ``mlp_layer_types``;
    its norm written for a dense layer as well (which transformers ignores); no routing correction bias (which
    transformers then makes zero)."""
    from safetensors.torch import load_file, save_file

    def change(d):
        assert d.pop("mlp_layer_types") == ["dense", "dense", "sparse", "dense"]
        d.update(first_k_dense_replace=1, moe_layer_freq=2)
    edit_json(folder / "config.json", change)
    state = load_file(str(folder / "model.safetensors"))
    state["model.layers.0.post_mlp_layernorm.weight"] = torch.ones(SMALL["hidden_size"])
    state = {k: v for k, v in state.items() if not k.endswith("e_score_correction_bias")}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _glm_mtp(folder: Path) -> None:
    """GLM-4.7-Flash's release holds one multi-token-prediction layer after the decoder (``model.layers.{L}``),
    which its config class has no key for: here a copy of the last layer's tensors under that index."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    last, mtp = f"model.layers.{SMALL['num_hidden_layers'] - 1}.", f"model.layers.{SMALL['num_hidden_layers']}."
    state.update({mtp + k[len(last):]: v.clone() for k, v in state.items() if k.startswith(last)})
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


_mtp = _glm_mtp  # DeepSeek-V3.2 (layers.61) and GLM-5 (layers.78) carry one such layer too


def _kimi_k2(folder: Path) -> None:
    """Kimi K2's text config names its type ``kimi_k2`` (DeepSeek-V3's config, renamed; transformers 5.24 does not
    register the name, Kimi K2.5's wrapper renames it back)."""
    edit_json(folder / "config.json", lambda d: d.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"]))


def _kimi_k25_published(folder: Path) -> None:
    """Kimi K2.5's published names, ``language_model.model.layers.*``: transformers 5.24 writes the text layers as
    ``language_model.model.blocks.*`` (its vision tower's rename reversed) and reads both."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    old, new = "language_model.model.blocks.", "language_model.model.layers."
    state = {(new + k[len(old):] if k.startswith(old) else k): v for k, v in state.items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


#: LongCat-Flash: 2 layers (4 MLA sub-layers), 8 routed + 4 zero experts, 3 chosen, routed_scaling_factor 6 (its
#: release's), the latent norms' eps (1e-6) apart from rms_norm_eps (1e-5, its release's), rope theta 1e7
LONGCAT = dict(vocab_size=128, hidden_size=64, ffn_hidden_size=96, num_layers=2, num_attention_heads=4,
               q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, head_dim=8, v_head_dim=12,
               max_position_embeddings=512, rms_norm_eps=1e-5, n_routed_experts=8, zero_expert_num=4, moe_topk=3,
               expert_ffn_hidden_size=32, routed_scaling_factor=6.0, tie_word_embeddings=False, bos_token_id=0,
               eos_token_id=1, pad_token_id=None)


def _longcat_released(folder: Path) -> None:
    """LongCat-Flash-Chat's released layout: its own config keys (``zero_expert_type``, the latent-scale flags,
    ``router_bias``) and multi-token-prediction tensors ``model.mtp.*`` (here a copy of layer 0's), which
    transformers skips on load."""
    from safetensors.torch import load_file, save_file

    edit_json(folder / "config.json", lambda d: d.update(zero_expert_type="identity", mla_scale_q_lora=True,
                                                          mla_scale_kv_lora=True, router_bias=False))
    state = load_file(str(folder / "model.safetensors"))
    first = "model.layers.0."
    state.update({"model.mtp.layers.0." + k[len(first):]: v.clone() for k, v in state.items() if k.startswith(first)})
    state["model.mtp.norm.weight"] = state["model.norm.weight"].clone()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _build(case: str):
    """``(transformers class, config, rewrite of the saved folder or None)`` of ``case``."""
    import transformers

    if case == "deepseek_v3-tied":
        return (*_v3(tie_word_embeddings=True), None)
    if case == "deepseek_v3-half-rope":
        return (*_v3(rope_interleave=False, rope_parameters=YARN, q_lora_rank=None), None)
    if case == "kimi_k2":
        # Kimi K2's rope: theta 50000, YaRN with beta_fast = beta_slow = 1 (a one-dimension ramp), mscale 1 and 1
        rope = {**YARN, "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0}
        return (*_v3(rope_parameters=rope), _kimi_k2)
    if case == "sarvam_mla":
        cfg = transformers.SarvamMLAConfig(**{**SMALL, "q_lora_rank": None, "first_k_dense_replace": 1,
                                              "rope_parameters": YARN})
        return transformers.DeepseekV3ForCausalLM, cfg, _sarvam_legacy
    if case == "glm4_moe_lite":
        cfg = transformers.Glm4MoeLiteConfig(**{**SMALL, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.8,
                                                "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default",
                                                                                          "rope_theta": 1e6},
                                                "mlp_layer_types": ["dense", "sparse", "sparse"]})
        return transformers.Glm4MoeLiteForCausalLM, cfg, _glm_mtp
    if case == "youtu":
        cfg = transformers.YoutuConfig(**{k: v for k, v in SMALL.items() if k not in DENSE_KEYS and k != "tie_word_embeddings"})
        return transformers.YoutuForCausalLM, cfg, None
    if case == "axk1":
        # 4 layers: first_k_dense_replace 1 with moe_layer_freq 2 makes layer 3 dense after MoE layer 2
        cfg = transformers.AXK1Config(**{**SMALL, "num_hidden_layers": 4,
                                         "mlp_layer_types": ["dense", "dense", "sparse", "dense"]})
        return transformers.AXK1ForCausalLM, cfg, _axk1_legacy
    if case == "mistral4":
        # Mistral Small 4's rope (YaRN 128x and the Llama-4 query scale over original_max_position_embeddings), its
        # context cut to 4 x 128 positions so that the query scale steps within a few tokens
        rope = {**YARN, "factor": 128.0, "original_max_position_embeddings": 4, "llama_4_scaling_beta": 0.1,
                "max_position_embeddings": SMALL["max_position_embeddings"]}
        cfg = transformers.Mistral4Config(**{**SMALL, "first_k_dense_replace": 1, "routed_scaling_factor": 2.0,
                                             "rope_parameters": rope})
        return transformers.Mistral4ForCausalLM, cfg, None
    if case == "minicpm3":
        # its release's rope: static longrope (max_position_embeddings = original), one divisor per rope pair
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.3, 2.1, 3.4],
                "long_factor": [1.5, 2.5, 4.0, 9.0], "original_max_position_embeddings": SMALL["max_position_embeddings"]}
        cfg = transformers.MiniCPM3Config(**{k: v for k, v in SMALL.items() if k not in (*DENSE_KEYS, "tie_word_embeddings")},
                                          rope_parameters=rope, scale_emb=12, scale_depth=1.4, dim_model_base=16,
                                          tie_word_embeddings=True)
        return transformers.MiniCPM3ForCausalLM, cfg, None
    if case == "kimi_k25":
        text = transformers.DeepseekV3Config(**{**SMALL, "first_k_dense_replace": 1, "num_nextn_predict_layers": 0})
        vision = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                      patch_size=4, pos_emb_height=4, pos_emb_width=4)
        cfg = transformers.Kimi_K25Config(text_config=text.to_dict(), vision_config=vision, projection_hidden_size=32,
                                          tie_word_embeddings=False)
        return transformers.Kimi_K25ForConditionalGeneration, cfg, _kimi_k25_published
    if case.startswith(("deepseek_v32", "glm_moe_dsa")):
        # DeepSeek Sparse Attention: 8 indexer heads of 16 (rope 8 of them); "-sparse" keeps 4 tokens per query, so
        # a prompt of 10+ tokens is past index_topk at the prefill and every decode step; "-dense" keeps 64
        topk = 4 if case.endswith("-sparse") else 64
        dsa = dict(index_topk=topk, index_head_dim=16, index_n_heads=8, first_k_dense_replace=1,
                   mlp_layer_types=["dense", "sparse", "sparse"])
        if case.startswith("deepseek_v32"):
            cfg = transformers.DeepseekV32Config(**{**SMALL, **dsa, "rope_parameters": YARN})
            return transformers.DeepseekV32ForCausalLM, cfg, _mtp
        cfg = transformers.GlmMoeDsaConfig(**{**SMALL, **dsa, "n_group": 1, "topk_group": 1, "rms_norm_eps": 1e-5,
                                              "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
        return transformers.GlmMoeDsaForCausalLM, cfg, _mtp
    if case.startswith("longcat_flash"):  # "-no-zero": without zero experts
        zero = {"zero_expert_num": 0} if case.endswith("-no-zero") else {}
        cfg = transformers.LongcatFlashConfig(**{**LONGCAT, **zero},
                                              rope_parameters={"rope_type": "default", "rope_theta": 1e7})
        return transformers.LongcatFlashForCausalLM, cfg, _longcat_released
    raise KeyError(case)


#: DeepSeek Sparse Attention cases: each type with a top-k below and above the tested contexts
SPARSE_CASES = ("deepseek_v32-sparse", "deepseek_v32-dense", "glm_moe_dsa-sparse", "glm_moe_dsa-dense")
CASES = ("deepseek_v3-tied", "deepseek_v3-half-rope", "kimi_k2", "sarvam_mla", "glm4_moe_lite", "youtu", "axk1",
         "kimi_k25", "minicpm3", "mistral4", "longcat_flash")


@torch.no_grad()
def write(case: str, folder: Path, seed: int = 0, std: float = 0.15, released: bool = True,
          vocab_size: int | None = None):
    """Write the tiny checkpoint of ``case`` (one of :data:`CASES` or :data:`SPARSE_CASES`) into ``folder``.

    Args:
        released: rewrite the folder into the released layout (where the case has one); False: as transformers
            saved it.
        vocab_size: another vocabulary size (e.g. a tokenizer's), for a case with a top-level config.
    Returns: the transformers model (float32, eval) that computes what the folder holds.
    """
    import transformers

    cls, cfg, rewrite = _build(case)
    if vocab_size is not None:
        cfg.vocab_size = vocab_size
    rewrite = rewrite if released else None
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = randomize_(cls(cfg).eval(), seed, std)
    model.save_pretrained(folder)
    if rewrite is None:
        return model
    rewrite(Path(folder))
    if case == "kimi_k2":  # a name transformers does not register: the model saved is the reference
        return model
    # transformers reads the rewritten folder as it reads a release: that model is the reference
    loader = cls if case == "kimi_k25" else transformers.AutoModelForCausalLM  # sarvam_mla: by its own config
    reloaded = loader.from_pretrained(folder, attn_implementation="eager").eval()
    assert set(reloaded.state_dict()) == set(model.state_dict())
    return reloaded
