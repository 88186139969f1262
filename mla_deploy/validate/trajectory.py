"""The validation trajectory: one prefill then N teacher-forced decode steps, as Polygraphy feed dicts.

Every runner sees identical inputs: the ids of each decode step come from the trajectory (random ids drawn
from its seed), never from a runner's own argmax. Each feed dict holds

=================== ============ ===================================================================
``input_ids``       int64 [B, S] prompt ids right-padded with 0 (step 0), then one id per sequence
``position_ids``    int64 [B, S] absolute position of each token (sequence ``b`` continues at ``L_b``)
``valid``           int64 [B, S] 1 for a real token, 0 for right padding
``step``            int64 [1]    0 = prefill (a runner starts a fresh cache), k = decode step k
=================== ============ ===================================================================

Outputs of every runner, in a canonical form so that padding never enters a comparison:
``logits`` ``[B, S, V]`` float32 with padded positions zeroed, and ``present_latent.{i}`` ``[B, T, C]`` float32:
the valid cache rows of each sequence in time order (``T`` = the longest sequence so far), zero beyond a
sequence's own length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from ..errors import CacheCapacityError, InputError

FEED_NAMES = ("input_ids", "position_ids", "valid", "step")


@dataclass(frozen=True)
class Trajectory:
    """The token ids of a validation run.

    Attributes:
        prompts: ``B`` prompts (lists of ids), lengths ``L_b`` may differ.
        decode_ids: ``[N, B]``: the id each sequence is fed at decode step ``k`` (1-based: row ``k - 1``).
        seed: the seed the ids were drawn from.
    """

    prompts: tuple[tuple[int, ...], ...]
    decode_ids: tuple[tuple[int, ...], ...]
    seed: int = 0

    @property
    def batch(self) -> int:
        return len(self.prompts)

    @property
    def lengths(self) -> list[int]:
        """Prompt length of each sequence."""
        return [len(p) for p in self.prompts]

    @property
    def decode_steps(self) -> int:
        return len(self.decode_ids)

    def feed_dicts(self) -> list[dict[str, np.ndarray]]:
        """Step 0 (prefill) then one feed dict per decode step (see the module docstring)."""
        lengths = np.array(self.lengths, dtype=np.int64)
        width = int(lengths.max())
        ids = np.zeros((self.batch, width), dtype=np.int64)
        valid = np.zeros_like(ids)
        for b, prompt in enumerate(self.prompts):
            ids[b, : len(prompt)], valid[b, : len(prompt)] = prompt, 1
        positions = np.broadcast_to(np.arange(width, dtype=np.int64), ids.shape).copy()
        feeds = [{"input_ids": ids, "position_ids": positions, "valid": valid, "step": np.array([0], np.int64)}]
        for k, row in enumerate(self.decode_ids, start=1):
            feeds.append({"input_ids": np.array(row, dtype=np.int64)[:, None],
                          "position_ids": (lengths + k - 1)[:, None].copy(),
                          "valid": np.ones((self.batch, 1), dtype=np.int64),
                          "step": np.array([k], np.int64)})
        return feeds

    def to_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "prompt_lengths": self.lengths, "decode_steps": self.decode_steps,
                "seed": self.seed, "prompts": [list(p) for p in self.prompts],
                "decode_ids": [list(r) for r in self.decode_ids]}


def make_trajectory(vocab_size: int, batch: int, prompt_length: int, decode_steps: int, seed: int = 0,
                    prompt_lengths: Sequence[int] | None = None, capacity: int | None = None) -> Trajectory:
    """Random prompt and decode ids from ``seed``.

    Args:
        vocab_size: ids are drawn from ``[0, vocab_size)``.
        batch: B.
        prompt_length: the longest prompt; by default sequence ``b`` has ``max(1, prompt_length - b)`` tokens,
            so a batch of two or more exercises right padding.
        decode_steps: N teacher-forced steps after the prefill.
        seed: numpy seed.
        prompt_lengths: explicit lengths (overrides ``batch`` and ``prompt_length``).
        capacity: a static cache's rows per sequence; the trajectory must fit.
    Raises:
        InputError: a length or count out of range. CacheCapacityError: the trajectory exceeds ``capacity``.
    """
    lengths = list(prompt_lengths) if prompt_lengths is not None else [max(1, prompt_length - b) for b in range(batch)]
    if not lengths or min(lengths) < 1:
        raise InputError(f"every prompt needs at least one token (lengths {lengths})")
    if decode_steps < 0:
        raise InputError(f"decode steps must be >= 0, got {decode_steps}")
    if capacity is not None and max(lengths) + decode_steps > capacity:
        raise CacheCapacityError(f"a {max(lengths)}-token prompt plus {decode_steps} decode steps exceeds the "
                                 f"static cache capacity {capacity}; use fewer --steps")
    rng = np.random.default_rng(seed)
    prompts = tuple(tuple(int(t) for t in rng.integers(0, vocab_size, n)) for n in lengths)
    decode = tuple(tuple(int(t) for t in rng.integers(0, vocab_size, len(lengths))) for _ in range(decode_steps))
    return Trajectory(prompts, decode, seed)


class TrajectoryLoader:
    """A Polygraphy data loader (an indexable iterable of feed dicts) over a :class:`Trajectory`."""

    def __init__(self, trajectory: Trajectory):
        self.trajectory = trajectory
        self._feeds = trajectory.feed_dicts()

    def __len__(self) -> int:
        return len(self._feeds)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self._feeds[index].items()}

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return (self[i] for i in range(len(self)))


def input_metadata():
    """Polygraphy ``TensorMetadata`` of a trajectory feed dict (the same for every runner)."""
    from polygraphy.common import TensorMetadata

    meta = TensorMetadata()
    meta.add("input_ids", np.int64, ["batch_size", "sequence_length"])
    meta.add("position_ids", np.int64, ["batch_size", "sequence_length"])
    meta.add("valid", np.int64, ["batch_size", "sequence_length"])
    meta.add("step", np.int64, [1])
    return meta


def step_role(step: int) -> str:
    """``prefill`` for step 0, ``decode`` after."""
    return "prefill" if step == 0 else "decode"


def canonical_logits(logits: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """``logits [B, S, V]`` as float32 with padded positions (``valid == 0``) set to 0."""
    logits = np.asarray(logits, dtype=np.float32)
    return np.where(valid[..., None] != 0, logits, np.float32(0)).astype(np.float32)


def canonical_rows(rows: np.ndarray, slot_valid: np.ndarray) -> np.ndarray:
    """Compact a cache to its valid rows.

    Args:
        rows: ``[B, T_raw, C]`` the cache rows a runtime holds (padding slots included).
        slot_valid: ``[B, T_raw]`` nonzero where a slot holds a real token's row.
    Returns:
        ``[B, T, C]`` float32, ``T`` = the most valid rows of any sequence; sequence ``b``'s rows in slot order,
        zero after its last.
    """
    rows = np.asarray(rows, dtype=np.float32)
    keep = np.asarray(slot_valid) != 0
    if keep.shape != rows.shape[:2]:
        raise InputError(f"cache rows {rows.shape} and slot mask {keep.shape} disagree")
    counts = keep.sum(axis=1)
    out = np.zeros((rows.shape[0], int(counts.max(initial=0)), rows.shape[2]), dtype=np.float32)
    for b in range(rows.shape[0]):
        out[b, : counts[b]] = rows[b, keep[b]]
    return out


def valid_masks(feed: dict[str, np.ndarray], lengths_after: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Which entries of a step's canonical outputs are real data.

    Args:
        feed: the step's feed dict.
        lengths_after: ``[B]`` valid cache rows per sequence after the step.
    Returns:
        ``[B, S]`` for the logits and ``[B, T]`` for the caches (bool).
    """
    token = np.asarray(feed["valid"]) != 0
    rows = np.arange(int(lengths_after.max(initial=0)))[None, :] < lengths_after[:, None]
    return token, rows
