"""Sampling (mla_deploy.generate.sampling): the config's checks, greedy and top-k 1 as the argmax, a seed that repeats,
and a statistical test that the draws follow the softmax at the temperature after top-k / top-p truncation."""

from __future__ import annotations

import numpy as np
import pytest

from mla_deploy.errors import InputError
from mla_deploy.generate.sampling import SamplingConfig, next_tokens, token_probabilities

LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0], dtype=np.float32)
DRAWS = 20_000
#: 0.999 quantiles of the chi-square distribution by degrees of freedom: a correct sampler fails the test with
#: probability 1e-3 for a random seed, and never for the fixed seeds below
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458}


def expected(logits: np.ndarray, temperature: float, top_k: int | None = None, top_p: float = 1.0) -> np.ndarray:
    """The target distribution written out independently of the sampler: softmax at the temperature, the top_k
    most likely, then the most likely tokens until their probability reaches top_p, renormalised."""
    p = np.exp(logits.astype(np.float64) / temperature)
    p /= p.sum()
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep = order[:top_k] if top_k else order
    total = sum(p[i] for i in keep)
    kept, mass = [], 0.0
    for i in keep:
        if mass >= top_p * total:
            break
        kept.append(i)
        mass += p[i]
    out = np.zeros_like(p)
    out[kept] = p[kept] / mass
    return out


def draw(config: SamplingConfig, n: int = DRAWS) -> np.ndarray:
    """``n`` draws from LOGITS (one batch of ``n`` identical rows) -> token counts."""
    tokens = next_tokens(np.tile(LOGITS, (n, 1)), config, config.generator())
    return np.bincount(tokens, minlength=len(LOGITS))


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    kept = probs > 0
    want = probs[kept] * counts.sum()
    return float((((counts[kept] - want) ** 2) / want).sum()), int(kept.sum()) - 1


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.3, None, 1.0), (0.7, None, 0.9), (1.0, 4, 1.0),
                                                     (2.0, 5, 0.8)])
def test_draws_follow_the_truncated_softmax(temperature, top_k, top_p):
    config = SamplingConfig(temperature, top_k, top_p, seed=1234)
    probs = expected(LOGITS, temperature, top_k, top_p)
    np.testing.assert_allclose(token_probabilities(LOGITS, config), probs, rtol=1e-12, atol=1e-15)
    counts = draw(config)
    assert counts[probs == 0].sum() == 0, "a token outside the top-k / top-p set was drawn"
    statistic, dof = chi_square(counts, probs)
    assert dof >= 1 and statistic < CHI2_999[dof], (statistic, counts, probs * DRAWS)


def test_the_statistical_test_rejects_a_wrong_temperature():
    """Negative control: the same test rejects draws at temperature 1.0 judged against temperature 1.3."""
    counts = draw(SamplingConfig(1.0, seed=1234))
    statistic, dof = chi_square(counts, expected(LOGITS, 1.3))
    assert statistic > CHI2_999[dof]


def test_greedy_and_top_k_1_are_the_argmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 300)).astype(np.float32)
    logits[:, 7] = logits.max(-1) + 0.0  # ties: the first of equal maxima, as argmax takes it
    want = logits.argmax(-1)
    assert next_tokens(logits, SamplingConfig(), None).tolist() == want.tolist()
    for temperature in (0.5, 1.0, 5.0):
        config = SamplingConfig(temperature, top_k=1, seed=3)
        assert next_tokens(logits, config, config.generator()).tolist() == want.tolist()


def test_a_temperature_that_overflows_the_logits_is_the_argmax_not_nan():
    """logits / T overflows to inf for a denormal T (inf - inf: NaN probabilities); the limit is the argmax."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(8, 300)).astype(np.float32)
    for temperature in (5e-324, 1e-300, 1e-40):
        config = SamplingConfig(temperature, seed=0)
        probs = token_probabilities(logits[0], config)
        assert np.isfinite(probs).all() and probs[logits[0].argmax()] == 1.0
        assert next_tokens(logits, config, config.generator()).tolist() == logits.argmax(-1).tolist()


def test_a_seed_repeats_and_another_differs():
    logits = np.random.default_rng(1).normal(size=(32, 50))
    config = SamplingConfig(1.0, top_p=0.95, seed=11)
    first = next_tokens(logits, config, config.generator())
    assert next_tokens(logits, config, config.generator()).tolist() == first.tolist()
    other = SamplingConfig(1.0, top_p=0.95, seed=12)
    assert next_tokens(logits, other, other.generator()).tolist() != first.tolist()


@pytest.mark.parametrize("kwargs,message", [
    ({"temperature": -0.1}, "temperature must be"), ({"temperature": float("nan")}, "temperature must be"),
    ({"temperature": 1, "top_p": 0}, r"top_p must be in \(0, 1\]"),
    ({"temperature": 1, "top_p": 1.01}, r"top_p must be in \(0, 1\]"),
    ({"temperature": 1, "top_k": 0}, "top_k must be an integer >= 1"),
    ({"top_k": 3}, "give a temperature > 0"), ({"top_p": 0.5}, "give a temperature > 0"),
    ({"seed": -1}, "seed must be")])
def test_bad_configs_are_refused(kwargs, message):
    with pytest.raises(InputError, match=message):
        SamplingConfig(**kwargs)
