"""Choosing the next token from the logits the engine already returns: greedy, or sampling with temperature,
top-k and top-p, deterministic under a seed.

* :class:`SamplingConfig` (frozen): ``temperature`` 0 is greedy (the default, an exact argmax);
  ``temperature > 0`` samples from ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely
  tokens, then to the smallest set whose probability reaches ``top_p``, renormalised.
* :func:`next_tokens` ``(logits [B, V], config, rng) -> [B]``, through :func:`draw` ``(logits, config, uniforms [B])``,
  the inverse-cumulative choice an engine may also make where its logits are (one uniform per row from the host); :func:`token_probabilities` ``[V] -> [V]`` is the
  distribution one draw follows (what the sampler draws from, exposed for tests and for inspection).
* :class:`Sampler`: a config with the one random generator of a generation's draws.

On the host, sampling runs in float64 on the ``[B, V]`` rows of the last position; an engine that chooses on its
device (:meth:`~mla_deploy.engines.base.Engine.sample`) takes the same uniforms.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InputError


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen.

    Attributes:
        temperature: 0: greedy (argmax, the first of equal maxima); > 0: sample at this temperature.
        top_k: keep only the k most likely tokens (None: all). ``top_k=1`` is greedy.
        top_p: keep the smallest set of most likely tokens whose probability reaches ``top_p`` (in (0, 1]; 1: all).
        seed: seed of the random generator (None: fresh entropy); the same seed repeats the same draws.
    Raises:
        InputError: a negative temperature, ``top_k < 1``, ``top_p`` outside (0, 1], or ``top_k``/``top_p`` with
            temperature 0 (greedy ignores them, so asking for them is a mistake).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0 or self.temperature == float("inf"):
            raise InputError(f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or int(self.top_k) != self.top_k or self.top_k < 1):
            raise InputError(f"top_k must be an integer >= 1, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.greedy and (self.top_k is not None or self.top_p != 1):
            raise InputError("top_k and top_p apply when sampling: give a temperature > 0 (temperature 0 is greedy)")
        if self.seed is not None and (isinstance(self.seed, bool) or int(self.seed) != self.seed or self.seed < 0):
            raise InputError(f"seed must be an integer >= 0, got {self.seed}")

    @property
    def greedy(self) -> bool:
        """Temperature 0: the argmax, no randomness."""
        return self.temperature == 0

    def choice(self, index: int) -> "SamplingConfig":
        """The config of choice ``index`` of a request of several (OpenAI's ``n``): choice 0 is this one, each other
        the same with its own seed derived from :attr:`seed` and ``index`` (None stays None: fresh entropy), so
        seeded choices are reproducible and differ from one another."""
        if index == 0 or self.seed is None or self.greedy:
            return self
        import dataclasses

        derived = int(np.random.SeedSequence([int(self.seed), int(index)]).generate_state(1, np.uint64)[0] >> 1)
        return dataclasses.replace(self, seed=derived)

    def generator(self) -> np.random.Generator:
        """A NumPy generator seeded with :attr:`seed`."""
        return np.random.default_rng(self.seed)


def token_probabilities(logits: np.ndarray, config: SamplingConfig) -> np.ndarray:
    """The distribution the sampler draws the next token from.

    Args:
        logits: ``[V]`` (any float dtype).
        config: a sampling (temperature > 0) config.
    Returns:
        ``[V]`` float64 probabilities summing to 1, zero outside the top-k / top-p set.
    """
    assert not config.greedy, "greedy decoding takes the argmax"
    logits = np.asarray(logits, dtype=np.float64)
    # the maximum is subtracted before dividing: (logit - max) / T is <= 0 and at worst -inf for a temperature so
    # small (a denormal) that logits / T overflows, where inf - inf would make every probability NaN; the limit is
    # then the argmax's, all the mass on the largest logits
    scaled = (logits - logits.max()) / config.temperature
    order = np.argsort(-scaled, kind="stable")  # most likely first; equal logits in index order, as argmax
    if config.top_k is not None:
        order = order[: config.top_k]
    kept = np.exp(scaled[order] - scaled[order[0]])
    kept /= kept.sum()
    if config.top_p < 1:
        before = np.cumsum(kept) - kept  # probability of the tokens ahead of each one
        count = max(1, int(np.count_nonzero(before < config.top_p)))
        order, kept = order[:count], kept[:count] / kept[:count].sum()
    probs = np.zeros(scaled.shape, dtype=np.float64)
    probs[order] = kept
    return probs


def draw(logits: np.ndarray, config: SamplingConfig, uniforms: np.ndarray) -> np.ndarray:
    """The tokens that ``uniforms`` pick from the sampling distribution of each row, by its inverse cumulative in
    vocabulary order: row ``b`` takes the first token whose cumulative probability passes ``uniforms[b]`` times the
    total. What the host does and what an engine's device-side choice reproduces (same uniforms, same tokens).

    Args:
        logits: ``[B, V]`` on the host. config: a sampling (temperature > 0) config. uniforms: ``[B]`` in [0, 1).
    Returns:
        ``[B]`` int64.
    """
    logits = np.asarray(logits)
    out = np.empty(logits.shape[0], dtype=np.int64)
    for b, row in enumerate(logits):
        cumulative = np.cumsum(token_probabilities(row, config))
        out[b] = min(int(np.searchsorted(cumulative, uniforms[b] * cumulative[-1], side="right")), len(row) - 1)
    return out


def next_tokens(logits: np.ndarray, config: SamplingConfig, rng: np.random.Generator | None) -> np.ndarray:
    """The next token of each sequence.

    Args:
        logits: ``[B, V]`` on the host.
        config: how to choose.
        rng: the generator of the draws (unused when greedy); one uniform draw per row, rows in order.
    Returns:
        ``[B]`` int64.
    """
    logits = np.asarray(logits)
    if config.greedy:
        return logits.argmax(-1).astype(np.int64)
    return draw(logits, config, rng.random(logits.shape[0]))


class Sampler:
    """The token choice of one generation: its :class:`SamplingConfig` and one random generator for all its draws
    (made once, so the same seed repeats the same draws).

    Args:
        config: how to choose (default: greedy).
    """

    def __init__(self, config: SamplingConfig | None = None):
        self.config = config or SamplingConfig()
        self.rng = None if self.config.greedy else self.config.generator()

    @property
    def greedy(self) -> bool:
        """The argmax, no draw (an engine may take it where its logits are, e.g. on the GPU)."""
        return self.config.greedy

    def uniforms(self, batch: int) -> np.ndarray:
        """``[batch]`` float64 in [0, 1): the next draws, one per row in order (the same numbers
        :meth:`choose` would use: ``Generator.random(n)`` repeats ``n`` calls of ``random()``)."""
        return self.rng.random(batch)

    def choose(self, logits: np.ndarray) -> np.ndarray:
        """``[B]`` int64: the next token of each row of host ``logits [B, V]`` (:func:`next_tokens`)."""
        return next_tokens(logits, self.config, self.rng)
