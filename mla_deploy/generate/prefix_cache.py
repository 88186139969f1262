"""A prefix cache: the latent cache rows of prompts already prefilled, kept in host memory, so that a prompt sharing a
prefix with one of them (a system prompt, a few-shot block, a chat's earlier turns) starts from a copy of those rows
and prefills only the rest.

Prompts are cut into blocks of :data:`BLOCK` tokens. A block is stored under the digest of its tokens and of every
token before it (a chain of hashes, as vLLM's prefix caching keys its blocks), so a lookup walks the prompt's blocks
from the first and stops at the first one not held: the longest stored prefix, in whole blocks. A block holds its
rows of every layer, ``[layers, BLOCK, C]`` (576 numbers per token per layer for DeepSeek's shapes: MLA's latent is
what makes keeping them cheap; with DeepSeek Sparse Attention each layer's index keys follow its latent row, 704). The blocks are bounded by a byte budget and evicted least recently used first;
a chain's later blocks are always less recent than its earlier ones, so eviction takes a prefix's tail first.

:class:`PrefixCache` knows nothing of engines: the batcher reads rows out of its cache and writes them back
(:meth:`~mla_deploy.generate.engine.BatchingEngine.read_rows`, ``write_rows``). It runs on the batcher's thread;
its counters (:class:`PrefixStats`) may be read from any.
"""

from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

#: tokens per block: the granularity of a prefix hit
BLOCK = 16


@dataclass
class PrefixStats:
    """Counters of a :class:`PrefixCache`.

    Attributes:
        queries: prompt tokens looked up. hits: of them, tokens found (rows reused instead of prefilled).
        hit_requests: lookups that found at least one block. bytes, blocks: held now. evicted: blocks evicted.
        budget: the byte budget.
    """

    budget: int
    queries: int = 0
    hits: int = 0
    hit_requests: int = 0
    bytes: int = 0
    blocks: int = 0
    evicted: int = 0


class PrefixCache:
    """Stored prompt blocks (see the module docstring).

    Args:
        budget: the most bytes of cache rows held (> 0).
        block: tokens per block.
    """

    def __init__(self, budget: int, block: int = BLOCK):
        assert budget > 0 and block > 0
        self.block = int(block)
        self.stats = PrefixStats(int(budget))
        self._blocks: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()

    def keys(self, prompt: Sequence[int], tokens: int) -> list[bytes]:
        """The keys of the whole blocks among the first ``tokens`` of ``prompt``."""
        ids = np.asarray(prompt[:tokens], dtype=np.int64)
        keys, parent = [], b""
        for start in range(0, len(ids) - self.block + 1, self.block):
            parent = hashlib.blake2b(parent + ids[start: start + self.block].tobytes(), digest_size=16).digest()
            keys.append(parent)
        return keys

    def lookup(self, prompt: Sequence[int]) -> tuple[int, np.ndarray | None]:
        """The longest stored prefix of ``prompt`` that leaves at least its last token to prefill (whose logits the
        first new token is chosen from): ``(tokens, rows [layers, tokens, C])``, or ``(0, None)``."""
        self.stats.queries += len(prompt)
        found = []
        for key in self.keys(prompt, len(prompt) - 1):
            if key not in self._blocks:
                break
            found.append(key)
        if not found:
            return 0, None
        self._touch(found)
        self.stats.hits += len(found) * self.block
        self.stats.hit_requests += 1
        return len(found) * self.block, np.concatenate([self._blocks[k] for k in found], axis=1)

    def store(self, prompt: Sequence[int], tokens: int, read: Callable[[int, int], np.ndarray]) -> None:
        """Keep the whole blocks among the first ``tokens`` of ``prompt`` that are not held yet; ``read(start, stop)``
        returns their rows ``[layers, stop - start, C]`` (read once, for the blocks missing)."""
        keys = self.keys(prompt, tokens)
        missing = [i for i, key in enumerate(keys) if key not in self._blocks]
        if missing:
            first = missing[0]  # the chain's blocks past the first missing one are missing too, bar evicted tails
            rows = read(first * self.block, len(keys) * self.block)
            for i in range(first, len(keys)):
                if keys[i] not in self._blocks:
                    part = rows[:, (i - first) * self.block: (i - first + 1) * self.block]
                    self._add(keys[i], np.ascontiguousarray(part))
        self._touch([k for k in keys if k in self._blocks])
        self._evict()

    def _add(self, key: bytes, rows: np.ndarray) -> None:
        self._blocks[key] = rows
        self.stats.bytes += rows.nbytes
        self.stats.blocks += 1

    def _touch(self, chain: list[bytes]) -> None:
        """Mark a chain's blocks used, its first block the most recent (its tail is evicted before its head)."""
        for key in reversed(chain):
            self._blocks.move_to_end(key)

    def _evict(self) -> None:
        while self._blocks and self.stats.bytes > self.stats.budget:
            _, rows = self._blocks.popitem(last=False)
            self.stats.bytes -= rows.nbytes
            self.stats.blocks -= 1
            self.stats.evicted += 1
