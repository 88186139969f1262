"""Continuous batching: sequences join and leave one running batch between decode steps, each in its own row
("slot") of one in-place latent cache.

:class:`ContinuousBatcher` holds an engine's cache of ``max_batch`` rows (``engine.new_state``, the static
layout) and a bounded queue of waiting requests. Each :meth:`~ContinuousBatcher.step`:

1. ends the sequences whose caller asked (a stop string, a client gone: :meth:`Ticket.cancel`), freeing their rows;
2. admits waiting requests into free rows, lowest row first: each is emptied (:meth:`Engine.clear`) and its
   prompt prefilled on a view of that one row (:meth:`Engine.rows`), so the others' caches are left as they are;
3. runs one decode step over rows ``0 .. h - 1``, ``h`` one past the highest row in use (a view again: the rows
   above ``h`` cost nothing; a free row below it is fed a placeholder token and emptied again after the step);
4. chooses each sequence's next token with its own :class:`~mla_deploy.generate.sampling.Sampler`, reports it to
   its caller, and frees the row of each sequence that ends (an end-of-sequence id, ``max_new_tokens``).

Rows are independent (:func:`~mla_deploy.generate.loop.decode_step`): a greedy sequence gets the tokens it gets
alone. The batcher runs on one thread (:meth:`~ContinuousBatcher.run`, the engine's); :meth:`submit` and
:meth:`Ticket.cancel` may be called from any other. Each request's events come through its ``on_event`` callback,
on the engine's thread: keep it short (a server hands the event to its event loop).

Shapes: ``B`` rows (``max_batch``), ``V`` vocabulary; ids are int64.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..errors import BusyError, InputError, MLADeployError
from .engine import BatchingEngine
from .request import check_ids
from .sampling import Sampler, SamplingConfig

#: why a batched sequence ended: :data:`~mla_deploy.generate.loop.FINISH_REASONS`, ``cancelled`` (its caller
#: went away), ``error`` (the engine failed; the event's ``error`` says how)
BATCH_FINISH_REASONS = ("eos", "stop", "length", "cancelled", "error")


@dataclass(frozen=True)
class SequenceEvent:
    """What happened to one request: a new ``token``, and/or ``finished`` (a reason of
    :data:`BATCH_FINISH_REASONS`) when it was the last event; ``error`` with ``finished == "error"``."""

    token: int | None
    finished: str | None = None
    error: str | None = None


class Ticket:
    """A submitted request, as its caller holds it: :meth:`cancel` ends it before its next step.

    Attributes:
        prompt_length, max_new_tokens: as submitted. submitted: ``time.perf_counter()`` at submission.
        tokens: the new ids so far (appended on the engine's thread).
    """

    def __init__(self, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingConfig,
                 eos_ids: frozenset, on_event: Callable[[SequenceEvent], None]):
        self.prompt = np.asarray(prompt, dtype=np.int64)
        self.prompt_length, self.max_new_tokens = len(self.prompt), int(max_new_tokens)
        self.sampler, self.eos_ids, self.on_event = Sampler(sampling), eos_ids, on_event
        self.submitted = time.perf_counter()
        self.tokens: list[int] = []
        self.cancel_reason: str | None = None

    def cancel(self, reason: str = "cancelled") -> None:
        """End this request before its next step (``stop``: its caller found a stop string; ``cancelled``: its
        caller went away). Its row is freed then; it gets a last event with ``finished = reason``."""
        assert reason in ("stop", "cancelled"), reason
        self.cancel_reason = self.cancel_reason or reason


@dataclass
class BatchStats:
    """Counters of a :class:`ContinuousBatcher` (read from any thread; for ``/metrics``).

    Attributes:
        rows: ``B``. active: rows in use now. waiting: requests in the queue now.
        admitted, finished: requests so far (finished by reason). prompt_tokens, generated_tokens: totals.
        decode_steps, decode_rows: decode steps run, and the rows in use summed over them (their ratio is the mean
            occupancy). step_seconds: time in engine steps (prefill and decode).
    """

    rows: int
    active: int = 0
    waiting: int = 0
    admitted: int = 0
    finished: dict = field(default_factory=lambda: {r: 0 for r in BATCH_FINISH_REASONS})
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    decode_rows: int = 0
    step_seconds: float = 0.0


class ContinuousBatcher:
    """One running batch of sequences over ``engine`` (see the module docstring).

    Args:
        engine: a :class:`~mla_deploy.generate.engine.BatchingEngine` (an engine of :mod:`mla_deploy.engines` over a
            static-cache artifact).
        max_batch: ``B``, rows of the cache: the most sequences decoded together.
        capacity: rows each sequence may hold (prompt plus new tokens minus one); None: the engine's capacity.
            Every decode step attends over all of them, so keep it to what requests need.
        max_queue: the most requests waiting for a row; past it :meth:`submit` raises :class:`BusyError`.
    Raises:
        InputError: ``max_batch`` or ``max_queue`` below 1, ``capacity`` past the engine's, a cache past this
            machine's memory.
        CacheCapacityError: the engine's cache is not in place.
    """

    def __init__(self, engine: BatchingEngine, max_batch: int, capacity: int | None = None, max_queue: int = 256):
        if max_batch < 1 or max_queue < 1:
            raise InputError(f"max_batch and max_queue must be >= 1, got {max_batch} and {max_queue}")
        if capacity is not None and engine.capacity and capacity > engine.capacity:
            raise InputError(f"a row of {capacity} tokens per sequence exceeds the artifact's cache capacity "
                             f"{engine.capacity} (its max_cache_length)")
        self.engine, self.max_queue = engine, int(max_queue)
        rows = min(capacity or engine.capacity or 1, engine.capacity or capacity or 1)
        check_cache_memory(int(max_batch), rows, engine.config,
                           np.dtype(getattr(engine, "dtype", np.float32)).itemsize)
        self.state = engine.new_state(int(max_batch), rows=capacity)
        engine.rows(self.state, 0, 1)  # refuses a cache that is not in place, before anything is submitted
        self.capacity = int(self.state.capacity)
        self.slots: list[Ticket | None] = [None] * int(max_batch)
        self.next_tokens = np.zeros(int(max_batch), dtype=np.int64)
        self.stats = BatchStats(int(max_batch))
        self._queue: collections.deque[Ticket] = collections.deque()
        self._wake = threading.Condition()
        self._closed = False

    # any thread -----------------------------------------------------------------------------------------------
    def room(self, prompt_length: int) -> int:
        """The most new tokens a prompt of ``prompt_length`` can get in a row (< 1: the prompt does not fit)."""
        return self.engine.layout.room(prompt_length, self.capacity)

    def check(self, prompt_length: int, max_new_tokens: int) -> None:
        """Refuse a request that can never run: ``max_new_tokens < 1``, an empty prompt, or more rows than a slot
        holds. Raises: InputError, CacheCapacityError."""
        if max_new_tokens < 1 or prompt_length < 1:
            raise InputError(f"a request needs a prompt and max_new_tokens >= 1 (got {prompt_length} prompt tokens, "
                             f"max_new_tokens {max_new_tokens})")
        self.engine.layout.check_request(prompt_length, max_new_tokens, self.capacity)

    def submit(self, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingConfig | None = None,
               eos_ids: Sequence[int] = (), on_event: Callable[[SequenceEvent], None] = lambda event: None) -> Ticket:
        """Queue a request. Its events (:class:`SequenceEvent`) come through ``on_event`` on the engine's thread.

        Raises: InputError (an id outside the vocabulary, as :meth:`check`), CacheCapacityError, BusyError: the
            queue is full or the batcher is closed.
        """
        ticket = Ticket(prompt, max_new_tokens, sampling or SamplingConfig(), frozenset(int(i) for i in eos_ids),
                        on_event)
        self.check(ticket.prompt_length, ticket.max_new_tokens)
        check_ids(ticket.prompt, self.engine.vocab_size)
        with self._wake:
            if self._closed:
                raise BusyError("the server is shutting down")
            if len(self._queue) >= self.max_queue:
                raise BusyError(f"{len(self._queue)} requests are already waiting; try again later")
            self._queue.append(ticket)
            self.stats.waiting = len(self._queue)
            self._wake.notify()
        return ticket

    def close(self, cancel: bool = False) -> None:
        """Accept no more requests; with ``cancel``, also end the waiting and running ones (``cancelled``)."""
        with self._wake:
            self._closed = True
            if cancel:
                for ticket in list(self._queue) + [t for t in self.slots if t is not None]:
                    ticket.cancel()
            self._wake.notify()

    @property
    def idle(self) -> bool:
        """No request waiting or running."""
        return not self._queue and all(t is None for t in self.slots)

    # the engine's thread ----------------------------------------------------------------------------------------
    def run(self, poll: float = 0.05) -> None:
        """Step until :meth:`close` has been called and nothing is left (the engine's thread)."""
        while True:
            with self._wake:
                if self.idle:
                    if self._closed:
                        return
                    self._wake.wait(poll)
                    continue
            try:
                self.step()
            except Exception as exc:  # a bug: the running requests get an error, the thread goes on serving
                self._fail_running(f"{type(exc).__name__}: {exc}")

    def step(self) -> None:
        """End the cancelled sequences, admit waiting requests into free rows, run one decode step."""
        for row, ticket in enumerate(self.slots):
            if ticket is not None and ticket.cancel_reason:
                self._finish(row, ticket.cancel_reason)
        while None in self.slots:
            with self._wake:
                ticket = self._queue.popleft() if self._queue else None
                self.stats.waiting = len(self._queue)
            if ticket is None:
                break
            if ticket.cancel_reason:
                self.stats.finished[ticket.cancel_reason] += 1
                ticket.on_event(SequenceEvent(None, ticket.cancel_reason))
                continue
            self._admit(self.slots.index(None), ticket)
        if any(t is not None for t in self.slots):
            self._decode()

    def _fail_running(self, error: str) -> None:
        """End every running sequence with ``error`` (an unexpected failure of a step)."""
        for row, ticket in enumerate(self.slots):
            if ticket is not None:
                self.slots[row] = None
                self.engine.clear(self.state, row)
                self.stats.finished["error"] += 1
                try:
                    ticket.on_event(SequenceEvent(None, "error", error))
                except Exception:  # its caller is gone as well
                    pass
        self.stats.active = 0

    def _admit(self, row: int, ticket: Ticket) -> None:
        """Prefill ``ticket``'s prompt into the free ``row`` and report its first token."""
        self.slots[row] = ticket
        self.stats.active += 1
        self.stats.admitted += 1
        self.stats.prompt_tokens += ticket.prompt_length
        self.engine.clear(self.state, row)
        start = time.perf_counter()
        try:
            logits = self.engine.prefill(ticket.prompt[None], np.array([ticket.prompt_length]),
                                         self.engine.rows(self.state, row, row + 1))
            token = int(self._choose(logits, [ticket])[0])
        except MLADeployError as exc:
            self._finish(row, "error", str(exc))
            return
        finally:
            self.stats.step_seconds += time.perf_counter() - start
        self._record(row, token)

    def _decode(self) -> None:
        """One decode step over rows ``0 .. h - 1``."""
        width = max(r for r, t in enumerate(self.slots) if t is not None) + 1
        tickets = self.slots[:width]
        start = time.perf_counter()
        try:
            logits = self.engine.decode(self.next_tokens[:width], self.engine.rows(self.state, 0, width))
            tokens = self._choose(logits, tickets)
        except MLADeployError as exc:
            for row, ticket in enumerate(tickets):
                if ticket is not None:
                    self._finish(row, "error", str(exc))
            return
        finally:
            self.stats.step_seconds += time.perf_counter() - start
        self.stats.decode_steps += 1
        self.stats.decode_rows += sum(t is not None for t in tickets)
        for row, ticket in enumerate(tickets):
            if ticket is None:
                self.engine.clear(self.state, row)  # the placeholder token it was fed is not kept
            else:
                self._record(row, int(tokens[row]))

    def _choose(self, logits, tickets: Sequence[Ticket | None]) -> np.ndarray:
        """``[width]`` int64: each row's next token by its own sampler (the engine's argmax for greedy rows)."""
        sampled = [r for r, t in enumerate(tickets) if t is not None and not t.sampler.greedy]
        if not sampled:
            return self.engine.argmax(logits)  # where the logits are (a GPU's)
        host = self.engine.to_host(logits)  # one copy for the greedy rows and the draws
        tokens = host.argmax(-1).astype(np.int64)
        for row in sampled:
            tokens[row] = tickets[row].sampler.choose(host[row: row + 1])[0]
        return tokens

    def _record(self, row: int, token: int) -> None:
        """Report ``row``'s new ``token``; end its sequence at an end-of-sequence id or ``max_new_tokens``."""
        ticket = self.slots[row]
        ticket.tokens.append(token)
        self.next_tokens[row] = token
        self.stats.generated_tokens += 1
        reason = "eos" if token in ticket.eos_ids else "length" if len(ticket.tokens) >= ticket.max_new_tokens \
            else None
        ticket.on_event(SequenceEvent(token, reason))
        if reason is not None:
            self._free(row, reason)

    def _finish(self, row: int, reason: str, error: str | None = None) -> None:
        """End ``row``'s sequence without a new token (cancelled, stopped, failed)."""
        self.slots[row].on_event(SequenceEvent(None, reason, error))
        self._free(row, reason)

    def _free(self, row: int, reason: str) -> None:
        self.slots[row] = None
        self.engine.clear(self.state, row)
        self.next_tokens[row] = 0
        self.stats.finished[reason] += 1
        self.stats.active -= 1

def check_cache_memory(max_batch: int, rows: int, config, itemsize: int) -> None:
    """Refuse a cache of ``max_batch`` rows of ``rows`` tokens of ``config``'s latent (``itemsize`` bytes a number)
    that this machine cannot hold, before it is allocated. Raises: InputError."""
    from ..cache_layout import cache_elements_per_token
    from ..memory import check_fits_memory

    nbytes = max_batch * rows * cache_elements_per_token(config) * config.num_hidden_layers * itemsize
    check_fits_memory(nbytes, f"a cache of {max_batch} rows (--max-batch) of {rows} tokens")
