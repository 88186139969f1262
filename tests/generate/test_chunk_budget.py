"""The time-budgeted prefill chunk's sizing (:class:`ChunkBudget`): on costs that grow with a chunk's tokens plus a
fixed part, the size settles where a chunk takes its share of a decode step, grows at most twice per step, and is one token
where even one takes more than the share."""

from __future__ import annotations

import pytest

from mla_deploy.generate.chunk_budget import DECODE_SHARE, FIRST_CHUNK, ChunkBudget


def settle(fixed: float, per_token: float, decode: float, steps: int = 30) -> list[int]:
    """The sizes asked for over ``steps`` steps when a chunk of k tokens takes ``fixed + per_token * k`` seconds and a
    decode step ``decode``."""
    budget, sizes = ChunkBudget(), []
    for _ in range(steps):
        budget.decoded(decode)
        sizes.append(budget.size())
        budget.prefilled(sizes[-1], fixed + per_token * sizes[-1])
    return sizes


@pytest.mark.parametrize("fixed, per_token, decode", [(0.01, 0.005, 0.1), (0.0, 0.002, 0.168), (0.01, 0.001, 0.04)])
def test_the_chunk_settles_where_it_takes_its_share_of_a_decode_step(fixed, per_token, decode):
    sizes = settle(fixed, per_token, decode)
    target = DECODE_SHARE * decode
    assert sizes[0] == FIRST_CHUNK
    assert all(b <= 2 * a for a, b in zip(sizes, sizes[1:]))  # grows at most twice per step
    last = sizes[-1]
    took = fixed + per_token * last
    # within the share, short of it by less than one token's share of the chunk's time
    assert took <= target * 1.001 and target - took <= 1.001 * took / last
    assert len(set(sizes[-5:])) == 1  # settled


def test_a_chunk_is_one_token_where_even_one_takes_more_than_the_share():
    assert settle(0.08, 0.01, 0.1)[-1] == 1


def test_the_first_size_stands_until_both_costs_are_measured():
    budget = ChunkBudget(first=6)
    budget.prefilled(6, 10.0)
    assert budget.size() == 6
    budget.decoded(0.1)
    assert budget.size() == 1
