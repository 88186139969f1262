"""The routed experts are sparse and exact: ``moe_experts`` equals the dense formulation, never reads an expert
no token was routed to, and the router chooses the experts transformers' own DeepSeek-V2/V3 gates choose."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import TOL, rel_err
from mla_deploy.model.layers import Experts, Router, dense_experts_reference, moe_experts

D, I, E, K = 64, 32, 8, 3


def _weights(e: int = E, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate_up_proj [e, 2I, D]`` and ``down_proj [e, D, I]``, N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    return 0.1 * torch.randn(e, 2 * I, D, generator=gen), 0.1 * torch.randn(e, D, I, generator=gen)


def _routing(tokens: int, used: int = E - 2, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [T, D]``, weights ``[T, K]`` float32 and idx ``[T, K]``: distinct experts per token drawn from the first
    ``used`` experts only (so experts repeat across tokens and the last ``E - used`` get no token)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, D, generator=gen)
    idx = torch.stack([torch.randperm(used, generator=gen)[:K] for _ in range(tokens)]).reshape(tokens, K)
    return x, torch.rand(tokens, K, generator=gen) * 2.5, idx


@pytest.mark.parametrize("tokens", [1, 2, 37])
def test_sparse_experts_equal_the_dense_formulation_in_float32(tokens):
    gate_up, down = _weights()
    x, w, idx = _routing(tokens)
    out = moe_experts(x, w, idx, gate_up, down)
    assert out.dtype == torch.float32 and out.shape == (tokens, D)
    assert rel_err(out, dense_experts_reference(x, w, idx, gate_up, down)) <= TOL


def test_two_tokens_on_the_same_experts_each_get_their_own_output():
    gate_up, down = _weights()
    x, w, _ = _routing(2)
    idx = torch.tensor([[4, 1, 6], [1, 6, 4]])  # the same three experts, in another order
    out = moe_experts(x, w, idx, gate_up, down)
    assert rel_err(out, dense_experts_reference(x, w, idx, gate_up, down)) <= TOL
    assert rel_err(out[1:], moe_experts(x[1:], w[1:], idx[1:], gate_up, down)) <= TOL  # no mixing of tokens


def test_sparse_experts_in_bfloat16_stay_within_bfloat16_rounding():
    gate_up, down = (t.bfloat16() for t in _weights())
    x, w, idx = _routing(37)
    x = x.bfloat16()
    out = moe_experts(x, w, idx, gate_up, down)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, dense_experts_reference(x, w, idx, gate_up, down)) <= 1e-2
    exact = dense_experts_reference(x.float(), w, idx, gate_up.float(), down.float())  # same inputs, fp32 math
    assert rel_err(out, exact) <= 1e-2


def test_no_token_gives_an_empty_output():
    gate_up, down = _weights()
    out = moe_experts(torch.zeros(0, D), torch.zeros(0, K), torch.zeros(0, K, dtype=torch.long), gate_up, down)
    assert out.shape == (0, D)


def test_an_expert_without_tokens_is_never_read():
    """NaN weights in the experts nobody was routed to leave the sparse output finite; the dense formulation,
    which multiplies every expert by a zero weight, turns NaN: the check can tell the two apart."""
    gate_up, down = _weights()
    gate_up[E - 2:], down[E - 2:] = float("nan"), float("nan")
    x, w, idx = _routing(37, used=E - 2)
    assert torch.isfinite(moe_experts(x, w, idx, gate_up, down)).all()
    assert torch.isnan(dense_experts_reference(x, w, idx, gate_up, down)).any()


def test_experts_module_is_sparse_with_the_checkpoint_layout():
    from helpers import tiny_config

    config = tiny_config().replace(n_routed_experts=E, moe_intermediate_size=I, num_experts_per_tok=K)
    experts = Experts(config)
    assert [(n, tuple(p.shape)) for n, p in experts.named_parameters()] == [
        ("gate_up_proj", (E, 2 * I, D)), ("down_proj", (E, D, I))]
    gate_up, down = _weights(seed=3)
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
        x, w, idx = _routing(9, used=E - 1)
        assert rel_err(experts(x, w, idx), dense_experts_reference(x, w, idx, gate_up, down)) <= TOL
        experts.gate_up_proj[E - 1] = float("nan")  # nobody's expert
        assert torch.isfinite(experts(x, w, idx)).all()


# -- routing: our Router chooses what transformers' gates choose ------------------------------------------------

ROUTING = {  # name: (DeepSeek version, V2 topk_method)
    "v2-greedy": (2, "greedy"),
    "v2-group-limited-greedy": (2, "group_limited_greedy"),
    "v3-noaux-tc": (3, None),
}


def _models(name: str):
    """A tiny transformers model routing ``K`` experts per token (8 experts in 4 groups, 2 groups kept) and ours
    with its weights; the routing settings are set on the config and on transformers' gate modules."""
    pytest.importorskip("transformers")
    from hf_oracle import hf_model, ours_from_hf

    version, method = ROUTING[name]
    hf = hf_model(version)
    hf.config.num_experts_per_tok = K
    if method is not None:
        hf.config.topk_method = method
    for module in _hf_gates(hf).values():
        module.top_k = K
        if method is not None:
            module.topk_method = method
    ours = ours_from_hf(hf)
    assert ours.config.num_experts_per_tok == K and ours.config.n_group == 4 and ours.config.topk_group == 2
    return hf, ours


def _hf_gates(hf) -> dict:
    return {name: m for name, m in hf.named_modules() if type(m).__name__.endswith("TopkRouter")}


@torch.no_grad()
def _hf_choices(hf, tokens: int = 64) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Run ``hf`` on random ids; per gate module name: its input ``[T, D]``, chosen experts and weights ``[T, k]``."""
    seen = {}
    hooks = [m.register_forward_hook(lambda m, args, out, name=name: seen.__setitem__(
        name, (args[0].reshape(-1, args[0].shape[-1]).clone(), out[2].clone(), out[1].clone())))
        for name, m in _hf_gates(hf).items()]
    try:
        ids = torch.randint(0, 128, (2, tokens // 2), generator=torch.Generator().manual_seed(7))
        hf(input_ids=ids)
    finally:
        for hook in hooks:
            hook.remove()
    assert seen
    return seen


@torch.no_grad()
def _our_choice(router: Router, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``router`` on ``x`` as seen by a hook on ``Router.forward``: chosen experts and weights ``[T, k]``."""
    seen = []
    hook = router.register_forward_hook(lambda m, args, out: seen.append(out))
    try:
        router(x)
    finally:
        hook.remove()
    weights, idx = seen[0]
    return idx, weights


def _differing_tokens(theirs: torch.Tensor, ours: torch.Tensor) -> int:
    """How many tokens (rows of ``[T, k]`` expert indices) choose a different set of experts."""
    return sum(set(a.tolist()) != set(b.tolist()) for a, b in zip(theirs, ours))


def _by_expert(idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``weights`` reordered by expert index per token (topk's order is not part of the routing)."""
    return weights.gather(-1, idx.argsort(-1))


@pytest.mark.parametrize("name", list(ROUTING))
def test_router_chooses_the_experts_transformers_chooses(name):
    hf, ours = _models(name)
    modules = dict(ours.named_modules())
    for gate_name, (x, hf_idx, hf_weights) in _hf_choices(hf).items():
        router = modules[gate_name]
        assert isinstance(router, Router)
        idx, weights = _our_choice(router, x)
        assert _differing_tokens(hf_idx, idx) == 0, gate_name
        assert rel_err(_by_expert(idx, weights), _by_expert(hf_idx, hf_weights)) <= TOL


def _zero_bias(router: Router) -> Router:
    wrong = copy.deepcopy(router)
    wrong.e_score_correction_bias.zero_()
    return wrong


def _ignore_groups(router: Router) -> Router:
    wrong = Router(router.config.replace(topk_group=router.config.n_group))
    wrong.load_state_dict(router.state_dict())
    return wrong


PLANTED = [("v3-noaux-tc", _zero_bias), ("v3-noaux-tc", _ignore_groups), ("v2-group-limited-greedy", _ignore_groups)]


@pytest.mark.parametrize("name,plant", PLANTED, ids=[f"{n}-{p.__name__.strip('_')}" for n, p in PLANTED])
def test_the_routing_comparison_catches_a_planted_mistake(name, plant):
    """The same comparison fails on a router with a deliberate mistake, so it cannot pass vacuously."""
    hf, ours = _models(name)
    modules = dict(ours.named_modules())
    differing = 0
    for gate_name, (x, hf_idx, _) in _hf_choices(hf).items():
        idx, _ = _our_choice(plant(modules[gate_name]), x)
        differing += _differing_tokens(hf_idx, idx)
    assert differing > 0
