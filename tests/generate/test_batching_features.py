"""Continuous batching's sharing of cache rows and its log probabilities, over a real ONNX Runtime engine (the tiny
preset, static cache): rows copied between sequences and to and from the host, a prefill after cached rows equal
to one prefill, prefix-cache hits equal to misses, chunked prefill (fixed and time-budgeted chunks) equal to one
call, ``n`` choices sharing a prefill, and log probabilities equal to a log-softmax of the engine's own logits."""

from __future__ import annotations

import numpy as np
import pytest

from artifacts import tiny_artifact
from mla_deploy.errors import InputError
from mla_deploy.generate import ContinuousBatcher, SamplingConfig, generate_tokens
from mla_deploy.generate.chunk_budget import FIRST_CHUNK
from mla_deploy.generate.logprobs import log_softmax, top_tokens
from mla_deploy.ort.engine import OrtEngine

#: 40 tokens: two whole blocks of the prefix cache (16 each) and a rest
LONG = [int(i) for i in np.random.default_rng(0).integers(3, 60, 40)]


@pytest.fixture(scope="module")
def engine():
    return OrtEngine(tiny_artifact("static"), threads=1)


def run(batcher, prompt, new, **kw):
    events = []
    ticket = batcher.submit(prompt, new, on_event=events.append, **kw)
    while not batcher.idle:
        batcher.step()
    return ticket, events


def reference_logprobs(engine, ids):
    """log-softmax of the engine's logits at every position of ``ids`` run as one prefill (``Engine.forward``)."""
    state = engine.new_state(1)
    logits = engine.forward("prefill", np.array([ids]), np.arange(len(ids))[None], state)["logits"][0]
    return log_softmax(logits)


def test_rows_are_copied_between_sequences_and_through_the_host(engine):
    state = engine.new_state(4, rows=48)
    engine.prefill(np.array([LONG[:20]]), np.array([20]), engine.rows(state, 0, 1))
    engine.copy_rows(state, 0, [2, 3], 20)
    rows = engine.read_rows(state, 0, 0, 20)
    assert rows.shape == (engine.config.num_hidden_layers, 20, engine.config.latent_dim)
    np.testing.assert_array_equal(engine.read_rows(state, 3, 0, 20), rows)
    engine.write_rows(state, 1, 0, rows[:, :16])
    engine.prefill(np.array([LONG[16:20]]), np.array([4]), engine.rows(state, 1, 2))  # the rest, after 16 rows
    assert state.lengths.tolist() == [20, 20, 20, 20]
    logits = engine.to_host(engine.decode(np.array([7, 7, 7, 7]), engine.rows(state, 0, 4)))
    for row in (1, 2, 3):
        np.testing.assert_allclose(logits[row], logits[0], atol=1e-5, rtol=0)
    with pytest.raises(InputError, match="outside a row"):
        engine.read_rows(state, 0, 0, 49)


def test_a_prefill_after_cached_rows_equals_one_prefill(engine):
    whole = engine.new_state(1, rows=48)
    one = engine.to_host(engine.prefill(np.array([LONG]), np.array([40]), whole))
    parts = engine.new_state(1, rows=48)
    engine.prefill(np.array([LONG[:32]]), np.array([32]), parts)
    rest = engine.to_host(engine.prefill(np.array([LONG[32:]]), np.array([8]), parts))
    np.testing.assert_allclose(rest, one, atol=1e-5, rtol=0)
    every = engine.new_state(1, rows=48)
    all_logits = engine.prefill(np.array([LONG]), np.array([40]), every, every=True)
    np.testing.assert_allclose(log_softmax(all_logits[0]), reference_logprobs(engine, LONG), atol=1e-5, rtol=0)


def test_a_prefix_hit_gives_the_tokens_and_logprobs_of_a_miss(engine):
    batcher = ContinuousBatcher(engine, max_batch=2, capacity=56, prefix_cache_bytes=1 << 20)
    miss, miss_events = run(batcher, LONG, 8, top_logprobs=5)
    hit, hit_events = run(batcher, LONG, 8, top_logprobs=5)
    stats = batcher.prefix.stats
    assert hit.reused == 32 and miss.reused == 0 and stats.hits == 32 and stats.hit_requests == 1
    assert stats.blocks == 2 and stats.bytes == 2 * 16 * engine.config.num_hidden_layers * engine.config.latent_dim * 4
    assert hit.tokens == miss.tokens == generate_tokens(engine, [LONG], 8).tokens[0]
    for a, b in zip(miss_events, hit_events):
        assert abs(a.logprob.logprob - b.logprob.logprob) < 1e-5
        assert [t for t, _ in a.logprob.top] == [t for t, _ in b.logprob.top]
        np.testing.assert_allclose([v for _, v in a.logprob.top], [v for _, v in b.logprob.top], atol=1e-5, rtol=0)
    assert batcher.stats.prefill_tokens == 40 + 8  # the hit prefilled only its rest


def test_a_prefix_cache_over_its_budget_evicts_the_least_recent_blocks(engine):
    block = 16 * engine.config.num_hidden_layers * engine.config.latent_dim * 4
    batcher = ContinuousBatcher(engine, max_batch=1, capacity=56, prefix_cache_bytes=3 * block)
    run(batcher, LONG, 2)
    run(batcher, LONG[::-1], 2)  # two more blocks: one evicted, the first prompt's tail
    stats = batcher.prefix.stats
    assert stats.blocks == 3 and stats.evicted == 1 and stats.bytes == 3 * block
    hit, _ = run(batcher, LONG, 2)
    assert hit.reused == 16


def test_chunked_prefill_gives_the_tokens_of_one_call_and_lets_running_streams_decode(engine):
    alone = generate_tokens(engine, [LONG], 6).tokens[0]
    batcher = ContinuousBatcher(engine, max_batch=2, capacity=56, prefill_chunk=7)
    running = []
    batcher.submit([5, 6, 7], 12, on_event=running.append)
    batcher.step()  # the short prompt: prefilled and decoding
    long_events = []
    batcher.submit(LONG, 6, on_event=long_events.append)
    steps = 0
    while not long_events:
        batcher.step()
        steps += 1
    assert steps == 6  # 40 tokens in chunks of 7
    assert len(running) >= 6  # a decode step between the chunks
    while not batcher.idle:
        batcher.step()
    assert [e.token for e in long_events] == alone
    assert [e.token for e in running] == generate_tokens(engine, [[5, 6, 7]], 12).tokens[0]


def test_the_time_budgeted_chunk_gives_the_tokens_of_one_call_and_lets_running_streams_decode(engine):
    alone = generate_tokens(engine, [LONG], 6).tokens[0]
    batcher = ContinuousBatcher(engine, max_batch=2, capacity=56, prefill_chunk="auto", prefix_cache_bytes=1 << 20)
    ticket, _ = run(batcher, LONG[::-1], 2)  # nothing decodes: up to IDLE_CHUNK tokens in one call
    assert batcher.stats.prefill_calls == 1 and batcher.stats.chunk_tokens == 40
    running = []
    batcher.submit([5, 6, 7], 12, on_event=running.append)
    batcher.step()  # the short prompt: prefilled and decoding
    long_events, sizes = [], []
    batcher.submit(LONG, 6, on_event=long_events.append)
    while not long_events:
        batcher.step()
        sizes.append(batcher.stats.chunk_tokens)
    budget = batcher.chunk_budget
    assert sizes[0] == FIRST_CHUNK and len(sizes) > 1 and budget.decode_seconds > 0 and budget.token_seconds > 0
    assert len(running) >= len(sizes)  # a decode step between the chunks
    while not batcher.idle:
        batcher.step()
    assert [e.token for e in long_events] == alone
    assert [e.token for e in running] == generate_tokens(engine, [[5, 6, 7]], 12).tokens[0]
    hit, _ = run(batcher, LONG, 6)  # the chunked prompt's blocks were kept
    assert hit.reused == 32 and hit.tokens == alone
    with pytest.raises(InputError, match="prefill chunk"):
        ContinuousBatcher(engine, max_batch=1, capacity=56, prefill_chunk="fast")


def test_n_choices_share_one_prefill(engine):
    batcher = ContinuousBatcher(engine, max_batch=4, capacity=56)
    events = [[] for _ in range(3)]
    greedy = batcher.submit_choices(LONG[:10], 8, [SamplingConfig()] * 3, (), [e.append for e in events])
    while not batcher.idle:
        batcher.step()
    assert greedy[0].tokens == greedy[1].tokens == greedy[2].tokens == generate_tokens(engine, [LONG[:10]], 8).tokens[0]
    assert batcher.stats.prefill_calls == 1 and batcher.stats.prompt_tokens == 10 and batcher.stats.admitted == 3
    sampling = SamplingConfig(temperature=1.0, seed=11)
    configs = [sampling.choice(i) for i in range(4)]

    def sampled():
        tickets = batcher.submit_choices(LONG[:10], 8, configs, (), [lambda e: None] * 4)
        while not batcher.idle:
            batcher.step()
        return [t.tokens for t in tickets]

    first = sampled()
    assert sampled() == first and len({tuple(t) for t in first}) > 1
    assert first[0] == generate_tokens(engine, [LONG[:10]], 8, sampling).tokens[0]  # choice 0: the request's seed
    with pytest.raises(InputError, match="n = 5 choices"):
        batcher.submit_choices(LONG[:10], 8, [SamplingConfig()] * 5, (), [lambda e: None] * 5)


def test_logprobs_are_the_log_softmax_of_the_engines_logits(engine):
    batcher = ContinuousBatcher(engine, max_batch=2, capacity=56, prefill_chunk=9)
    ticket, events = run(batcher, LONG[:20], 6, top_logprobs=4, prompt_logprobs=True)
    reference = reference_logprobs(engine, LONG[:20] + ticket.tokens[:-1])
    for i, event in enumerate(events):
        expected = reference[19 + i]
        assert event.logprob.token == ticket.tokens[i]
        assert abs(event.logprob.logprob - expected[ticket.tokens[i]]) < 1e-5
        top = [t for t, _ in event.logprob.top]
        assert top == top_tokens(expected, 4).tolist() and top[0] == ticket.tokens[i]  # greedy: the most likely
        assert all(a[1] >= b[1] for a, b in zip(event.logprob.top, event.logprob.top[1:]))
    prompt = events[0].prompt_logprobs
    assert len(prompt) == 19 and all(e.token == t for e, t in zip(prompt, LONG[1:20]))
    np.testing.assert_allclose([e.logprob for e in prompt], [reference[p, LONG[p + 1]] for p in range(19)],
                               atol=1e-5, rtol=0)
    assert events[1].prompt_logprobs is None


def test_choices_cancelled_while_their_prompt_is_prefilled(engine):
    batcher = ContinuousBatcher(engine, max_batch=3, capacity=56, prefill_chunk=8)
    events = [[] for _ in range(2)]
    both = batcher.submit_choices(LONG, 4, [SamplingConfig()] * 2, (), [e.append for e in events])
    batcher.step()  # admitted, its first chunk prefilled
    assert batcher.stats.active == 2 and not events[0]
    both[1].cancel()
    batcher.step()  # one choice left: the prefill goes on
    assert batcher.stats.active == 2 and not events[1]
    both[0].cancel()
    batcher.step()
    assert batcher.idle and [e[-1].finished for e in events] == ["cancelled", "cancelled"]
    assert batcher.state.lengths.tolist() == [0, 0, 0]
    ticket, _ = run(batcher, LONG, 4)  # the rows serve the next request as before
    assert ticket.tokens == generate_tokens(engine, [LONG], 4).tokens[0]
