"""The time-budgeted prefill chunk: how many prompt tokens continuous batching prefills between two decode steps
when the server is not told a fixed number (``mla-deploy serve`` without ``--prefill-chunk``).

A running stream's gap between two tokens is one decode step plus the prefill run before it. A chunk's cost is about
proportional to its tokens (measured on the CPU: 4 layers of V2-Lite in int4 on 2 cores, a 64-token chunk took 7.8
decode steps of 4 rows, a 16-token one 2.3, a 1-token one 0.4; the tokens deeper in a long prompt cost more, as they
attend to more rows), so a fixed chunk that suits one batch and machine stretches the gaps of another many times
over. :class:`ChunkBudget` sizes each chunk so that it takes about :data:`DECODE_SHARE` of a decode step: it keeps
a running mean of the decode steps' time and of the prefill's time per token (both measured by the batcher around
the engine's calls, so they follow the batch's width, the prompt's depth and whatever else shares the machine), and
asks for ``share x decode step / seconds per token`` tokens. The seconds per token are those of the last chunks,
fixed cost included, so the size settles where a chunk takes the share (``k' = k x target / t(k)`` has its fixed
point at ``t(k) = target``). A chunk grows at most :data:`GROWTH` times from one step to the next (a noisy
measurement does not turn into a long gap), and is at least one token (a prompt always moves on).

With no sequence decoding there is no stream to keep at pace: the batcher then prefills up to :data:`IDLE_CHUNK`
tokens per step (a request arriving meanwhile waits for one such call at most).
"""

from __future__ import annotations

#: the ``prefill_chunk`` that asks :class:`~mla_deploy.generate.batching.ContinuousBatcher` for the time-budgeted chunk
AUTO = "auto"
#: the share of a decode step one interleaved chunk takes on average: below one half, so that with the steps' own
#: jitter (measured: about 10% under load) a running stream's p99 gap stays within 1.5 decode steps
DECODE_SHARE = 0.4
#: tokens of a chunk before any has been timed
FIRST_CHUNK = 4
#: the most a chunk grows from one step to the next
GROWTH = 2.0
#: tokens prefilled per step while no sequence decodes
IDLE_CHUNK = 256
#: the weight of the newest measurement in the running means
WEIGHT = 0.3


class ChunkBudget:
    """The size of the next interleaved prefill chunk, from the measured costs (see the module docstring).

    Args:
        share: the share of a decode step a chunk may take (> 0).
        first: tokens of the first chunk, before any measurement (>= 1).

    Attributes:
        tokens: the size of the last chunk asked for. decode_seconds, token_seconds: the running means (None
            before the first measurement).
    """

    def __init__(self, share: float = DECODE_SHARE, first: int = FIRST_CHUNK):
        assert share > 0 and first >= 1
        self.share, self.tokens = float(share), int(first)
        self.decode_seconds: float | None = None
        self.token_seconds: float | None = None

    def decoded(self, seconds: float) -> None:
        """A decode step took ``seconds``."""
        self.decode_seconds = _mean(self.decode_seconds, seconds)

    def prefilled(self, tokens: int, seconds: float) -> None:
        """An interleaved chunk of ``tokens`` prompt tokens (in all, over the prompts it served) took ``seconds``."""
        if tokens > 0:
            self.token_seconds = _mean(self.token_seconds, seconds / tokens)

    def size(self) -> int:
        """Tokens of the next chunk: the last size until both costs have been measured, then what takes
        :attr:`share` of a decode step (at least 1, at most :data:`GROWTH` times the last)."""
        if self.decode_seconds is not None and self.token_seconds:
            fit = int(self.share * self.decode_seconds / self.token_seconds)
            self.tokens = max(1, min(fit, int(GROWTH * self.tokens)))
        return self.tokens


def _mean(mean: float | None, value: float) -> float:
    return value if mean is None else (1 - WEIGHT) * mean + WEIGHT * value
