"""A generation request's checks and its batch: ids inside the vocabulary, prompts right-padded into one batch,
and the request's length against the model's positions."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import InputError


def check_ids(ids: np.ndarray, vocab_size: int) -> None:
    """Raise :class:`InputError` naming the first id of ``ids`` outside ``[0, vocab_size)``."""
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = ids[(ids < 0) | (ids >= vocab_size)][0]
        raise InputError(f"token id {int(bad)} is outside the vocabulary [0, {vocab_size})")


def pad_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Right-pad prompts into one batch.

    Args:
        prompts: ``B`` lists of token ids (lengths may differ, each >= 1).
        vocab_size: ids must lie in ``[0, vocab_size)``.
    Returns:
        ``ids [B, W]`` int64 (padding 0), ``valid [B, W]`` int64 (1 real, 0 padding), ``lengths [B]`` int64.
    Raises:
        InputError: no prompt, an empty prompt, or an id outside the vocabulary.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InputError("every prompt needs at least one token id")
    for prompt in prompts:  # before numpy sees them: an id past int64 would not convert
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InputError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    lengths = np.array([len(p) for p in prompts], dtype=np.int64)
    ids = np.zeros((len(prompts), int(lengths.max())), dtype=np.int64)
    valid = np.zeros_like(ids)
    for b, prompt in enumerate(prompts):
        ids[b, : len(prompt)], valid[b, : len(prompt)] = prompt, 1
    check_ids(ids, vocab_size)
    return ids, valid, lengths


def check_positions(config, longest_prompt: int, max_new_tokens: int, allow_long: bool = False) -> str | None:
    """Check that a request stays within the model's ``max_position_embeddings`` (rope and YaRN are defined up to
    it; past it the model runs but its output is not what it was trained for).

    Returns: None when it fits; with ``allow_long``, a warning to print.
    Raises:
        InputError: it does not fit and ``allow_long`` is false.
    """
    total, limit = longest_prompt + max_new_tokens, config.max_position_embeddings
    if total <= limit:
        return None
    message = (f"the longest prompt ({longest_prompt} tokens) plus {max_new_tokens} new tokens is {total} positions, "
               f"past the model's max_position_embeddings {limit}")
    if not allow_long:
        raise InputError(f"{message}; shorten them or pass --allow-long")
    return message
