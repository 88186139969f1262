"""Continuous batching over a real ONNX Runtime engine (the tiny preset, static cache): sequences that join and
leave one running batch get exactly the tokens they get alone; rows are reused; cancellation, a full queue and
requests that cannot fit are refused or ended as documented."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from artifacts import tiny_artifact
from mla_deploy.ort.engine import OrtEngine
from mla_deploy.errors import BusyError, CacheCapacityError, InputError
from mla_deploy.generate import ContinuousBatcher, SamplingConfig, generate_tokens

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15], [3], [60, 61, 62], [5, 4, 3, 2, 1, 0]]
NEW = [9, 4, 7, 12, 3, 8]


@pytest.fixture(scope="module")
def engine():
    return OrtEngine(tiny_artifact("static"), threads=1)


def collect(batcher, prompt, new, sampling=None, eos=()):
    events = []
    ticket = batcher.submit(prompt, new, sampling, eos, events.append)
    return ticket, events


def drain(batcher):
    while not batcher.idle:
        batcher.step()


def test_rows_are_views_that_prefill_and_decode_in_place(engine):
    state = engine.new_state(3)
    engine.prefill(np.array([[7, 8, 9]]), np.array([3]), engine.rows(state, 1, 2))
    assert state.lengths.tolist() == [0, 3, 0]
    engine.decode(np.array([1, 2]), engine.rows(state, 1, 3))
    assert state.lengths.tolist() == [0, 4, 1]
    engine.clear(state, 1)
    assert state.lengths.tolist() == [0, 0, 1]
    with pytest.raises(InputError):
        engine.rows(state, 2, 4)


def test_sequences_joining_and_leaving_get_their_solo_tokens(engine):
    solo = [generate_tokens(engine, [p], n).tokens[0] for p, n in zip(PROMPTS, NEW)]
    batcher = ContinuousBatcher(engine, max_batch=3)
    runs = [collect(batcher, p, n) for p, n in zip(PROMPTS[:4], NEW[:4])]
    batcher.step()  # three admitted, one waits for a row
    assert batcher.stats.active == 3 and batcher.stats.waiting == 1
    for _ in range(3):
        batcher.step()
    runs += [collect(batcher, p, n) for p, n in zip(PROMPTS[4:], NEW[4:])]  # join a running batch
    drain(batcher)
    for (ticket, events), tokens, new in zip(runs, solo, NEW):
        assert ticket.tokens == tokens and [e.token for e in events] == tokens
        assert [e.finished for e in events] == [None] * (new - 1) + ["length"]
    stats = batcher.stats
    assert stats.admitted == 6 and stats.finished["length"] == 6 and stats.active == 0
    assert stats.generated_tokens == sum(NEW) and 0 < stats.decode_rows <= 3 * stats.decode_steps
    assert batcher.state.lengths.tolist() == [0, 0, 0]  # every row freed


def test_eos_sampling_and_cancellation(engine):
    solo = generate_tokens(engine, [PROMPTS[0]], 9).tokens[0]
    batcher = ContinuousBatcher(engine, max_batch=2)
    eos_run = collect(batcher, PROMPTS[0], 9, eos=[solo[2]])
    sampled = collect(batcher, PROMPTS[1], 6, SamplingConfig(temperature=0.8, seed=3))
    batcher.step()
    cancelled = collect(batcher, PROMPTS[2], 20)
    batcher.step()
    batcher.step()
    cancelled[0].cancel()
    drain(batcher)
    assert eos_run[0].tokens == solo[: solo.index(solo[2]) + 1] and eos_run[1][-1].finished == "eos"
    alone = generate_tokens(engine, [PROMPTS[1]], 6, SamplingConfig(temperature=0.8, seed=3)).tokens[0]
    assert sampled[0].tokens == alone  # its own generator: the draws of the same seed alone
    assert cancelled[1][-1].token is None and cancelled[1][-1].finished == "cancelled"
    assert 0 < len(cancelled[0].tokens) < 20 and batcher.stats.finished["cancelled"] == 1


def test_refusals(engine):
    with pytest.raises(InputError, match="exceeds the artifact's cache capacity 64"):
        ContinuousBatcher(engine, max_batch=1, capacity=65)
    batcher = ContinuousBatcher(engine, max_batch=1, capacity=16, max_queue=1)
    assert batcher.room(10) == 7 and batcher.room(17) == 0
    with pytest.raises(CacheCapacityError, match="capacity 16"):
        batcher.submit([1] * 10, 8)
    with pytest.raises(InputError, match="outside the vocabulary"):
        batcher.submit([1, 999], 2)
    with pytest.raises(InputError, match="max_new_tokens"):
        batcher.submit([1], 0)
    batcher.submit([1, 2], 4)
    with pytest.raises(BusyError, match="already waiting"):
        batcher.submit([1, 2], 4)
    batcher.close()
    with pytest.raises(BusyError, match="shutting down"):
        batcher.submit([1, 2], 4)
    batcher.run()  # finishes the queued request, then returns: closed and idle
    assert batcher.stats.finished["length"] == 1


def test_a_concat_cache_has_no_rows_to_batch_in():
    with pytest.raises(CacheCapacityError, match="--cache-mode static"):
        ContinuousBatcher(OrtEngine(tiny_artifact("concat"), threads=1), max_batch=2)


def test_a_failing_step_ends_the_running_requests_with_an_error_and_serving_goes_on(engine):
    batcher = ContinuousBatcher(engine, max_batch=2)
    thread = threading.Thread(target=batcher.run)

    def broken(event):
        raise RuntimeError("a caller's bug")

    _, bystander = collect(batcher, PROMPTS[0], 5)
    batcher.submit(PROMPTS[1], 5, on_event=broken)
    thread.start()
    deadline = time.time() + 60
    while not batcher.idle and time.time() < deadline:
        time.sleep(0.01)
    _, after = collect(batcher, PROMPTS[2], 4)
    batcher.close()
    thread.join(60)
    assert bystander[-1].finished == "error" and "a caller's bug" in bystander[-1].error
    assert [e.finished for e in after] == [None, None, None, "length"]
