"""What the generation loop needs from an engine: :class:`GenerationEngine`, the whole interface it drives.

The loop (:mod:`mla_deploy.generate.loop`) calls nothing else. Every engine that runs an artifact
(:class:`~mla_deploy.engines.base.Engine`: ONNX Runtime, TensorRT) implements it; so can a test's toy engine.

Shapes: ``B`` batch (rows of the cache), ``S`` prompt width (right-padded), ``V`` vocabulary. Ids, lengths and
tokens are host ``int64`` arrays; logits stay in the runtime's memory (a NumPy array, a CUDA tensor) until
:meth:`~GenerationEngine.argmax` or :meth:`~GenerationEngine.to_host` reads them.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np


class GenerationEngine(Protocol):
    """The engine interface of the generation loop.

    Attributes:
        provider: what executes the graphs (an ONNX Runtime provider, ``TensorRT x.y``).
        vocab_size: ``V``; a token id lies in ``[0, V)``.
    """

    provider: str
    vocab_size: int

    def check_request(self, prompt_length: int, max_new_tokens: int) -> None:
        """Refuse, before anything runs, a request the cache cannot hold (``CacheCapacityError``)."""

    def new_state(self, batch: int, rows: int | None = None) -> Any:
        """An empty cache of ``batch`` rows, each holding at most ``rows`` tokens (None: the engine's capacity).
        The loop passes it back to :meth:`prefill` and :meth:`decode`, which update it in place; its
        ``lengths [B]`` is the number of tokens each row holds."""

    def prefill(self, ids: np.ndarray, lengths: np.ndarray, state: Any, every: bool = False) -> Any:
        """Run the prompts ``ids [B, S]`` (row b's real tokens are its first ``lengths[b]``) into ``state`` after the
        rows each sequence already holds (``state.lengths[b]``: 0 in an empty state, so positions ``0 ..
        lengths[b] - 1``). Returns ``logits [B, V]`` of each row's last real token (``every``: ``[B, S, V]`` of
        every position, on the host)."""

    def decode(self, tokens: np.ndarray, state: Any) -> Any:
        """One new token per row, ``tokens [B]``, at each row's own next position (``state.lengths[b]``).
        Returns ``logits [B, V]``."""

    def argmax(self, logits: Any) -> np.ndarray:
        """``[B]`` int64 host: the most likely token of each row (the first of equal maxima)."""

    def sample(self, logits: Any, config: Any, uniforms: np.ndarray) -> np.ndarray:
        """``[B]`` int64 host: the token each row's uniform in ``uniforms [B]`` picks from the sampling distribution
        of ``logits [B, V]`` under ``config`` (a sampling :class:`~mla_deploy.generate.sampling.SamplingConfig`),
        as :func:`~mla_deploy.generate.sampling.draw` picks it on the host."""

    def to_host(self, logits: Any) -> np.ndarray:
        """``logits`` as a NumPy array on the host (a copy that outlives the next step)."""

    def synchronize(self) -> None:
        """Wait for the engine's queued work (a no-op for a synchronous runtime)."""

    def info(self) -> dict[str, Any]:
        """What the engine runs (provider, precision, cache, runtime facts), for reports."""


class BatchingEngine(GenerationEngine, Protocol):
    """What continuous batching (:mod:`mla_deploy.generate.batching`) needs besides the loop's interface: an
    in-place cache whose rows can run alone.

    Attributes:
        layout: the cache layout (:class:`~mla_deploy.cache_layout.CacheLayout`: its ``room`` and ``check_request``).
        capacity: rows per sequence of the engine's cache (None: a growing cache).
    """

    layout: Any
    capacity: int | None

    def rows(self, state: Any, start: int, stop: int) -> Any:
        """Sequences ``start .. stop - 1`` of ``state`` as a state sharing its memory (prefill and decode on it
        write them in place). Raises CacheCapacityError for a growing cache."""

    def clear(self, state: Any, row: int, keep: int = 0) -> None:
        """Empty sequence ``row`` of ``state`` for a new sequence, or cut it back to its first ``keep`` rows."""

    def copy_rows(self, state: Any, source: int, targets: Sequence[int], count: int) -> None:
        """Give sequences ``targets`` the first ``count`` cache rows of sequence ``source`` (a shared prefill)."""

    def read_rows(self, state: Any, row: int, start: int, stop: int) -> np.ndarray:
        """Cache rows ``start .. stop - 1`` of sequence ``row``, every layer, ``[layers, T, C]`` on the host (``C``: the
        latent row, then with sparse attention the layer's index keys)."""

    def write_rows(self, state: Any, row: int, start: int, rows: np.ndarray) -> None:
        """Write :meth:`read_rows`' ``rows`` into sequence ``row`` at slot ``start``; it then holds ``start + T``."""
