"""Continuous batching: sequences join and leave one running batch between decode steps, each in its own row
("slot") of one in-place latent cache.

:class:`ContinuousBatcher` holds an engine's cache of ``max_batch`` rows (``engine.new_state``, the static
layout) and a bounded queue of waiting requests. Each :meth:`~ContinuousBatcher.step`:

1. ends the sequences whose caller asked (a stop string, a client gone: :meth:`Ticket.cancel`), freeing their rows;
2. admits waiting requests into free rows, lowest row first: a request of ``n`` choices takes ``n`` rows at once.
   Each row is emptied (:meth:`Engine.clear`); with a prefix cache (:mod:`~mla_deploy.generate.prefix_cache`) the
   longest stored prefix of the prompt is copied into its first row (``write_rows``) and only the rest is prefilled;
3. prefills admitted prompts on a view of their one row (:meth:`Engine.rows`, the others' caches left as they
   are), first admitted first: with ``prefill_chunk``, at most that many prompt tokens per step, so a long prompt is
   prefilled over several steps between the running batch's decode steps (``"auto"``: as many as take about 0.4 of a
   decode step, :mod:`~mla_deploy.generate.chunk_budget`). A prompt whose prefill is done gets its
   first token; its other choices get copies of its rows (``copy_rows``) and choose theirs from the same logits;
4. runs one decode step over rows ``0 .. h - 1``, ``h`` one past the highest row decoding (a view again: the rows
   above ``h`` cost nothing; a row below it that is free or still prefilling is fed a placeholder token, and cut
   back to what it held after the step);
5. chooses each sequence's next token with its own :class:`~mla_deploy.generate.sampling.Sampler`, reports it to
   its caller (with its log probabilities, :mod:`~mla_deploy.generate.logprobs`, where it asked), and frees the row
   of each sequence that ends (an end-of-sequence id, ``max_new_tokens``).

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
from .chunk_budget import AUTO, IDLE_CHUNK, ChunkBudget
from .engine import BatchingEngine
from .logprobs import MAX_TOP_LOGPROBS, TokenLogprob, prompt_logprobs, token_logprob
from .prefix_cache import PrefixCache
from .request import check_ids
from .sampling import Sampler, SamplingConfig

#: why a batched sequence ended: :data:`~mla_deploy.generate.loop.FINISH_REASONS`, ``cancelled`` (its caller
#: went away), ``error`` (the engine failed; the event's ``error`` says how)
BATCH_FINISH_REASONS = ("eos", "stop", "length", "cancelled", "error")
#: the most choices (``n``) one request may ask for
MAX_CHOICES = 16
#: what a row holding a ticket does: its prompt is being prefilled, it waits for the prefill of the prompt it shares
#: (a request's other choices), or it decodes
PREFILL, WAIT, DECODE = "prefill", "wait", "decode"


@dataclass(frozen=True)
class SequenceEvent:
    """What happened to one request: a new ``token``, and/or ``finished`` (a reason of
    :data:`BATCH_FINISH_REASONS`) when it was the last event; ``error`` with ``finished == "error"``.
    ``logprob``: the token's log probabilities, for a request that asked for them; ``prompt_logprobs``: with the
    first token of a request that asked for its prompt's, one entry per prompt token after the first."""

    token: int | None
    finished: str | None = None
    error: str | None = None
    logprob: TokenLogprob | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


class Ticket:
    """A submitted request (one of its choices), as its caller holds it: :meth:`cancel` ends it before its next
    step.

    Attributes:
        prompt_length, max_new_tokens: as submitted. submitted: ``time.perf_counter()`` at submission.
        tokens: the new ids so far (appended on the engine's thread). reused: prompt tokens whose cache rows came
        from the prefix cache (set at admission).
        top_logprobs: None, or how many most likely tokens each token's log probabilities carry (0 .. 20).
        prompt_logprobs: the prompt's log probabilities are reported too (its prefill then returns every position's
        logits, and the prefix cache is not used for it).
        constraint: None, or the request's token mask (a :class:`~mla_deploy.generate.constrain.Constraint`:
            ``mask(logits [V])`` before its sampler chooses, ``advance(token)`` after; the sequence ends with
            ``stop`` once it is ``complete``).
    """

    def __init__(self, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingConfig,
                 eos_ids: frozenset, on_event: Callable[[SequenceEvent], None], top_logprobs: int | None = None,
                 prompt_logprobs: bool = False, constraint=None):
        self.prompt = np.asarray(prompt, dtype=np.int64)
        self.prompt_length, self.max_new_tokens = len(self.prompt), int(max_new_tokens)
        self.sampler, self.eos_ids, self.on_event = Sampler(sampling), eos_ids, on_event
        self.top_logprobs, self.prompt_logprobs = top_logprobs, bool(prompt_logprobs)
        self.constraint = constraint
        self.submitted = time.perf_counter()
        self.tokens: list[int] = []
        self.cancel_reason: str | None = None
        self.group: list[Ticket] = [self]  # the choices sharing this prompt, the one prefilled first
        self.phase, self.row, self.done, self.reused = PREFILL, -1, 0, 0
        self.prompt_entries: list[TokenLogprob] = []

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
        admitted, finished: sequences so far (a request of ``n`` choices is ``n``; finished by reason).
        prompt_tokens: prompt tokens of the requests admitted (once per request). prefill_tokens: of them, those
            prefilled (the others' rows came from the prefix cache). prefill_calls: prefill runs (a prompt cut in
            chunks is several). generated_tokens: tokens generated.
        decode_steps, decode_rows: decode steps run, and the rows in use summed over them (their ratio is the mean
            occupancy). step_seconds: time in engine steps (prefill and decode). chunk_tokens: the most prompt
            tokens the last step that prefilled could run (with the time-budgeted chunk, its size then).
    """

    rows: int
    active: int = 0
    waiting: int = 0
    admitted: int = 0
    finished: dict = field(default_factory=lambda: {r: 0 for r in BATCH_FINISH_REASONS})
    prompt_tokens: int = 0
    prefill_tokens: int = 0
    prefill_calls: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    decode_rows: int = 0
    step_seconds: float = 0.0
    chunk_tokens: int = 0


class ContinuousBatcher:
    """One running batch of sequences over ``engine`` (see the module docstring).

    Args:
        engine: a :class:`~mla_deploy.generate.engine.BatchingEngine` (an engine of :mod:`mla_deploy.engines` over a
            static-cache artifact).
        max_batch: ``B``, rows of the cache: the most sequences decoded together.
        capacity: rows each sequence may hold (prompt plus new tokens minus one); None: the engine's capacity.
            Every decode step attends over all of them, so keep it to what requests need.
        max_queue: the most requests waiting for a row; past it :meth:`submit` raises :class:`BusyError`.
        prefill_chunk: the most prompt tokens prefilled per step, between two decode steps (None: every admitted
            prompt whole before the next decode step; ``"auto"``: sized from the measured costs so that a chunk
            takes about 0.4 of a decode step, :class:`~mla_deploy.generate.chunk_budget.ChunkBudget`).
        prefix_cache_bytes: the byte budget of the prefix cache (0: none).
    Raises:
        InputError: ``max_batch`` or ``max_queue`` below 1, ``capacity`` past the engine's, a cache past this
            machine's memory, ``prefill_chunk`` below 1 (or a word other than ``"auto"``), ``prefix_cache_bytes``
            below 0.
        CacheCapacityError: the engine's cache is not in place.
    """

    def __init__(self, engine: BatchingEngine, max_batch: int, capacity: int | None = None, max_queue: int = 256,
                 prefill_chunk: int | str | None = None, prefix_cache_bytes: int = 0):
        if max_batch < 1 or max_queue < 1:
            raise InputError(f"max_batch and max_queue must be >= 1, got {max_batch} and {max_queue}")
        if capacity is not None and engine.capacity and capacity > engine.capacity:
            raise InputError(f"a row of {capacity} tokens per sequence exceeds the artifact's cache capacity "
                             f"{engine.capacity} (its max_cache_length)")
        fixed = prefill_chunk if prefill_chunk != AUTO else None
        if (fixed is not None and (isinstance(fixed, str) or fixed < 1)) or prefix_cache_bytes < 0:
            raise InputError(f"the prefill chunk must be >= 1 token and the prefix cache >= 0 bytes, got "
                             f"{prefill_chunk} and {prefix_cache_bytes}")
        self.engine, self.max_queue = engine, int(max_queue)
        rows = min(capacity or engine.capacity or 1, engine.capacity or capacity or 1)
        check_cache_memory(int(max_batch), rows, engine.config,
                           np.dtype(getattr(engine, "dtype", np.float32)).itemsize)
        if prefix_cache_bytes:
            from ..memory import check_fits_memory

            check_fits_memory(prefix_cache_bytes, f"a prefix cache of {prefix_cache_bytes >> 20} MiB (--prefix-cache-mb)")
        self.state = engine.new_state(int(max_batch), rows=capacity)
        engine.rows(self.state, 0, 1)  # refuses a cache that is not in place, before anything is submitted
        self.capacity = int(self.state.capacity)
        self.prefill_chunk = prefill_chunk
        #: the time-budgeted chunk's measurements (``prefill_chunk == "auto"``), else None
        self.chunk_budget = ChunkBudget() if prefill_chunk == AUTO else None
        #: the engine can copy cache rows (n > 1, the prefix cache): ONNX Runtime's CPU provider, not its CUDA one yet
        self.copies_rows = _copies_rows(engine, self.state)
        self.prefix = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes and self.copies_rows else None
        self.slots: list[Ticket | None] = [None] * int(max_batch)
        self.next_tokens = np.zeros(int(max_batch), dtype=np.int64)
        self.stats = BatchStats(int(max_batch))
        self._queue: collections.deque[list[Ticket]] = collections.deque()
        self._prefilling: collections.deque[Ticket] = collections.deque()  # admitted prompts, first admitted first
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
               eos_ids: Sequence[int] = (), on_event: Callable[[SequenceEvent], None] = lambda event: None,
               top_logprobs: int | None = None, prompt_logprobs: bool = False, constraint=None) -> Ticket:
        """Queue a request. Its events (:class:`SequenceEvent`) come through ``on_event`` on the engine's thread.
        ``top_logprobs``, ``prompt_logprobs``: as :class:`Ticket`'s; ``constraint``: its token mask (:class:`Ticket`),
        None for a free request.

        Raises: InputError (an id outside the vocabulary, as :meth:`check`), CacheCapacityError, BusyError: the
            queue is full or the batcher is closed.
        """
        return self.submit_choices(prompt, max_new_tokens, [sampling or SamplingConfig()], eos_ids, [on_event],
                                   top_logprobs, prompt_logprobs, [constraint])[0]

    def submit_choices(self, prompt: Sequence[int], max_new_tokens: int, samplings: Sequence[SamplingConfig],
                       eos_ids: Sequence[int], on_events: Sequence[Callable[[SequenceEvent], None]],
                       top_logprobs: int | None = None, prompt_logprobs: bool = False,
                       constraints: Sequence | None = None) -> list[Ticket]:
        """Queue ``n = len(samplings)`` choices of one prompt (OpenAI's ``n``): one prefill, its cache rows copied
        into the others' rows, then each its own sequence with its own sampler (``samplings[i]``) and events
        (``on_events[i]``) and token mask (``constraints[i]``, each choice its own grammar state). Admitted when
        ``n`` rows are free at once.

        Raises: as :meth:`submit`; InputError: ``n`` outside 1 .. min(:data:`MAX_CHOICES`, ``max_batch``),
            ``top_logprobs`` outside 0 .. 20.
        """
        if not 1 <= len(samplings) <= min(MAX_CHOICES, len(self.slots)) or len(on_events) != len(samplings):
            raise InputError(f"n = {len(samplings)} choices: at most {min(MAX_CHOICES, len(self.slots))} (the rows "
                             f"of the batch, --max-batch {len(self.slots)}, and {MAX_CHOICES})")
        if len(samplings) > 1 and not self.copies_rows:
            raise InputError(f"n > 1 shares one prefill by copying cache rows, which {self.engine.provider} does "
                             f"not do here: send the request n times")
        if top_logprobs is not None and not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise InputError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {top_logprobs}")
        eos = frozenset(int(i) for i in eos_ids)
        constraints = list(constraints) if constraints is not None else [None] * len(samplings)
        assert len(constraints) == len(samplings)
        group = [Ticket(prompt, max_new_tokens, sampling, eos, on_event, top_logprobs, prompt_logprobs, constraint)
                 for sampling, on_event, constraint in zip(samplings, on_events, constraints)]
        for ticket in group:
            ticket.group = group
        self.check(group[0].prompt_length, group[0].max_new_tokens)
        check_ids(group[0].prompt, self.engine.vocab_size)
        with self._wake:
            if self._closed:
                raise BusyError("the server is shutting down")
            if len(self._queue) >= self.max_queue:
                raise BusyError(f"{len(self._queue)} requests are already waiting; try again later")
            self._queue.append(group)
            self.stats.waiting = len(self._queue)
            self._wake.notify()
        return group

    def close(self, cancel: bool = False) -> None:
        """Accept no more requests; with ``cancel``, also end the waiting and running ones (``cancelled``)."""
        with self._wake:
            self._closed = True
            if cancel:
                for ticket in [t for g in self._queue for t in g] + [t for t in self.slots if t is not None]:
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
        """End the cancelled sequences, admit waiting requests into free rows, prefill (a chunk of) the admitted
        prompts, run one decode step."""
        for row, ticket in enumerate(self.slots):
            if ticket is None or not ticket.cancel_reason:
                continue
            if ticket.phase == DECODE:
                self._finish(row, ticket.cancel_reason)
            elif all(t.cancel_reason for t in ticket.group):  # a prompt nobody waits for any more
                if ticket.group[0] in self._prefilling:
                    self._prefilling.remove(ticket.group[0])
                for member in ticket.group:
                    if self.slots[member.row] is member:
                        self._finish(member.row, member.cancel_reason)
        while self.slots.count(None):
            with self._wake:
                group = self._queue[0] if self._queue else None
                if group is None or len(group) > self.slots.count(None):
                    break
                self._queue.popleft()
                self.stats.waiting = len(self._queue)
            if all(t.cancel_reason for t in group):
                for ticket in group:
                    self.stats.finished[ticket.cancel_reason] += 1
                    ticket.on_event(SequenceEvent(None, ticket.cancel_reason))
                continue
            self._admit(group)
        self._prefill()
        if any(t is not None and t.phase == DECODE for t in self.slots):
            self._decode()

    def _fail_running(self, error: str) -> None:
        """End every running sequence with ``error`` (an unexpected failure of a step)."""
        self._prefilling.clear()
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

    def _admit(self, group: list[Ticket]) -> None:
        """Give ``group``'s choices free rows; its first one's prompt starts from the prefix cache's longest stored
        prefix and waits for its prefill."""
        for ticket in group:
            row = self.slots.index(None)
            self.slots[row], ticket.row, ticket.phase = ticket, row, WAIT
            self.engine.clear(self.state, row)
        lead = group[0]
        lead.phase = PREFILL
        self.stats.active += len(group)
        self.stats.admitted += len(group)
        self.stats.prompt_tokens += lead.prompt_length
        if self.prefix is not None and not lead.prompt_logprobs:  # the prompt's own logprobs need every position
            start = time.perf_counter()
            try:
                reused, rows = self.prefix.lookup(lead.prompt)
                if reused:
                    self.engine.write_rows(self.state, lead.row, 0, rows)
            except MLADeployError as exc:
                self._fail_group(group, str(exc))
                return
            finally:
                self.stats.step_seconds += time.perf_counter() - start
            lead.done = lead.reused = reused
        self._prefilling.append(lead)

    def _chunk_tokens(self) -> tuple[float, bool]:
        """``(tokens, timed)``: the most prompt tokens this step prefills, and whether the time budget sized them
        (a chunk run while sequences decode, which it then measures)."""
        if self.chunk_budget is None:
            return self.prefill_chunk or float("inf"), False
        if not any(t is not None and t.phase == DECODE for t in self.slots):
            return IDLE_CHUNK, False
        return self.chunk_budget.size(), True

    def _prefill(self) -> None:
        """Prefill the admitted prompts, first admitted first, at most :meth:`_chunk_tokens` tokens in all."""
        if not self._prefilling:
            return
        budget, timed = self._chunk_tokens()
        self.stats.chunk_tokens = int(min(budget, sum(t.prompt_length - t.done for t in self._prefilling)))
        began, ran = time.perf_counter(), 0
        while budget > 0 and self._prefilling:
            lead = self._prefilling[0]
            take = int(min(lead.prompt_length - lead.done, budget))
            start = time.perf_counter()
            try:
                logits = self.engine.prefill(lead.prompt[None, lead.done: lead.done + take], np.array([take]),
                                             self.engine.rows(self.state, lead.row, lead.row + 1),
                                             every=lead.prompt_logprobs)
                if lead.prompt_logprobs:
                    lead.prompt_entries += prompt_logprobs(logits[0], lead.prompt[lead.done: lead.done + take + 1],
                                                           lead.top_logprobs or 0)
                    logits = logits[:, take - 1]
                lead.done += take
                budget -= take
                ran += take
                self.stats.prefill_calls += 1
                self.stats.prefill_tokens += take
                if lead.done == lead.prompt_length:
                    self._prefilling.popleft()
                    self._start(lead, logits)
            except MLADeployError as exc:
                if self._prefilling and self._prefilling[0] is lead:
                    self._prefilling.popleft()
                self._fail_group(lead.group, str(exc))
            finally:
                self.stats.step_seconds += time.perf_counter() - start
        if timed:
            self.chunk_budget.prefilled(ran, time.perf_counter() - began)

    def _start(self, lead: Ticket, logits) -> None:
        """``lead``'s prompt is prefilled: keep its blocks in the prefix cache, copy its rows to its group's other
        choices, and choose every choice's first token from its last position's ``logits [1, V]``."""
        group = lead.group
        if self.prefix is not None:
            self.prefix.store(lead.prompt, lead.prompt_length,
                              lambda start, stop: self.engine.read_rows(self.state, lead.row, start, stop))
        if len(group) > 1:
            self.engine.copy_rows(self.state, lead.row, [t.row for t in group[1:]], lead.prompt_length)
        tokens, host = self._choose(logits, group, rows=[0] * len(group))
        for ticket in group:
            ticket.phase = DECODE
        for i, ticket in enumerate(group):
            if self.slots[ticket.row] is ticket:
                self._record(ticket.row, int(tokens[i]), host[0] if host is not None else None,
                             tuple(lead.prompt_entries) if ticket.prompt_logprobs else None)

    def _fail_group(self, group: list[Ticket], error: str) -> None:
        for ticket in group:
            if ticket.row >= 0 and self.slots[ticket.row] is ticket:
                self._finish(ticket.row, "error", error)

    def _decode(self) -> None:
        """One decode step over rows ``0 .. h - 1``."""
        width = max(r for r, t in enumerate(self.slots) if t is not None and t.phase == DECODE) + 1
        tickets = [t if t is not None and t.phase == DECODE else None for t in self.slots[:width]]
        held = self.state.lengths[:width].copy()  # what the rows not decoding hold (free: 0; prefilling: a part)
        start = time.perf_counter()
        try:
            logits = self.engine.decode(self.next_tokens[:width], self.engine.rows(self.state, 0, width))
            tokens, host = self._choose(logits, tickets, rows=range(width))
        except MLADeployError as exc:
            for row, ticket in enumerate(tickets):
                if ticket is not None:
                    self._finish(row, "error", str(exc))
            return
        finally:
            self.stats.step_seconds += time.perf_counter() - start
        if self.chunk_budget is not None:
            self.chunk_budget.decoded(time.perf_counter() - start)
        self.stats.decode_steps += 1
        self.stats.decode_rows += sum(t is not None for t in tickets)
        for row, ticket in enumerate(tickets):
            if ticket is None:
                self.engine.clear(self.state, row, int(held[row]))  # the placeholder token it was fed is not kept
            else:
                self._record(row, int(tokens[row]), host[row] if host is not None else None)

    def _choose(self, logits, tickets: Sequence[Ticket | None], rows: Sequence[int]):
        """``(tokens, host)``: each ticket's next token by its own sampler from its row ``rows[i]`` of ``logits``
        (the engine's argmax when every one is greedy, unconstrained and asks for no log probabilities), over its
        constraint's mask for a constrained ticket (the other rows pay nothing for it), and the logits on the host
        where they were copied (None where not; unmasked: log probabilities are the model's)."""
        host_wanted = [i for i, t in enumerate(tickets) if t is not None and (
            not t.sampler.greedy or t.top_logprobs is not None or t.constraint is not None)]
        if not host_wanted:
            greedy = self.engine.argmax(logits)  # where the logits are (a GPU's)
            return np.array([greedy[r] for r in rows], dtype=np.int64), None
        host = np.asarray(self.engine.to_host(logits))  # one copy for the greedy rows, the draws and the logprobs
        tokens = np.array([host[r].argmax() for r in rows], dtype=np.int64)
        for i in host_wanted:
            ticket = tickets[i]
            if ticket.constraint is not None:
                tokens[i] = ticket.sampler.choose(ticket.constraint.mask(host[rows[i]])[None])[0]
            elif not ticket.sampler.greedy:
                tokens[i] = ticket.sampler.choose(host[rows[i]: rows[i] + 1])[0]
        return tokens, host

    def _record(self, row: int, token: int, logits: np.ndarray | None = None,
                prompt_entries: tuple | None = None) -> None:
        """Report ``row``'s new ``token`` (with its log probabilities from ``logits [V]`` where its request asked);
        end its sequence at an end-of-sequence id or ``max_new_tokens``."""
        ticket = self.slots[row]
        ticket.tokens.append(token)
        self.next_tokens[row] = token
        self.stats.generated_tokens += 1
        if ticket.constraint is not None and token not in ticket.eos_ids:
            ticket.constraint.advance(token)
        reason = "eos" if token in ticket.eos_ids else \
            "stop" if ticket.constraint is not None and ticket.constraint.complete else \
            "length" if len(ticket.tokens) >= ticket.max_new_tokens else None
        entry = token_logprob(logits, token, ticket.top_logprobs) if ticket.top_logprobs is not None else None
        ticket.on_event(SequenceEvent(token, reason, logprob=entry, prompt_logprobs=prompt_entries))
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

def _copies_rows(engine: BatchingEngine, state) -> bool:
    """Whether ``engine`` copies the cache rows of ``state`` (it reads none here: an empty range)."""
    from ..errors import RuntimeMissingError

    try:
        engine.read_rows(state, 0, 0, 0)
    except RuntimeMissingError:
        return False
    return True


def check_cache_memory(max_batch: int, rows: int, config, itemsize: int) -> None:
    """Refuse a cache of ``max_batch`` rows of ``rows`` tokens of ``config``'s latent (``itemsize`` bytes a number)
    that this machine cannot hold, before it is allocated. Raises: InputError."""
    from ..cache_layout import cache_elements_per_token
    from ..memory import check_fits_memory

    nbytes = max_batch * rows * cache_elements_per_token(config) * config.num_hidden_layers * itemsize
    check_fits_memory(nbytes, f"a cache of {max_batch} rows (--max-batch) of {rows} tokens")
