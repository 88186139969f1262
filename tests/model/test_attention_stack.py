"""AttentionStack: the attention sub-layers alone (``x <- x + attn_i(x)``), run by the decoder's own layer loop
(run_layers); in every form and with either cache policy it computes the same function."""

from __future__ import annotations

import pytest
import torch

from mla_deploy.cache_layout import STATIC
from mla_deploy.model import FORMS, ConcatCache, convert_form, init_random_
from mla_deploy.model.decoder import AttentionStack, MLAForCausalLM, run_layers
from mla_deploy.model.rope import RotaryEmbedding
from mla_deploy.recipe import load_recipe


def _stack(form: str, layers: int = 3, seed: int = 2) -> AttentionStack:
    config = load_recipe("tiny").model
    stack = init_random_(AttentionStack(config, layers, "CC"), std=0.3, seed=seed)
    return convert_form(stack, form).eval()


def _step(batch: int = 2, past: int = 6, seq: int = 3, width: int = 64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, width, generator=gen)
    positions = torch.arange(past, past + seq).expand(batch, seq).contiguous()
    return x, positions


@torch.no_grad()
def test_stack_is_residual_attention_with_one_rope_table_and_mask():
    """The stack equals the loop written out: one rope table and mask, then x + self_attn(x) per layer; its
    parameters are named as a decoder layer's attention."""
    stack = _stack("CC")
    x, pos = _step()
    past = [torch.randn(2, 6, stack.config.latent_dim) for _ in stack.layers]
    out, presents = stack(x, pos, past)
    cos, sin = RotaryEmbedding(stack.config)(pos)
    cache = ConcatCache()
    mask = cache.mask(x.shape[1], past[0])
    y = x
    for layer, layer_past, present in zip(stack.layers, past, presents):
        h, expected = layer.self_attn(y, cos, sin, mask, layer_past, cache)
        y = y + h
        assert torch.equal(present, expected)
    assert torch.equal(out, y)
    assert "layers.0.self_attn.kv_b_proj.weight" in stack.state_dict()


@pytest.mark.parametrize("form", FORMS)
@torch.no_grad()
def test_every_form_and_the_static_policy_compute_the_same_function(form):
    """Weights drawn for CC and rewritten: every form's stack gives CC's output; the static cache (rows written
    in place at write_indices) gives the concat cache's output (latent forms)."""
    ref_stack, stack = _stack("CC"), _stack(form)
    x, pos = _step(past=0)
    ref, _ = ref_stack(x, pos, [torch.zeros(2, 0, stack.config.latent_dim) for _ in stack.layers])
    if form == "CD":
        c = stack.config
        past = [(torch.zeros(2, c.num_attention_heads, 0, c.qk_head_dim),
                 torch.zeros(2, c.num_attention_heads, 0, c.v_head_dim)) for _ in stack.layers]
        out, _ = stack(x, pos, past)
    else:
        past = STATIC.empty(2, 8, stack.config.latent_dim, len(stack.layers))
        out, presents = stack(x, pos, past, STATIC.policy(torch.zeros(2, dtype=torch.long)))
        assert presents[0].shape == (2, 1, 8, stack.config.latent_dim)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_run_layers_needs_one_cache_per_layer():
    stack = _stack("CC", layers=2)
    x, pos = _step()
    with pytest.raises(ValueError, match="expected 2 layer caches, got 1"):
        run_layers(stack.layers, stack.rotary_emb, x, pos, [torch.zeros(2, 6, stack.config.latent_dim)],
                   ConcatCache())
    model = MLAForCausalLM(stack.config)
    with pytest.raises(ValueError, match="expected 2 layer caches"):
        model(torch.zeros(2, 3, dtype=torch.long), pos, [])
