"""Log probabilities of chosen tokens, as OpenAI's ``logprobs`` report them: the log-softmax of the model's raw
logits (before temperature, top-k or top-p: what vLLM reports by default), computed on the host from the logits the
sampler chose from, only for the sequences that ask.

* :class:`TokenLogprob` (frozen): one token's log probability and the ``k`` most likely tokens of its position.
* :func:`log_softmax` ``[..., V] -> [..., V]`` float64; :func:`top_tokens` the ``k`` most likely, most likely first
  (equal logits in id order, as the argmax breaks ties); :func:`token_logprob` one position's entry;
  :func:`prompt_logprobs` a prompt's entries from the logits of every position.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: the most ``top_logprobs`` a request may ask for (OpenAI's limit)
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """``token``'s log probability at its position, and ``top``: the ``k`` most likely ``(id, logprob)`` there."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """The log-softmax of ``logits [..., V]`` over the last axis, in float64."""
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def top_tokens(logprobs: np.ndarray, k: int) -> np.ndarray:
    """The ids of the ``k`` largest of ``logprobs [V]``, largest first; equal values in id order (the token the argmax
    picks is first among equal maxima)."""
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    k = min(k, len(logprobs))
    threshold = np.partition(logprobs, len(logprobs) - k)[len(logprobs) - k]
    candidates = np.flatnonzero(logprobs >= threshold)  # every tie at the threshold, in id order
    order = np.lexsort((candidates, -logprobs[candidates]))
    return candidates[order[:k]].astype(np.int64)


def token_logprob(logits: np.ndarray, token: int, k: int) -> TokenLogprob:
    """The entry of ``token`` chosen from one position's ``logits [V]``, with its ``k`` most likely tokens."""
    logprobs = log_softmax(logits)
    return TokenLogprob(int(token), float(logprobs[token]),
                        tuple((int(i), float(logprobs[i])) for i in top_tokens(logprobs, k)))


def prompt_logprobs(logits: np.ndarray, ids: np.ndarray, k: int) -> list[TokenLogprob]:
    """The entries of prompt tokens ``ids [S]`` from ``logits [S', V]`` of positions ``0 .. S' - 1`` (position ``p``
    predicts token ``p + 1``): one per token ``1 .. S'`` (the first token has none: nothing predicts it)."""
    return [token_logprob(logits[p], int(ids[p + 1]), k) for p in range(min(len(logits), len(ids) - 1))]
