"""The generation loop, over any :class:`~mla_deploy.generate.engine.GenerationEngine`.

* :func:`prefill_step` and :func:`decode_step`: one step each, the engine's logits then the next tokens
  (:func:`choose_tokens`: greedy or drawn by the engine where the logits are, with a
  :class:`~mla_deploy.generate.sampling.Sampler`'s uniforms). :func:`decode_step` takes any batch of cache rows, each at its
  own position, and knows nothing of the requests they belong to: a server that batches requests as they come
  drives it directly.
* :class:`GenerationStream`: the loop over one batch of prompts (made by :func:`stream_tokens`): prefill the
  right-padded prompts, then decode steps until every sequence has finished (an end-of-sequence id,
  :meth:`GenerationStream.finish`, or ``max_new_tokens``); one :class:`StepTokens` per step.
* :func:`generate_tokens`: the stream run to the end; its :class:`Generation` holds the ids and the timings.

A finished sequence stays in the batch (it is fed its last token, its outputs ignored) until every sequence has
finished. Shapes: ``B`` batch, ``S`` prompt width, ``V`` vocabulary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..errors import InputError
from .engine import GenerationEngine
from .request import pad_prompts
from .sampling import Sampler, SamplingConfig

#: why a sequence stopped: an end-of-sequence id, a stop asked for by the caller (a stop string), max_new_tokens
FINISH_REASONS = ("eos", "stop", "length")


@dataclass
class Generation:
    """Result of :func:`generate_tokens` (or of a consumed :class:`GenerationStream`).

    Times are the engine's own (graph runs and token choice), not the caller's work between streamed steps.

    Attributes:
        tokens: the new ids of each sequence (an end-of-sequence id that stopped it included).
        prefill_seconds: time of the prefill run and the choice of the first token: the time to first token.
        decode_seconds: time of all decode steps.
        decode_steps: number of decode runs.
        provider: what executed the graphs (an ONNX Runtime provider, ``TensorRT x.y``).
        extra: what the engine reports of itself (its ``info()``: precision, cache, GPU, aliasing).
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


def choose_tokens(engine: GenerationEngine, logits: Any, sampler: Sampler) -> np.ndarray:
    """``[B]`` int64 host: the next token of each row of ``logits [B, V]``, chosen by the engine where the logits
    are: its argmax when greedy, else its draw with the sampler's next uniforms (one per row), so the same seed
    gives the same tokens whichever engine draws."""
    if sampler.greedy:
        return engine.argmax(logits)
    return engine.sample(logits, sampler.config, sampler.uniforms(logits.shape[0]))


def prefill_step(engine: GenerationEngine, ids: np.ndarray, lengths: np.ndarray, state: Any,
                 sampler: Sampler) -> np.ndarray:
    """Prefill the right-padded prompts ``ids [B, S]`` (``lengths [B]`` real tokens each) into the empty
    ``state``; returns the first new token of each sequence, ``[B]`` int64."""
    return choose_tokens(engine, engine.prefill(ids, lengths, state), sampler)


def decode_step(engine: GenerationEngine, tokens: np.ndarray, state: Any, sampler: Sampler) -> np.ndarray:
    """One decode step over a batch of cache rows: row b takes ``tokens[b]`` at its own next position
    (``state.lengths[b]``); returns each row's next token, ``[B]`` int64. Rows are independent: each may be any
    sequence at any point of its generation."""
    return choose_tokens(engine, engine.decode(tokens, state), sampler)


class GenerationStream:
    """The generation loop over one batch of prompts (see the module docstring): iterate it for one
    :class:`StepTokens` per step; :meth:`finish` stops a sequence (its later tokens are not made); :meth:`result`
    is the :class:`Generation` once the iteration has ended.

    Args:
        engine: a :class:`~mla_deploy.generate.engine.GenerationEngine`.
        prompts: ``B`` lists of token ids, lengths may differ.
        max_new_tokens: most new tokens per sequence (>= 1).
        sampling: how the next token is chosen (default: greedy).
        eos_ids: ids that end a sequence (the id is kept as its last token).
    Attributes:
        tokens: the new ids of each sequence so far (also after an interrupted iteration).
        finished: per sequence, its finish reason once it has finished, else None.
    Raises (here, before anything runs):
        InputError: an empty prompt, an id outside the vocabulary, ``max_new_tokens < 1``.
        CacheCapacityError: the prompts and new tokens do not fit the cache.
    """

    def __init__(self, engine: GenerationEngine, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 sampling: SamplingConfig | None = None, eos_ids: Sequence[int] = ()):
        if max_new_tokens < 1:
            raise InputError("max_new_tokens must be at least 1")
        self.engine, self.sampler, self.max_new_tokens = engine, Sampler(sampling), int(max_new_tokens)
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.ids, _, self.lengths = pad_prompts(prompts, engine.vocab_size)
        engine.check_request(self.ids.shape[1], self.max_new_tokens)
        self.tokens: list[list[int]] = [[] for _ in self.lengths]
        self.finished: list[str | None] = [None] * len(self.lengths)
        self.step_seconds: list[float] = []  # [0]: prefill and first token; then each decode step
        self.last_step = [0] * len(self.lengths)  # the step that made each sequence's last token
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
                          self.engine.info(), list(self.finished),
                          [float(sum(decode[: last])) for last in self.last_step])

    def _loop(self):
        engine, ids = self.engine, self.ids
        state = engine.new_state(len(ids), rows=ids.shape[1] + self.max_new_tokens - 1)  # the last token: uncached
        engine.synchronize()
        start = time.perf_counter()
        token = prefill_step(engine, ids, self.lengths, state, self.sampler)
        yield self._record(token, time.perf_counter() - start)
        while any(f is None for f in self.finished):
            start = time.perf_counter()
            token = decode_step(engine, token, state, self.sampler)
            yield self._record(token, time.perf_counter() - start)
        engine.synchronize()
        self._done = True

    def _record(self, token: np.ndarray, seconds: float) -> StepTokens:
        """Append each unfinished sequence's new token, and mark the sequences it finishes."""
        self.step_seconds.append(seconds)
        index, new = len(self.step_seconds) - 1, []
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


def stream_tokens(engine: GenerationEngine, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  sampling: SamplingConfig | None = None, eos_ids: Sequence[int] = ()) -> GenerationStream:
    """A :class:`GenerationStream` (arguments as its)."""
    return GenerationStream(engine, prompts, max_new_tokens, sampling, eos_ids)


def generate_tokens(engine: GenerationEngine, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    sampling: SamplingConfig | None = None, eos_ids: Sequence[int] = ()) -> Generation:
    """:func:`stream_tokens` run to the end. Greedy with no ``eos_ids``: exactly ``max_new_tokens`` per sequence."""
    stream = stream_tokens(engine, prompts, max_new_tokens, sampling, eos_ids)
    for _ in stream:
        pass
    return stream.result()
