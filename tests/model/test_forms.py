"""Every attention form (CD, CC, A_CC, A_CC_ME) computes the original CC model's function, in float32.

Models are built with ``build_model(config, form, std=0.3, seed)`` (weights drawn for the original form
and rewritten) or converted with ``convert_form`` / ``absorb``; the reference is the CC model run over the
whole sequence at once, so agreement also proves the cache paths.
"""

from __future__ import annotations

import pytest
import torch

from helpers import TOL, positions, rel_err, run_chunks, run_padded_batch, tiny_config, tiny_model
from mla_deploy.cache_layout import STATIC
from mla_deploy.model import (FORMS, absorb, absorb_state_dict, build_model, convert_form, unabsorb_state_dict)

# chunk sizes fed through the concat cache; the reference runs the whole sequence in one call
SCENARIOS = {
    "prefill_from_0": [11],
    "prefill_from_37": [37, 7],  # a past cache of 37 rows built by an earlier prefill
    "prefill_then_32_decode": [12] + [1] * 32,
}
VARIANTS = [pytest.param(q, y, id=f"{'q_lora' if q else 'q_proj'}-{'yarn' if y else 'rope'}")
            for q in (True, False) for y in (True, False)]


def _ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _reference(ids: torch.Tensor, q_lora: bool, yarn: bool) -> torch.Tensor:
    """The original (CC) model over the whole sequence, no cache."""
    model = tiny_model("CC", q_lora, yarn)
    return model(ids, positions(ids.shape[0], 0, ids.shape[1]), model.empty_cache(ids.shape[0]))[0]


@pytest.mark.parametrize("q_lora, yarn", VARIANTS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("form", FORMS)
def test_form_equals_original(form, scenario, q_lora, yarn):
    """Each chunk's logits (prefill, prefill after a past, every decode step) equal the CC full forward."""
    chunks = SCENARIOS[scenario]
    ids = _ids(2, sum(chunks))
    ref = _reference(ids, q_lora, yarn)
    outs, _ = run_chunks(tiny_model(form, q_lora, yarn), ids, chunks)
    start = 0
    for n, out in zip(chunks, outs):
        assert rel_err(out, ref[:, start:start + n]) <= TOL, (form, scenario, start)
        start += n


@pytest.mark.parametrize("route", ["CC>CD>A_CC_ME>A_CC", "absorb:A_CC", "absorb:A_CC_ME", "A_CC>CC>CD"])
def test_converted_model_equals_original(route):
    """A model rewritten in place (convert_form along a chain of forms, or absorb) computes the same logits."""
    how, _, forms = route.rpartition(":")
    model = build_model(tiny_config(), "CC", std=0.3, seed=0)
    if how == "absorb":
        model = absorb(model, forms)
        assert model.form == forms
    else:
        chain = forms.split(">")
        model = build_model(tiny_config(), chain[0], std=0.3, seed=0)
        for form in chain[1:]:
            model = convert_form(model, form)
        assert model.form == chain[-1]
    ids = _ids(2, 12)
    outs, _ = run_chunks(model, ids, [8, 1, 1, 1, 1])
    assert rel_err(torch.cat(outs, 1), _reference(ids, True, True)) <= TOL


# --- static cache vs concat cache, batch 2 of different prompt lengths ------------------------
LENGTHS = torch.tensor([5, 9])


def _padded_inputs():
    prompt = _ids(2, int(LENGTHS.max()), seed=2)
    prompt[0, int(LENGTHS[0]):] = 0  # right padding
    return prompt, _ids(2, 8, seed=3)


@pytest.mark.parametrize("form", FORMS)
def test_static_cache_equals_concat_cache(form):
    """StaticCache(write_indices) on a fixed buffer gives the concat path's logits on every real token."""
    model = tiny_model(form)
    prompt, steps = _padded_inputs()
    pre_c, dec_c = run_padded_batch(model, prompt, LENGTHS, steps, static=False)
    pre_s, dec_s = run_padded_batch(model, prompt, LENGTHS, steps, static=True, capacity=24)
    for b, n in enumerate(LENGTHS.tolist()):
        assert rel_err(pre_s[b, :n], pre_c[b, :n]) <= TOL
    for step_c, step_s in zip(dec_c, dec_s):
        assert rel_err(step_s, step_c) <= TOL


@pytest.mark.parametrize("static", [False, True], ids=["concat", "static"])
@pytest.mark.parametrize("form", FORMS)
def test_padded_batch_equals_each_sequence_alone(form, static):
    """Padding never leaks: each row of the padded batch equals the original model on that sequence alone."""
    model = tiny_model(form)
    prompt, steps = _padded_inputs()
    pre, dec = run_padded_batch(model, prompt, LENGTHS, steps, static=static)
    decoded = torch.cat(dec, 1)  # [B, K, V]
    for b, n in enumerate(LENGTHS.tolist()):
        seq = torch.cat((prompt[b, :n], steps[b])).unsqueeze(0)
        ref = _reference(seq, True, True)[0]
        assert rel_err(pre[b, :n], ref[:n]) <= TOL
        assert rel_err(decoded[b], ref[n:]) <= TOL


def test_static_cache_layout_and_capacity():
    """The static cache keeps its [B, 1, T_max, C] shape; writing past the capacity is a CacheCapacityError."""
    from mla_deploy.errors import CacheCapacityError
    from mla_deploy.model import StaticCache

    model = tiny_model("A_CC")
    c = model.config
    past = model.empty_cache(2, 10, layout=STATIC)
    _, present = model(_ids(2, 6), positions(2, 0, 6), past, StaticCache(torch.zeros(2, dtype=torch.long)))
    assert all(p.shape == (2, 1, 10, c.latent_dim) for p in present)
    with pytest.raises(CacheCapacityError):
        model(_ids(2, 6), positions(2, 6, 6), present, StaticCache(torch.full((2,), 6)))


# --- the absorbed rewrite as a pure weight transform ------------------------------------------
def test_absorb_unabsorb_round_trip_is_exact():
    """absorb_state_dict then unabsorb_state_dict returns the original tensors bit for bit."""
    config = tiny_config()
    original = build_model(config, "CC", std=0.3, seed=0).state_dict()
    back = unabsorb_state_dict(absorb_state_dict(original, config), config)
    assert list(back) == list(original)
    assert all(torch.equal(back[k], original[k]) for k in original)


def test_absorbed_state_dict_holds_w_uk_w_uv_not_kv_b_proj():
    """The absorbed model's parameters: w_uk [H, dn, r] and w_uv [H, dv, r] per layer, no kv_b_proj."""
    config = tiny_config()
    state = tiny_model("A_CC").state_dict()
    assert not any("kv_b_proj" in k for k in state)
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}.self_attn."
        h, r = config.num_attention_heads, config.kv_lora_rank
        assert state[prefix + "w_uk"].shape == (h, config.qk_nope_head_dim, r)
        assert state[prefix + "w_uv"].shape == (h, config.v_head_dim, r)
    expected = absorb_state_dict(tiny_model("CC").state_dict(), config)
    assert set(state) == set(expected)
    assert all(torch.equal(state[k], expected[k]) for k in expected)


@pytest.mark.parametrize("form", FORMS)
def test_forms_share_hf_parameter_names(form):
    """CD and CC keep Hugging Face's parameter names; the absorbed forms differ only in kv_b_proj -> w_uk/w_uv."""
    names = set(tiny_model(form).state_dict())
    original = set(tiny_model("CC").state_dict())
    if form in ("CD", "CC"):
        assert names == original
    else:
        assert {n for n in names if not n.endswith(("w_uk", "w_uv"))} == {
            n for n in original if not n.endswith("kv_b_proj.weight")}
