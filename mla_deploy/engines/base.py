"""The engine interface: one generation loop for every runtime that executes an exported artifact.

:class:`Engine` owns what does not depend on the runtime: the artifact's manifest and config, input checks,
right-padding a batch of prompts, the cache state (through the artifact's
:class:`~mla_deploy.cache_layout.CacheLayout`), capacity checks, and the one generation loop
(:class:`GenerationStream`: prefill + decode steps, greedy or sampled next tokens
(:mod:`mla_deploy.sampling`), per-sequence stop at end-of-sequence ids or at the caller's request) and its
:class:`Generation` result. A runtime implements only allocation, binding and execution:

* :meth:`Engine._allocate` ``(shape) -> array``: one zeroed cache array of the runtime's kind;
* :meth:`Engine._run` ``(role, ids, positions, control, state) -> (logits, presents)``: one graph run;
* optionally :meth:`Engine._to_host`, :meth:`Engine._sliceable`, :meth:`Engine._greedy`, :meth:`Engine._synchronize`,
  :meth:`Engine._extra`.

Shapes: ``B`` batch, ``S`` new tokens per sequence, ``V`` vocabulary, ``C`` latent width, ``T`` rows held.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..artifact import Manifest
from ..cache_layout import CacheState
from ..errors import InputError, ShapeError
from ..io_spec import present_name
from ..generate.sampling import SamplingConfig, next_tokens


#: why a sequence stopped: an end-of-sequence id, a stop asked for by the caller (a stop string), max_new_tokens
FINISH_REASONS = ("eos", "stop", "length")


@dataclass
class Generation:
    """Result of :meth:`Engine.generate` (or of a consumed :meth:`Engine.stream`).

    Times are the engine's own (graph runs and token choice), not the caller's work between streamed steps.

    Attributes:
        tokens: the new ids of each sequence (an end-of-sequence id that stopped it included).
        prefill_seconds: time of the prefill run and the choice of the first token: the time to first token.
        decode_seconds: time of all decode steps.
        decode_steps: number of decode runs.
        provider: what executed the graphs (an ONNX Runtime provider, ``TensorRT x.y``).
        extra: runtime-specific facts (GPU, aliasing).
        finish_reasons: per sequence, one of :data:`FINISH_REASONS`.
        sequence_decode_seconds: per sequence, the decode time until its last token.
    """

    tokens: list[list[int]]
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    provider: str
    extra: dict = field(default_factory=dict)
    finish_reasons: list[str] = field(default_factory=list)
    sequence_decode_seconds: list[float] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput of the batch: tokens made by decode steps (all sequences) per second of decode."""
        if not self.decode_seconds:
            return float("nan")
        return sum(len(t) - 1 for t in self.tokens) / self.decode_seconds

    @property
    def sequence_tokens_per_second(self) -> list[float]:
        """Decode throughput of each sequence: its tokens after the first per second of decode until its last."""
        return [(len(t) - 1) / s if s else float("nan") for t, s in zip(self.tokens, self.sequence_decode_seconds)]


@dataclass(frozen=True)
class StepTokens:
    """One step of a :class:`GenerationStream`.

    Attributes:
        index: 0 for the token chosen from the prefill, then 1, 2, ... per decode step.
        tokens: the new id of each sequence; None for a sequence that had already finished.
        finished: per sequence, its finish reason once it has finished (this step included), else None.
    """

    index: int
    tokens: tuple
    finished: tuple


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
    lengths = np.array([len(p) for p in prompts], dtype=np.int64)
    ids = np.zeros((len(prompts), int(lengths.max())), dtype=np.int64)
    valid = np.zeros_like(ids)
    for b, prompt in enumerate(prompts):
        ids[b, : len(prompt)], valid[b, : len(prompt)] = prompt, 1
    check_ids(ids, vocab_size)
    return ids, valid, lengths


def logits_positions(shape: tuple[int, int], logits_index=None) -> np.ndarray:
    """The ``logits_index [B, K]`` int64 of a step over ``shape = (B, S)`` new tokens: ``logits_index`` checked,
    or every position (``K = S``) when None.

    Raises:
        ShapeError: not ``[B, K]`` with ``K >= 1``. InputError: a position outside ``[0, S)``.
    """
    batch, steps = shape
    if logits_index is None:
        return np.ascontiguousarray(np.broadcast_to(np.arange(steps, dtype=np.int64), (batch, steps)))
    index = np.ascontiguousarray(logits_index, dtype=np.int64)
    if index.ndim != 2 or index.shape[0] != batch or index.shape[1] < 1:
        raise ShapeError(f"logits_index {list(index.shape)} must be [{batch}, K] with K >= 1")
    if index.size and (index.min() < 0 or index.max() >= steps):
        raise InputError(f"logits_index holds {int(index.min() if index.min() < 0 else index.max())}, outside the "
                         f"step's positions 0..{steps - 1}")
    return index


def check_ids(ids: np.ndarray, vocab_size: int) -> None:
    """Raise :class:`InputError` naming the first id of ``ids`` outside ``[0, vocab_size)``."""
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = ids[(ids < 0) | (ids >= vocab_size)][0]
        raise InputError(f"token id {int(bad)} is outside the vocabulary [0, {vocab_size})")


class Engine:
    """Base class of the engines that run an artifact (see the module docstring).

    Args:
        root: the artifact directory.
        manifest: its manifest (already loaded and checked by the subclass).
        capacity: static layouts: cache rows per sequence (default: the manifest's ``max_cache_length``).

    Attributes:
        root, manifest, config, layout, precision, capacity; ``provider`` is set by the subclass.
    """

    provider: str = ""

    def __init__(self, root: str | Path, manifest: Manifest, capacity: int | None = None):
        self.root = Path(root)
        self.manifest = manifest
        self.config = manifest.config
        self.layout = manifest.layout
        self.precision = manifest.precision
        self.capacity = int(capacity or manifest.capacity or 0) if self.layout.has_capacity else None

    @property
    def cache_mode(self) -> str:
        """The layout's name (``concat`` or ``static``)."""
        return self.layout.mode

    # runtime interface ------------------------------------------------------------------------------
    def _allocate(self, shape: tuple[int, ...]):
        """One zeroed cache array of ``shape`` in the runtime's memory."""
        raise NotImplementedError

    def _run(self, role: str, ids: np.ndarray, positions: np.ndarray, logits_index: np.ndarray, control: np.ndarray,
             state: CacheState):
        """Run ``role``'s graph once.

        Args:
            ids, positions: ``[B, S]`` int64 (host).
            logits_index: ``[B, K]`` int64 (host), the positions whose logits are computed.
            control: the layout's control input (``attention_mask [B, P+S]`` or ``write_indices [B]``), int64.
            state: the cache before the step (``state.caches`` in the layout's shape).
        Returns:
            ``(logits [B, K, V], presents)``: logits in the runtime's memory; one present cache per layer in the
            layout's shape (an in-place layout returns the very arrays of ``state.caches``).
        """
        raise NotImplementedError

    def _to_host(self, array) -> np.ndarray:
        """A host NumPy copy of a runtime array (it must outlive the step and the state it came from)."""
        return np.array(array)

    def _sliceable(self, cache):
        """``cache`` as an array that can be sliced (default: itself; a GPU cache is sliced before it is copied)."""
        return cache

    def _greedy(self, logits, index: np.ndarray) -> np.ndarray:
        """``[B]`` int64 argmax of ``logits[b, index[b]]`` over the vocabulary."""
        host = self._to_host(logits)
        return host[np.arange(host.shape[0]), index].argmax(-1).astype(np.int64)

    def _synchronize(self) -> None:
        """Wait for queued work (asynchronous runtimes)."""

    def _extra(self) -> dict:
        """Runtime facts for :attr:`Generation.extra`."""
        return {}

    # state and one step -------------------------------------------------------------------------------
    #: the runtime's fixed-capacity cache can be allocated smaller than :attr:`capacity` (ONNX Runtime: the
    #: capacity axis is dynamic; a TensorRT engine's profile fixes it)
    resizable_capacity: bool = True

    def new_state(self, batch: int, rows: int | None = None) -> CacheState:
        """An empty cache for ``batch`` sequences.

        Args:
            rows: the most rows a sequence will hold. A fixed-capacity layout whose runtime can resize it gets
                ``min(rows, capacity)`` slots instead of the full capacity: each decode step attends over every
                slot, so a cache larger than the request would slow every step down. None: the full capacity.
        """
        capacity = self.capacity
        if capacity and rows is not None and self.resizable_capacity:
            capacity = max(1, min(int(rows), capacity))
        return self.layout.new_state(batch, self.config.latent_dim, self.config.num_hidden_layers, capacity,
                                     self._allocate)

    def step(self, role: str, input_ids, position_ids, state: CacheState, valid=None, logits_index=None):
        """Run ``role`` (``prefill`` or ``decode``) on ``S`` new tokens per sequence and advance ``state``.

        Args:
            input_ids, position_ids: ``[B, S]`` int64.
            state: from :meth:`new_state`; updated in place.
            valid: ``[B, S]``, 1 for real tokens, 0 for right padding (default: all real).
            logits_index: ``[B, K]`` int64 positions in ``[0, S)`` whose logits are computed (e.g. each
                sequence's last real token: a prefill then never computes ``[B, S, V]``); default every position.
        Returns:
            ``logits [B, K, V]`` in the runtime's memory (valid until the next step).
        Raises:
            ShapeError: mismatched shapes. InputError: an id outside the vocabulary, a logits index outside the step.
            CacheCapacityError: the step does not fit the cache.
        """
        ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        pos = np.ascontiguousarray(position_ids, dtype=np.int64)
        if ids.ndim != 2 or pos.shape != ids.shape or ids.shape[0] != len(state.lengths):
            raise ShapeError(f"input_ids {list(ids.shape)} and position_ids {list(pos.shape)} must both be "
                             f"[{len(state.lengths)}, S]")
        check_ids(ids, self.config.vocab_size)
        valid = np.ones_like(ids) if valid is None else np.ascontiguousarray(valid, dtype=np.int64)
        if valid.shape != ids.shape:
            raise ShapeError(f"valid {list(valid.shape)} must be shaped like input_ids {list(ids.shape)}")
        index = logits_positions(ids.shape, logits_index)
        self.layout.check_step(state, ids.shape[1], self.capacity)
        control = self.layout.control_input(state, valid)
        logits, presents = self._run(role, ids, pos, index, control, state)
        self.layout.advance(state, valid, control, presents)
        return logits

    def forward(self, role: str, input_ids, position_ids, state: CacheState, valid=None,
                logits_index=None) -> dict[str, np.ndarray]:
        """:meth:`step`, then the results on the host.

        Returns:
            ``logits [B, K, V]`` (``K = S`` by default) and ``present_latent.{i}`` ``[B, T, C]``: the rows held after
            the step (:meth:`CacheLayout.held <mla_deploy.cache_layout.CacheLayout.held>`).
        """
        logits = self.step(role, input_ids, position_ids, state, valid, logits_index)
        self._synchronize()
        out = {"logits": self._to_host(logits)}
        for i, cache in enumerate(state.caches):
            out[present_name(i)] = self._to_host(self.layout.held(self._sliceable(cache), state))
        return out

    # generation --------------------------------------------------------------------------------------------
    def stream(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: SamplingConfig | None = None,
               eos_ids: Sequence[int] = ()) -> "GenerationStream":
        """The generation loop as an iterator of steps: prefill the right-padded prompts, then decode steps
        until every sequence has finished (an id of ``eos_ids``, :meth:`GenerationStream.finish`, or
        ``max_new_tokens``).

        Args:
            prompts: ``B`` lists of token ids, lengths may differ.
            max_new_tokens: most new tokens per sequence (>= 1).
            sampling: how the next token is chosen (default: greedy).
            eos_ids: ids that end a sequence (the id is kept as its last token).
        Returns:
            a :class:`GenerationStream`: iterate it for :class:`StepTokens`, then :meth:`GenerationStream.result`.
        Raises (here, before anything runs):
            InputError: an empty prompt, an id outside the vocabulary, ``max_new_tokens < 1``.
            CacheCapacityError: the prompts and new tokens do not fit the cache.
        """
        return GenerationStream(self, prompts, max_new_tokens, sampling or SamplingConfig(), eos_ids)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: SamplingConfig | None = None,
                 eos_ids: Sequence[int] = ()) -> Generation:
        """:meth:`stream`, run to the end. Greedy with no ``eos_ids``: exactly ``max_new_tokens`` per sequence."""
        generation = self.stream(prompts, max_new_tokens, sampling, eos_ids)
        for _ in generation:
            pass
        return generation.result()

    def _next_tokens(self, logits, index: np.ndarray, sampling: SamplingConfig, rng) -> np.ndarray:
        """``[B]`` int64: the next token from ``logits[b, index[b]]`` (greedy on the runtime, else sampled)."""
        if sampling.greedy:
            return self._greedy(logits, index)
        host = self._to_host(logits)
        return next_tokens(host[np.arange(host.shape[0]), index], sampling, rng)

    def info(self) -> dict[str, Any]:
        """What this engine runs: provider, precision, cache mode and capacity."""
        return {"provider": self.provider, "precision": self.precision, "cache_mode": self.cache_mode,
                "capacity": self.capacity}


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


class GenerationStream:
    """The one generation loop (made by :meth:`Engine.stream`): iterate it for one :class:`StepTokens` per
    step; :meth:`finish` stops a sequence (its later tokens are not made); :meth:`result` is the
    :class:`Generation` once the iteration has ended.

    A finished sequence stays in the batch (it is fed its last token, and its outputs are ignored) until every
    sequence has finished. Each step asks the graph for one row of logits per sequence (``logits_index``): the
    prefill for each sequence's last real token, so ``[B, S, V]`` logits are never computed.
    """

    def __init__(self, engine: Engine, prompts, max_new_tokens: int, sampling: SamplingConfig, eos_ids):
        if max_new_tokens < 1:
            raise InputError("max_new_tokens must be at least 1")
        self.engine, self.sampling, self.max_new_tokens = engine, sampling, int(max_new_tokens)
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.ids, self.valid, self.lengths = pad_prompts(prompts, engine.config.vocab_size)
        engine.layout.check_request(self.ids.shape[1], self.max_new_tokens, engine.capacity)
        batch = len(self.lengths)
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.finished: list[str | None] = [None] * batch
        self.step_seconds: list[float] = []  # [0]: prefill and first token; then each decode step
        self.last_step = [0] * batch  # the step that made each sequence's last token
        self._steps = self._loop()
        self._done = False

    def __iter__(self):
        return self

    def __next__(self) -> StepTokens:
        return next(self._steps)

    def finish(self, sequence: int, reason: str = "stop") -> None:
        """Stop ``sequence`` after the tokens it has (no effect once it has finished)."""
        assert reason in FINISH_REASONS, reason
        if self.finished[sequence] is None:
            self.finished[sequence] = reason

    def result(self) -> Generation:
        """The :class:`Generation` (after the iteration has ended)."""
        assert self._done, "iterate the stream to its end first"
        decode = self.step_seconds[1:]
        return Generation(self.tokens, self.step_seconds[0], float(sum(decode)), len(decode), self.engine.provider,
                          self.engine._extra(), list(self.finished),
                          [float(sum(decode[: last])) for last in self.last_step])

    def _record(self, token: np.ndarray, index: int) -> StepTokens:
        new = []
        for b, t in enumerate(token.tolist()):
            if self.finished[b] is not None:
                new.append(None)
                continue
            self.tokens[b].append(t)
            self.last_step[b] = index
            if t in self.eos_ids:
                self.finished[b] = "eos"
            elif len(self.tokens[b]) >= self.max_new_tokens:
                self.finished[b] = "length"
            new.append(t)
        return StepTokens(index, tuple(new), tuple(self.finished))

    def _loop(self):
        engine, sampling = self.engine, self.sampling
        rng = None if sampling.greedy else sampling.generator()
        ids, width = self.ids, self.ids.shape[1]
        state = engine.new_state(len(ids), rows=width + self.max_new_tokens - 1)  # the last token is not cached
        engine._synchronize()
        start = time.perf_counter()
        zeros = np.zeros(len(ids), dtype=np.int64)  # each step asks for one row of logits per sequence
        logits = engine.step("prefill", ids, np.broadcast_to(np.arange(width), ids.shape), state, self.valid,
                             logits_index=(self.lengths - 1)[:, None])
        token = engine._next_tokens(logits, zeros, sampling, rng)
        self.step_seconds.append(time.perf_counter() - start)
        yield self._record(token, 0)
        while any(f is None for f in self.finished):
            start = time.perf_counter()
            logits = engine.step("decode", token[:, None], state.lengths[:, None].copy(), state,
                                 logits_index=zeros[:, None])
            token = engine._next_tokens(logits, zeros, sampling, rng)
            self.step_seconds.append(time.perf_counter() - start)
            yield self._record(token, len(self.step_seconds) - 1)
        engine._synchronize()
        self._done = True
