"""What applications send beyond plain text, through real HTTP with the official `openai` client on a real server
process (issue 51): log probabilities equal to a log-softmax of the engine's own logits for the same tokens (chat
and completions, streamed and not, the prompt's own with `echo`), `n` choices sharing one prefill (greedy equal,
seeded sampled reproducible and not all equal, the prompt counted once), a prefix-cache hit equal to a miss, a
prompt prefilled in chunks equal to one call, and the /metrics counters of both."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("transformers")

from serving import PROMPTS, Server  # noqa: E402

from mla_deploy.generate.logprobs import log_softmax  # noqa: E402
from mla_deploy.ort.engine import OrtEngine  # noqa: E402

#: a system prompt of about 90 tokens, longer than the chunk: the prefix cache keeps its blocks
SYSTEM = "Multi-head latent attention keeps the cache small. " * 3
CHUNK = 16


@pytest.fixture(scope="module")
def server(artifact):
    running = Server(artifact, "--max-batch", "4", "--max-queue", "16", "--prefill-chunk", str(CHUNK),
                     "--prefix-cache-mb", "8")
    yield running
    assert running.stop() == 0


@pytest.fixture(scope="module")
def engine(artifact):
    return OrtEngine(artifact, threads=1)


def greedy_reference(engine, ids: list[int], new: int, eos=()) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Greedy tokens of ``ids`` through the engine's own prefill and decode, the log-softmax of the logits each was
    chosen from ``[new, V]``, and of every prompt position ``[len(ids), V]`` (the reference of `echo`)."""
    state = engine.new_state(1, rows=len(ids) + new)
    every = engine.prefill(np.array([ids]), np.array([len(ids)]), engine.new_state(1, rows=len(ids)), every=True)
    logits = engine.to_host(engine.prefill(np.array([ids]), np.array([len(ids)]), state))
    tokens, steps = [], []
    for _ in range(new):
        steps.append(log_softmax(logits[0]))
        tokens.append(int(np.argmax(logits[0])))
        if tokens[-1] in eos:
            break
        logits = engine.to_host(engine.decode(np.array(tokens[-1:]), state))
    return tokens, np.array(steps), log_softmax(every[0])


def check_chat_content(content, tokens, steps, tokenizer):
    assert len(content) == len(tokens)
    # the entries' bytes are the tokens' own: joined, they are the text the tokenizer decodes
    joined = b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace")
    assert joined == tokenizer.decode(tokens, skip_special_tokens=False)
    for entry, token, expected in zip(content, tokens, steps):
        assert bytes(entry.bytes) == tokenizer.token_bytes(token)
        assert abs(entry.logprob - expected[token]) < 1e-5
        top = entry.top_logprobs
        assert len(top) == 5 and top[0].bytes == entry.bytes and top[0].logprob == entry.logprob  # greedy: the top
        assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:]))
        assert sorted(expected, reverse=True)[4] == pytest.approx(top[4].logprob, abs=1e-5)


def test_chat_logprobs_are_the_log_softmax_of_the_engines_logits(server, engine, alone):
    client, tokenizer = server.client(), alone.tokenizer
    messages = [{"role": "user", "content": PROMPTS[1]}]
    tokens, steps, _ = greedy_reference(engine, tokenizer.chat_ids(messages), 10, tokenizer.eos_ids)
    reply = client.chat.completions.create(model=server.model, messages=messages, max_tokens=10, temperature=0,
                                           logprobs=True, top_logprobs=5)
    check_chat_content(reply.choices[0].logprobs.content, tokens, steps, tokenizer)
    chunks = list(client.chat.completions.create(model=server.model, messages=messages, max_tokens=10,
                                                 temperature=0, logprobs=True, top_logprobs=5, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in reply.choices[0].logprobs.content]
    plain = client.chat.completions.create(model=server.model, messages=messages, max_tokens=10, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == reply.choices[0].message.content


def test_completion_logprobs_and_echo(server, engine, alone):
    client, tokenizer = server.client(), alone.tokenizer
    prompt = PROMPTS[2]
    ids = tokenizer.encode(prompt)
    tokens, steps, every = greedy_reference(engine, ids, 8, tokenizer.eos_ids)
    reply = client.completions.create(model=server.model, prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    logprobs = reply.choices[0].logprobs
    assert logprobs.token_logprobs == pytest.approx([s[t] for s, t in zip(steps, tokens)], abs=1e-5)
    assert [len(top) for top in logprobs.top_logprobs] == [3] * len(tokens)
    text = reply.choices[0].text
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    assert len(logprobs.tokens) == len(tokens) and logprobs.text_offset[-1] <= len(text)
    echoed = client.completions.create(model=server.model, prompt=prompt, max_tokens=8, temperature=0, logprobs=3,
                                       echo=True)
    assert echoed.choices[0].text == prompt + text
    got = echoed.choices[0].logprobs
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None and len(got.tokens) == len(ids) + len(tokens)
    assert got.token_logprobs[1: len(ids)] == pytest.approx([every[p, ids[p + 1]] for p in range(len(ids) - 1)],
                                                            abs=1e-5)
    assert got.token_logprobs[len(ids):] == pytest.approx(logprobs.token_logprobs, abs=1e-5)
    assert got.text_offset[len(ids):] == [len(prompt) + o for o in logprobs.text_offset]
    plain = client.completions.create(model=server.model, prompt=[ids], max_tokens=4, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(tokenizer.decode(ids)) and plain.choices[0].logprobs is None
    chunks = list(client.completions.create(model=server.model, prompt=prompt, max_tokens=8, temperature=0,
                                            logprobs=3, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == prompt + text
    assert [v for c in chunks for v in c.choices[0].logprobs.token_logprobs] == got.token_logprobs


def test_n_choices(server, alone):
    client, tokenizer = server.client(), alone.tokenizer
    ids = tokenizer.encode(PROMPTS[3])
    text, _, count = alone(ids, 9)
    greedy = client.completions.create(model=server.model, prompt=PROMPTS[3], max_tokens=9, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2] and {c.text for c in greedy.choices} == {text}
    assert greedy.usage.prompt_tokens == len(ids) and greedy.usage.completion_tokens == 3 * count
    messages = [{"role": "user", "content": PROMPTS[0]}]

    def sampled(**kw):
        reply = client.chat.completions.create(model=server.model, messages=messages, max_tokens=12, temperature=1.0,
                                               seed=7, n=4, **kw)
        return [c.message.content for c in reply.choices]

    first = sampled()
    assert sampled() == first and len(set(first)) > 1
    chunks = list(client.chat.completions.create(model=server.model, messages=messages, max_tokens=12,
                                                 temperature=1.0, seed=7, n=4, stream=True,
                                                 stream_options={"include_usage": True}))
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(4)]
    assert streamed == first and chunks[-1].usage.prompt_tokens == len(tokenizer.chat_ids(messages))
    two = client.completions.create(model=server.model, prompt=[PROMPTS[3], PROMPTS[4]], max_tokens=5,
                                    temperature=0, n=2)
    assert [c.index for c in two.choices] == [0, 1, 2, 3] and two.choices[0].text == two.choices[1].text
    assert two.usage.prompt_tokens == len(ids) + len(tokenizer.encode(PROMPTS[4]))


def test_a_prefix_hit_equals_a_miss_and_is_counted(server, alone):
    client = server.client()
    before = {name: server.metric(name) for name in ("mla_deploy_prefix_cache_hits_total",
                                                     "mla_deploy_prefix_cache_hit_requests_total")}
    replies = []
    for question in ("What is MLA?", "What is MLA?", "And the cache?"):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        replies.append(client.chat.completions.create(model=server.model, messages=messages, max_tokens=8,
                                                      temperature=0, logprobs=True, top_logprobs=5))
    miss, hit = replies[0].choices[0], replies[1].choices[0]
    assert hit.message.content == miss.message.content
    for a, b in zip(miss.logprobs.content, hit.logprobs.content):
        assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-5
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
        assert [t.logprob for t in a.top_logprobs] == pytest.approx([t.logprob for t in b.top_logprobs], abs=1e-5)
    prompt = len(alone.tokenizer.chat_ids([{"role": "system", "content": SYSTEM},
                                           {"role": "user", "content": "What is MLA?"}]))
    hits = server.metric("mla_deploy_prefix_cache_hits_total") - before["mla_deploy_prefix_cache_hits_total"]
    assert hits >= 2 * ((prompt - 1) // 16 * 16) - 16  # the repeat and the other question share the system prompt
    assert server.metric("mla_deploy_prefix_cache_hit_requests_total") - \
        before["mla_deploy_prefix_cache_hit_requests_total"] == 2
    assert server.metric("mla_deploy_prefix_cache_bytes") > 0
    assert 0 < server.metric("mla_deploy_cache_hit_rate") <= 1


def test_a_prompt_prefilled_in_chunks_equals_one_call(server, alone):
    client, tokenizer = server.client(), alone.tokenizer
    prompt = "The quick brown fox jumps over the lazy dog. " * 5 + "你好"
    ids = tokenizer.encode(prompt)
    assert len(ids) > 4 * CHUNK
    text, reason, _ = alone(ids, 10)  # one prefill call in this process
    calls = server.metric("mla_deploy_prefill_calls_total")
    reply = client.completions.create(model=server.model, prompt=prompt, max_tokens=10, temperature=0)
    assert reply.choices[0].text == text and reply.choices[0].finish_reason == reason
    assert server.metric("mla_deploy_prefill_calls_total") - calls >= -(-len(ids) // CHUNK)
    assert 0 < server.metric("mla_deploy_prefill_chunk_tokens") <= CHUNK


def test_what_is_still_refused(server):
    for body, message in [({"prompt": "hi", "best_of": 2}, "best_of"),
                          ({"prompt": "hi", "n": 5}, "(--max-batch)")]:
        status, _, reply = server.raw("/v1/completions", json.dumps({"model": server.model, **body}).encode(),
                                      method="POST")
        assert status == 400 and message in reply["error"]["message"], reply
