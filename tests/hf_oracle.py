"""Build tiny Hugging Face DeepSeek-V2/V3 models with transformers itself, as a test oracle."""

from __future__ import annotations

import torch


def hf_config(version: int, q_lora_rank: int | None = 32, yarn: bool = False, moe: bool = True, layers: int = 2,
              vocab_size: int = 128, **overrides):
    """A tiny transformers DeepseekV{2,3}Config (num_key_value_heads set to the head count, EOS disabled);
    ``overrides`` replace any of its dimensions (``kv_lora_rank=32``, ``n_routed_experts=4``, ...)."""
    import transformers

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=512, rms_norm_eps=1e-6,
        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1 if moe else layers, n_group=4, topk_group=2, tie_word_embeddings=False,
    )
    common.update(overrides)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 1.0}
    if version == 3:
        cfg = transformers.DeepseekV3Config(**common, rope_parameters=rope, routed_scaling_factor=2.5,
                                            norm_topk_prob=True, num_nextn_predict_layers=0)
    else:
        cfg = transformers.DeepseekV2Config(**common, rope_parameters=rope, topk_method="group_limited_greedy",
                                            routed_scaling_factor=16.0)
    cfg._attn_implementation = "eager"
    return cfg


@torch.no_grad()
def hf_model(version: int, seed: int = 0, std: float = 0.3, **kw):
    """A tiny random transformers DeepSeek model in float32 eval mode, weights drawn N(0, std)."""
    import transformers

    cfg = hf_config(version, **kw)
    cls = transformers.DeepseekV3ForCausalLM if version == 3 else transformers.DeepseekV2ForCausalLM
    torch.manual_seed(seed)
    return randomize_(cls(cfg).eval(), seed, std)


@torch.no_grad()
def randomize_(model, seed: int = 0, std: float = 0.3):
    """Redraw every weight of a transformers model, the buffers it saves included (the V3 routing bias; not the
    rope frequencies nor a constant like MiniCPM3's embedding scale, which are not saved): matrices N(0, std),
    1-D scales ``1 + N(0, 0.1)``, 1-D biases N(0, 0.1); a tied weight is drawn once. Returns the model."""
    gen = torch.Generator().manual_seed(seed)
    saved = set(model.state_dict())
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if "inv_freq" in name or "original_inv_freq" in name or name not in saved:
            continue
        if p.dim() == 1:
            p.copy_((0.0 if "bias" in name else 1.0) + 0.1 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(std * torch.randn(p.shape, generator=gen))
    return model


@torch.no_grad()
def assert_engine_matches_hf(engine, hf, prompts, new: int, atol: float = 1e-4) -> None:
    """An exported model run by ``engine`` (an :class:`~mla_deploy.ort.engine.OrtEngine`) against the
    transformers model ``hf`` it was exported from: greedy generation of ``new`` tokens from each of ``prompts``
    equals ``hf.generate`` token for token, and the logits, teacher-forced on transformers' tokens for the first
    prompt, are within ``atol`` of transformers' at the prefill and at every decode step (a uniform logit scale
    changes no argmax: only the logits see it)."""
    import numpy as np

    def reference(prompt):
        return hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                           max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0,
                           output_logits=True, return_dict_in_generate=True)

    result = engine.generate(prompts, new)
    for b, prompt in enumerate(prompts):
        assert result.tokens[b] == reference(prompt).sequences[0, len(prompt):].tolist(), f"prompt {b}"
    prompt = prompts[0]
    ref = reference(prompt)
    state = engine.new_state(1)
    got = [engine.forward("prefill", np.array([prompt]), np.arange(len(prompt))[None], state)["logits"][0, -1]]
    for token in ref.sequences[0, len(prompt):-1].tolist():
        got.append(engine.forward("decode", np.array([[token]]), state.lengths[:, None].copy(), state)["logits"][0, -1])
    want = torch.cat(ref.logits).numpy()
    assert np.abs(np.stack(got) - want).max() <= atol


def ours_from_hf(hf, form: str = "CC"):
    """Our MLAForCausalLM with ``hf``'s weights: ``from_hf_config(config dict)``, then the HF state dict loaded
    with ``strict=True`` into the original form, then rewritten into ``form``."""
    from mla_deploy import from_hf_config
    from mla_deploy.model import MLAForCausalLM, convert_form

    model = MLAForCausalLM(from_hf_config(hf.config.to_dict()), "CC").eval()
    model.load_state_dict(hf.state_dict(), strict=True)
    return convert_form(model, form) if form != "CC" else model


@torch.no_grad()
def hf_run_chunks(hf, ids: torch.Tensor, chunks) -> tuple[list[torch.Tensor], object]:
    """Feed ``ids [B, N]`` through ``hf`` chunk by chunk from position 0 with its DynamicCache.

    Returns: the logits of each chunk and the final cache (``cache.layers[i].keys`` / ``.values``).
    """
    past, outs, start = None, [], 0
    for n in chunks:
        pos = torch.arange(start, start + n).expand(ids.shape[0], n)
        out = hf(input_ids=ids[:, start:start + n], position_ids=pos, past_key_values=past, use_cache=True)
        outs.append(out.logits)
        past, start = out.past_key_values, start + n
    return outs, past


def causal_mask(batch: int, seq: int, dtype=torch.float32) -> torch.Tensor:
    """Additive causal mask ``[B, 1, S, S]`` (0 visible, dtype min hidden), as HF's eager attention takes it."""
    hidden = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    return torch.zeros(batch, 1, seq, seq, dtype=dtype).masked_fill(hidden, torch.finfo(dtype).min)


#: a small corpus with multi-byte text (Chinese, emoji) for the test tokenizer
CORPUS = ["Hello world, this is a tiny corpus.", "The quick brown fox jumps over the lazy dog.",
          "你好，世界！我们今天学习中文。", "深度求索的模型很好用。", "emoji 🙂🚀🎉 are fun 👍🏽",
          "Multi-head latent attention keeps the cache small."]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
                 "<|system|>{{ m['content'] | trim }}{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
                 "{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
TOKENIZER_VOCAB = 300


def hf_tokenizer(bos_from: str = "post_processor"):
    """A byte-level BPE tokenizer trained offline with the ``tokenizers`` library on :data:`CORPUS`, as a
    transformers ``PreTrainedTokenizerFast`` with bos/eos/pad and a chat template (save it with save_pretrained).

    Args:
        bos_from: ``post_processor``: tokenizer.json's post-processor adds the BOS; ``template``: only the chat
            template writes it (no post-processor).
    """
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    if bos_from == "post_processor":
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


#: prompts of the text checkpoints: the first ends at EOS after 3 tokens (see :func:`text_checkpoint`)
TEXT_PROMPTS = ["Hello world", "你好，世界！🙂 The quick brown fox"]


@torch.no_grad()
def text_checkpoint(folder, version: int, bos_from: str = "post_processor"):
    """A tiny transformers DeepSeek checkpoint saved with a tokenizer (:func:`hf_tokenizer`) and a
    generation_config whose ``eos_token_id`` is ``</s>``, made to end :data:`TEXT_PROMPTS` [0] early: the
    ``</s>`` row of ``lm_head`` is 1.5 times the row of the token greedy decoding gives at its third step, so
    that token's win becomes ``</s>``'s (as a trained model's EOS would).

    Returns: ``(model, tokenizer)`` as saved (the tokenizer with left padding, as batched generate needs).
    """
    tok = hf_tokenizer(bos_from)
    hf = hf_model(version, std=0.15, vocab_size=len(tok))
    ids = torch.tensor([tok(TEXT_PROMPTS[0]).input_ids])
    greedy = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                         eos_token_id=None, pad_token_id=tok.pad_token_id)
    hf.lm_head.weight[tok.eos_token_id] = 1.5 * hf.lm_head.weight[greedy[0, -1]]
    hf.generation_config.eos_token_id = tok.eos_token_id
    hf.generation_config.bos_token_id = tok.bos_token_id
    hf.generation_config.pad_token_id = tok.pad_token_id
    hf.save_pretrained(folder)
    tok.save_pretrained(folder)
    tok.padding_side = "left"
    return hf, tok


def trained_model(version: int, seed: int = 0, steps: int = 100, batch: int = 16, length: int = 72,
                  lr: float = 3e-3):
    """A tiny transformers DeepSeek MoE model (:func:`hf_config`, transformers' own initialisation) trained with
    Adam for ``steps`` steps on CPU on a learnable token task: for uniformly random ids ``x``, the label at position
    ``t`` is ``perm[x[t - 1]]`` (``perm[x[0]]`` at 0), ``perm`` a fixed permutation, so the model must attend to the
    previous token. Its weights and logits are shaped by training, with real margins between the top tokens on any
    random ids (a validation trajectory's are the task's own inputs), where a random model's margins are tiny.
    Seeded; about 5 s on one core.

    Returns: the model in float32 eval mode.
    """
    import transformers

    cfg = hf_config(version)
    cls = transformers.DeepseekV3ForCausalLM if version == 3 else transformers.DeepseekV2ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).float().train()
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(cfg.vocab_size, generator=gen)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        x = torch.randint(0, cfg.vocab_size, (batch, length), generator=gen)
        labels = perm[torch.cat([x[:, :1], x[:, :-1]], dim=1)]
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()
