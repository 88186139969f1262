"""The engine base: what every runtime that executes an exported artifact shares.

:class:`Engine` owns what does not depend on the runtime: the artifact's manifest and config, input checks, the
cache state (through the artifact's :class:`~mla_deploy.cache_layout.CacheLayout`) and capacity checks, one step
of a graph (:meth:`Engine.step`), and the public interface the generation loop drives
(:class:`~mla_deploy.generate.engine.GenerationEngine`: :meth:`~Engine.prefill`, :meth:`~Engine.decode`,
:meth:`~Engine.argmax`, ...). The loop itself is :mod:`mla_deploy.generate.loop`'s; :meth:`Engine.stream` and
:meth:`Engine.generate` call it. A runtime implements only allocation, binding and execution:

* :meth:`Engine._allocate` ``(shape) -> array``: one zeroed cache array of the runtime's kind;
* :meth:`Engine._run` ``(role, ids, positions, logits_index, control, state) -> (logits, presents)``: one graph run;
* where its arrays are not host NumPy arrays or its work is queued: :meth:`Engine.to_host`,
  :meth:`Engine.argmax`, :meth:`Engine.sample`, :meth:`Engine.synchronize`, :meth:`Engine._sliceable`, and :meth:`Engine.info` for its
  own facts.

Shapes: ``B`` batch, ``S`` new tokens per sequence, ``V`` vocabulary, ``C`` latent width, ``T`` rows held.
"""

from __future__ import annotations

from numbers import Integral
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..artifact import Manifest
from ..cache_layout import CacheState, cache_tensors, layer_rows, tensor_rows
from ..errors import InputError, RuntimeMissingError, ShapeError
from ..generate.loop import Generation, GenerationStream, generate_tokens, stream_tokens
from ..generate.request import check_ids
from ..generate.sampling import SamplingConfig, draw


#: the most bytes one layer's attention scores may take in one prefill call (``[B, heads, S, W]`` counted in float32):
#: a longer prompt, or a larger batch of them, is prefilled in chunks (:func:`prefill_chunk_size`)
PREFILL_SCORE_BYTES = 1 << 30
#: a chunk holds a multiple of this many tokens per sequence, and at least this many
PREFILL_CHUNK_STEP = 64


def prefill_chunk_size(batch: int, heads: int, width: int, budget: int = PREFILL_SCORE_BYTES) -> int:
    """Tokens per sequence in one prefill call over ``batch`` prompts ``width`` tokens wide: ``width`` when the
    scores ``[batch, heads, width, width]`` fit ``budget`` bytes in float32 (one call), else the most tokens ``S``
    whose scores ``[batch, heads, S, width]`` fit, rounded down to a multiple of :data:`PREFILL_CHUNK_STEP` (at least
    one step)."""
    fit = budget // (4 * max(batch, 1) * max(heads, 1) * max(width, 1))
    if fit >= width:
        return max(width, 1)
    return max(PREFILL_CHUNK_STEP, fit // PREFILL_CHUNK_STEP * PREFILL_CHUNK_STEP)


def prefill_chunks(lengths: np.ndarray, chunk: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The calls of a prefill of right-padded prompts of ``lengths [B]`` in chunks of at most ``chunk`` tokens per
    sequence: one ``(start [B], count [B])`` per call, row ``b`` taking its tokens ``start[b] .. start[b] + count[b]
    - 1`` (``count[b]`` 0: the row only pads that call).

    Each row is cut from its end: its first chunk takes what is left over (``1 .. chunk`` tokens), the others
    ``chunk`` each, and a row needing fewer calls than the longest sits the first ones out. So every row's last
    token, whose logits a prefill returns, is in the last call, and each row's tokens stay in order and contiguous.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    assert chunk >= 1 and (lengths >= 1).all()
    needed = -(-lengths // chunk)  # calls per row
    first = lengths - (needed - 1) * chunk  # the leftover chunk, 1 .. chunk tokens
    calls = int(needed.max(initial=0))
    plan = []
    for k in range(calls):
        j = k - (calls - needed)  # this call's chunk of each row (< 0: not begun)
        count = np.where(j < 0, 0, np.where(j == 0, first, chunk))
        start = np.where(j <= 0, 0, first + (j - 1) * chunk)
        plan.append((start.astype(np.int64), count.astype(np.int64)))
    return plan


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


class Engine:
    """Base class of the engines that run an artifact (see the module docstring).

    Args:
        root: the artifact directory.
        manifest: its manifest (already loaded and checked by the subclass).
        capacity: static layouts: cache rows per sequence (default: the manifest's ``max_cache_length``).
        prefill_chunk: the most prompt tokens per sequence in one prefill call (:meth:`prefill`); None: as many as
            keep one layer's attention scores within :data:`PREFILL_SCORE_BYTES` (:func:`prefill_chunk_size`).

    Attributes:
        root, manifest, config, layout, precision, capacity, prefill_chunk; ``provider`` is set by the subclass.

    Raises:
        InputError: ``prefill_chunk`` not an integer, or below 1.
    """

    provider: str = ""

    def __init__(self, root: str | Path, manifest: Manifest, capacity: int | None = None,
                 prefill_chunk: int | None = None):
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, Integral)
                                          or prefill_chunk < 1):
            raise InputError(f"the prefill chunk must be a whole number of tokens, at least 1; got {prefill_chunk!r}")
        self.root = Path(root)
        self.manifest = manifest
        self.config = manifest.config
        self.layout = manifest.layout
        #: the graph's caches in order (the latent rows; with sparse attention the index keys too)
        self.cache_tensors = cache_tensors(self.config)
        self.precision = manifest.precision
        self.capacity = int(capacity or manifest.capacity or 0) if self.layout.has_capacity else None
        self.prefill_chunk = None if prefill_chunk is None else int(prefill_chunk)

    @property
    def cache_mode(self) -> str:
        """The layout's name (``concat`` or ``static``)."""
        return self.layout.mode

    @property
    def vocab_size(self) -> int:
        """``V``: a token id lies in ``[0, V)``."""
        return self.config.vocab_size

    # what a runtime implements ----------------------------------------------------------------------
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

    def _rows(self, cache, start: int, stop: int):
        """A view of the sequences ``start .. stop - 1`` of one in-place cache array (same memory), that
        :meth:`_run` binds like the array itself."""
        raise RuntimeMissingError(f"{type(self).__name__} cannot run some rows of its cache alone (continuous "
                                  f"batching runs on ONNX Runtime)")

    def _prefill_limit(self) -> int | None:
        """The most new tokens per sequence the runtime's prefill takes in one call (None: no limit of its own)."""
        return None

    def _sliceable(self, cache):
        """``cache`` as an array that can be sliced (default: itself; a GPU cache is sliced before it is copied)."""
        return cache

    def to_host(self, array) -> np.ndarray:
        """A host NumPy copy of a runtime array (logits, a cache): it outlives the step and the state it came from."""
        return np.array(array)

    def argmax(self, logits) -> np.ndarray:
        """``[B]`` int64: the most likely token of each row of ``logits [B, V]`` (the first of equal maxima)."""
        return self.to_host(logits).argmax(-1).astype(np.int64)

    def sample(self, logits, config: SamplingConfig, uniforms: np.ndarray) -> np.ndarray:
        """``[B]`` int64: the tokens ``uniforms [B]`` pick from the sampling distribution of ``logits [B, V]``
        (:func:`~mla_deploy.generate.sampling.draw` on the host copy)."""
        return draw(self.to_host(logits), config, uniforms)

    def synchronize(self) -> None:
        """Wait for queued work (asynchronous runtimes; a no-op here)."""

    def info(self) -> dict[str, Any]:
        """What this engine runs: provider, precision, cache mode and capacity."""
        return {"provider": self.provider, "precision": self.precision, "cache_mode": self.cache_mode,
                "capacity": self.capacity}

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
        return self.layout.new_state(batch, [t.width for t in self.cache_tensors], capacity, self._allocate)

    def rows(self, state: CacheState, start: int, stop: int) -> CacheState:
        """Sequences ``start .. stop - 1`` of an in-place ``state`` as a state of ``stop - start`` rows that shares
        its memory (:meth:`CacheLayout.rows <mla_deploy.cache_layout.CacheLayout.rows>`): prefill or decode on it
        writes those sequences' cache rows and lengths in ``state``. What continuous batching runs on: one
        sequence prefilled into a free row while the others wait, a decode step over the rows in use.

        Raises: CacheCapacityError: a growing (concat) cache. InputError: rows outside the batch.
        """
        return self.layout.rows(state, start, stop, self._rows)

    def clear(self, state: CacheState, row: int, keep: int = 0) -> None:
        """Empty sequence ``row`` of an in-place ``state`` for a new sequence, or cut it back to its first ``keep``
        rows (nothing is zeroed or copied)."""
        self.layout.clear(state, row, keep)

    def _host_view(self, cache) -> np.ndarray:
        """One layer's whole cache as a host NumPy array sharing its memory (writes go to the cache): what
        :meth:`copy_rows`, :meth:`read_rows` and :meth:`write_rows` work through. Raises RuntimeMissingError where
        the runtime's cache is not in host memory."""
        raise RuntimeMissingError(f"{type(self).__name__} cannot copy cache rows (its cache is not in host memory)")

    def _check_row(self, state: CacheState, row: int, stop: int) -> None:
        if not 0 <= row < len(state.lengths):
            raise InputError(f"row {row} is not a row of a batch of {len(state.lengths)}")
        if not 0 <= stop <= (state.capacity or 0):
            raise InputError(f"slot {stop} is outside a row of {state.capacity} slots")

    def copy_rows(self, state: CacheState, source: int, targets: Sequence[int], count: int) -> None:
        """Give sequences ``targets`` of an in-place ``state`` the first ``count`` cache rows of sequence ``source``
        (its latent rows copied; each target then holds ``count`` rows): ``n`` sequences sharing one prompt's
        prefill. Raises: CacheCapacityError: a growing cache. RuntimeMissingError: a cache off the host.
        InputError: rows outside the batch or the row's slots."""
        self._check_row(state, source, count)
        for target in targets:
            self._check_row(state, target, count)
        for cache in state.caches:
            array = self._host_view(cache)
            held = self.layout.slots(array, source, 0, count)
            for target in targets:
                self.layout.slots(array, target, 0, count)[...] = held
        for target in targets:
            state.lengths[target] = count

    def read_rows(self, state: CacheState, row: int, start: int, stop: int) -> np.ndarray:
        """Cache rows ``start .. stop - 1`` of sequence ``row``, every layer: ``[layers, stop - start, W]`` on the host
        (a copy; ``W`` the latent row, with sparse attention followed by the index keys:
        :func:`~mla_deploy.cache_layout.layer_rows`). What a prefix cache keeps of a prompt. Raises: as
        :meth:`copy_rows`."""
        self._check_row(state, row, stop)
        return layer_rows(self.config, [self.layout.slots(self._host_view(cache), row, start, stop)
                                        for cache in state.caches])

    def write_rows(self, state: CacheState, row: int, start: int, rows: np.ndarray) -> None:
        """Write ``rows [layers, T, W]`` (from :meth:`read_rows`) into sequence ``row`` at slots ``start ..``; the
        sequence then holds ``start + T`` rows. Raises: as :meth:`copy_rows`; ShapeError: ``rows`` of another shape."""
        rows = np.asarray(rows)
        self._check_row(state, row, start + rows.shape[1] if rows.ndim == 3 else 0)
        for cache, part in zip(state.caches, tensor_rows(self.config, rows), strict=True):
            self.layout.slots(self._host_view(cache), row, start, start + len(part))[...] = part
        state.lengths[row] = start + rows.shape[1]

    def check_request(self, prompt_length: int, max_new_tokens: int) -> None:
        """Refuse a request of prompts ``prompt_length`` wide and ``max_new_tokens`` that the cache cannot hold.

        Raises: CacheCapacityError (the layout's own refusal).
        """
        self.layout.check_request(prompt_length, max_new_tokens, self.capacity)

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
            ``logits [B, K, V]`` (``K = S`` by default) and each cache's present (``present_latent.{i}`` ``[B, T, C]``,
            ``present_index.{i}`` with sparse attention: :func:`~mla_deploy.cache_layout.cache_tensors`): the rows
            held after the step (:meth:`CacheLayout.held <mla_deploy.cache_layout.CacheLayout.held>`).
        """
        logits = self.step(role, input_ids, position_ids, state, valid, logits_index)
        self.synchronize()
        out = {"logits": self.to_host(logits)}
        for tensor, cache in zip(self.cache_tensors, state.caches):
            out[tensor.present] = self.to_host(self.layout.held(self._sliceable(cache), state))
        return out

    # the generation loop's interface (GenerationEngine) --------------------------------------------------------
    def prefill_chunk_for(self, batch: int, width: int) -> int:
        """Tokens per sequence in each call of a prefill of ``batch`` prompts ``width`` tokens wide:
        :attr:`prefill_chunk`, or the scores' budget (:func:`prefill_chunk_size`), within the runtime's own limit;
        ``width`` means one call."""
        chunk = self.prefill_chunk or prefill_chunk_size(batch, self.config.num_attention_heads, width)
        limit = self._prefill_limit()
        return max(1, min(chunk, width, limit or width))

    def prefill(self, ids, lengths, state: CacheState, every: bool = False):
        """The ``prefill`` graph over right-padded prompts, into ``state`` after the rows each sequence already holds
        (``state.lengths[b]``, 0 in an empty state: the rest of a prompt whose start is cached, one chunk of a prompt
        prefilled in several calls): in one call, or, past :meth:`prefill_chunk_for` tokens, in chunks
        (:func:`prefill_chunks`), each attending to the rows the earlier ones cached, so that a long prompt needs the
        scores of one chunk at a time.

        Args:
            ids: ``[B, S]`` int64; row b's real tokens are its first ``lengths[b]``, at positions ``state.lengths[b]
                ..``.
            lengths: ``[B]`` int64, each in ``[1, S]``.
            every: return the logits of every position, ``[B, S, V]`` on the host (a prompt's own log
                probabilities), instead of each row's last real token's.
        Returns:
            ``logits [B, V]`` of each row's last real token, in the runtime's memory (``every``: ``[B, S, V]`` host
            float32, what a padded position holds unspecified).
        Raises:
            ShapeError: ``lengths`` not ``[B]`` or outside ``[1, S]``; as :meth:`step`.
        """
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        lengths = np.ascontiguousarray(lengths, dtype=np.int64)
        width = ids.shape[-1] if ids.ndim == 2 else 0
        if lengths.shape != ids.shape[:1] or not ((lengths >= 1) & (lengths <= width)).all():
            raise ShapeError(f"prefill takes ids [B, S] and lengths [B], each in [1, S]; got ids {list(ids.shape)}, "
                             f"lengths {lengths.tolist()}")
        held = state.lengths.copy()[:, None]  # where each row's new tokens begin
        chunk = self.prefill_chunk_for(len(lengths), width)
        if chunk >= width:
            positions = held + np.arange(width, dtype=np.int64)
            valid = (positions - held < lengths[:, None]).astype(np.int64)
            logits = self.step("prefill", ids, positions, state, valid,
                               logits_index=None if every else (lengths - 1)[:, None])
            return np.asarray(self.to_host(logits), dtype=np.float32) if every else logits[:, 0]
        check_ids(ids, self.config.vocab_size)  # every id, before the first chunk writes the cache
        offsets = np.arange(chunk, dtype=np.int64)
        logits, out = None, None
        for start, count in prefill_chunks(lengths, chunk):
            valid = offsets[None, :] < count[:, None]
            positions = start[:, None] + offsets
            part = np.where(valid, np.take_along_axis(ids, np.minimum(positions, width - 1), axis=1), 0)
            logits = self.step("prefill", part, held + positions, state, valid.astype(np.int64),
                               logits_index=None if every else np.maximum(count - 1, 0)[:, None])
            if every:
                host = np.asarray(self.to_host(logits), dtype=np.float32)
                if out is None:
                    out = np.zeros((len(lengths), width, host.shape[-1]), dtype=np.float32)
                for b in np.flatnonzero(count):
                    out[b, start[b]: start[b] + count[b]] = host[b, : count[b]]
        return out if every else logits[:, 0]

    def decode(self, tokens, state: CacheState):
        """The ``decode`` graph over one new token per row, ``tokens [B]`` int64, each at its row's own next
        position (``state.lengths[b]``). Returns ``logits [B, V]`` in the runtime's memory."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        if tokens.ndim != 1:
            raise ShapeError(f"decode takes one token per row, [B]; got {list(tokens.shape)}")
        index = np.zeros((len(tokens), 1), dtype=np.int64)
        return self.step("decode", tokens[:, None], state.lengths[:, None].copy(), state, logits_index=index)[:, 0]

    def stream(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: SamplingConfig | None = None,
               eos_ids: Sequence[int] = ()) -> GenerationStream:
        """The generation loop over this engine as an iterator of steps
        (:func:`~mla_deploy.generate.loop.stream_tokens`): prefill the right-padded prompts, then decode steps
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
        return stream_tokens(self, prompts, max_new_tokens, sampling, eos_ids)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: SamplingConfig | None = None,
                 eos_ids: Sequence[int] = ()) -> Generation:
        """:meth:`stream`, run to the end. Greedy with no ``eos_ids``: exactly ``max_new_tokens`` per sequence."""
        return generate_tokens(self, prompts, max_new_tokens, sampling, eos_ids)
