"""Structured outputs and tool calls through `mla-deploy serve`, over real HTTP with the official `openai` client, on
the transformers-written tiny checkpoint (random weights, the tests' byte-level BPE and its chat template):
``response_format`` (``json_object``, ``json_schema``) replies parse and validate across seeds, greedy and sampled;
a constrained request and a free one share decode steps and the free one keeps its solo tokens; forced tool calls
(``required``, a named function) round-trip with a tool result, streamed and not; bad schemas and tools get a
one-line 400. The ``auto`` reading of calls is tested on text (a random model rarely writes one)."""

from __future__ import annotations

import json
import threading

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("transformers")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from serving import PROMPTS, Server  # noqa: E402

#: every value bounded, so that a random model's reply ends within the row at any temperature
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "active"],
    "additionalProperties": False,
}
#: tools small enough that a conversation with a call and its result fits the row (the tests' tokenizer spends about
#: a token per character)
WEATHER = {"type": "function", "function": {
    "name": "weather", "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}},
                                      "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 3}},
                                   "required": ["zone"], "additionalProperties": False}}}
USER = [{"role": "user", "content": "Hello world"}]


@pytest.fixture(scope="module")
def artifact():
    """The serving tests' checkpoint with rows of 512 tokens: a conversation with tools, a call and its result."""
    from artifacts import text_artifact

    return text_artifact("static", 512)


@pytest.fixture(scope="module")
def server(artifact):
    running = Server(artifact, "--max-batch", "4", "--max-queue", "64")
    yield running
    assert running.stop() == 0


def _schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_json_schema_replies_validate_across_seeds_greedy_and_sampled(server):
    client = server.client()
    results = []

    def ask(seed, temperature):
        reply = client.chat.completions.create(model=server.model, messages=USER, temperature=temperature,
                                               seed=seed, response_format=_schema_format(PERSON))
        results.append((seed, temperature, reply.choices[0]))

    threads = [threading.Thread(target=ask, args=(seed, t)) for seed in range(12) for t in (0.7, 1.3)]
    threads.append(threading.Thread(target=ask, args=(None, 0)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == len(threads)
    texts = set()
    for seed, temperature, choice in results:
        assert choice.finish_reason == "stop", (seed, temperature, choice)
        value = json.loads(choice.message.content)
        jsonschema.validate(value, PERSON)
        assert "\ufffd" not in choice.message.content  # UTF-8 throughout
        texts.add(choice.message.content)
    assert len(texts) > 5  # sampled replies differ: the mask restricts the draw, it does not make it
    # the same seed draws the same reply
    again = client.chat.completions.create(model=server.model, messages=USER, temperature=1.3, seed=3,
                                           response_format=_schema_format(PERSON))
    assert again.choices[0].message.content in {c.message.content for s, t, c in results if (s, t) == (3, 1.3)}


def test_json_object_mode_on_both_endpoints_streamed_or_not(server):
    client = server.client()
    ended = 0
    for seed in range(8):
        reply = client.chat.completions.create(model=server.model, messages=USER, temperature=0.8, seed=seed,
                                               response_format={"type": "json_object"}, max_tokens=200)
        choice = reply.choices[0]
        if choice.finish_reason == "stop":  # a random model's object may outgrow max_tokens; one that ended is whole
            assert isinstance(json.loads(choice.message.content), dict)
            ended += 1
        else:
            assert choice.finish_reason == "length" and choice.message.content.startswith("{")
    assert ended >= 2
    streamed = client.chat.completions.create(model=server.model, messages=USER, temperature=0,
                                              response_format=_schema_format(PERSON), stream=True)
    chunks = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    assert chunks[-1].choices[0].finish_reason == "stop"
    completion = client.completions.create(model=server.model, prompt=PROMPTS[2], max_tokens=120, temperature=0.9,
                                           seed=1, extra_body={"response_format": _schema_format(PERSON)})
    assert completion.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(completion.choices[0].text), PERSON)


def test_a_free_request_beside_constrained_ones_keeps_its_solo_tokens(server, alone):
    client = server.client()
    ids = alone.tokenizer.encode(PROMPTS[3])
    text, reason, count = alone(ids, 40)
    free, constrained = [], []

    def run_free():
        reply = client.completions.create(model=server.model, prompt=PROMPTS[3], max_tokens=40, temperature=0)
        free.append(reply.choices[0])

    def run_constrained(seed):
        reply = client.chat.completions.create(model=server.model, messages=USER, temperature=1.0, seed=seed,
                                               response_format=_schema_format(PERSON))
        constrained.append(reply.choices[0])

    threads = [threading.Thread(target=run_constrained, args=(s,)) for s in range(3)]
    threads.append(threading.Thread(target=run_free))
    steps, rows = server.metric("mla_deploy_decode_steps_total"), server.metric("mla_deploy_decode_rows_total")
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert free[0].text == text and free[0].finish_reason == reason
    assert len(constrained) == 3
    for choice in constrained:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    # they shared decode steps: more rows were decoded than steps were run
    steps = server.metric("mla_deploy_decode_steps_total") - steps
    assert server.metric("mla_deploy_decode_rows_total") - rows > steps > 0


def test_refusals_are_one_line_400s(server):
    cases = [
        ({"response_format": _schema_format({"type": "nonsense"})}, "response_format"),
        ({"response_format": _schema_format({"type": "object", "properties": 3})}, "response_format"),
        ({"response_format": _schema_format({"type": "string", "pattern": "("})}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, None),
        ({"tool_choice": "required"}, None),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, None),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "weather"}},
          "response_format": _schema_format(PERSON)}, None),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
          "tool_choice": "required"}, "tools"),
    ]
    for extra, param in cases:
        body = {"model": server.model, "messages": USER, "max_tokens": 4, **extra}
        status, _, reply = server.raw("/v1/chat/completions", json.dumps(body).encode())
        assert status == 400, (extra, status, reply)
        message = reply["error"]["message"]
        assert "\n" not in message and "Traceback" not in message and len(message) < 400, message
        if param is not None:
            assert reply["error"]["param"] == param, (extra, reply)
    bad_messages = [[{"role": "user", "content": "x", "tool_calls": []}, {"role": "tool", "content": "r"}],
                    [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                           "function": {"name": "f", "arguments": {}}}]}]]
    for messages in bad_messages:
        body = {"model": server.model, "messages": messages, "max_tokens": 4}
        status, _, reply = server.raw("/v1/chat/completions", json.dumps(body).encode())
        assert status == 400 and "\n" not in reply["error"]["message"], reply


def _round_trip(client, server, tools, tool_choice, stream):
    """A forced call, its tool result, and the final answer; returns the call (name, parsed arguments)."""
    asked = dict(model=server.model, messages=USER, tools=tools, tool_choice=tool_choice, temperature=0.9, seed=5)
    if tool_choice == "required":  # one call: a random model would not stop adding calls to the list
        asked["parallel_tool_calls"] = False
    if stream:
        chunks = list(client.chat.completions.create(**asked, stream=True))
        calls = {}
        for chunk in chunks:
            for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                entry = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                entry["id"] = delta.id or entry["id"]
                if delta.function is not None:
                    entry["name"] = delta.function.name or entry["name"]
                    entry["arguments"] += delta.function.arguments or ""
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert all(not (c.choices and c.choices[0].delta.content) for c in chunks)
        call = calls[0]
        call_id, name, arguments = call["id"], call["name"], call["arguments"]
    else:
        reply = client.chat.completions.create(**asked)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        call = choice.message.tool_calls[0]
        assert call.type == "function"
        call_id, name, arguments = call.id, call.function.name, call.function.arguments
    assert call_id and call_id.startswith("call_")
    function = next(t["function"] for t in tools if t["function"]["name"] == name)
    jsonschema.validate(json.loads(arguments), function["parameters"])
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function",
                                                               "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"temperature": 21})}]
    final = client.chat.completions.create(model=server.model, messages=history, tools=tools, max_tokens=8,
                                           temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length") and final.usage.prompt_tokens > 0
    if stream:  # the final answer streamed is the same text
        chunks = list(client.chat.completions.create(model=server.model, messages=history, tools=tools,
                                                     max_tokens=8, temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            final.choices[0].message.content
    return name, json.loads(arguments), final


def test_forced_tool_calls_round_trip_streamed_and_not(server):
    client = server.client()
    named = {"type": "function", "function": {"name": "weather"}}
    for stream in (False, True):
        name, arguments, _ = _round_trip(client, server, [TIME, WEATHER], named, stream)
        assert name == "weather" and arguments["city"] in ("Paris", "Tokyo")
        name, arguments, _ = _round_trip(client, server, [TIME, WEATHER], "required", stream)
        assert name in ("weather", "time")
    # the tool result changes the prompt the final answer is generated from
    history = USER + [{"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "weather", "arguments": '{"city":"Paris"}'}}]}]
    one = client.chat.completions.create(model=server.model, tools=[WEATHER], max_tokens=2, temperature=0,
                                         messages=history + [{"role": "tool", "tool_call_id": "call_1",
                                                              "content": "21"}])
    two = client.chat.completions.create(model=server.model, tools=[WEATHER], max_tokens=2, temperature=0,
                                         messages=history + [{"role": "tool", "tool_call_id": "call_1",
                                                              "content": "rain all day long"}])
    assert two.usage.prompt_tokens > one.usage.prompt_tokens


def test_tool_choice_none_and_auto_reply_with_text(server):
    client = server.client()
    for choice in ("none", "auto"):
        reply = client.chat.completions.create(model=server.model, messages=USER, tools=[WEATHER],
                                               tool_choice=choice, max_tokens=6, temperature=0)
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.choices[0].message.tool_calls is None and isinstance(reply.choices[0].message.content, str)
    # streamed, auto's text comes as content deltas (held back only where a call could start)
    asked = dict(model=server.model, messages=USER, tools=[WEATHER], max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**asked, tool_choice="auto")
    chunks = list(client.chat.completions.create(**asked, tool_choice="auto", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    # the tools are in the prompt: it is longer than the same conversation without them
    bare = client.chat.completions.create(model=server.model, messages=USER, max_tokens=1, temperature=0)
    assert reply.usage.prompt_tokens > bare.usage.prompt_tokens + 20


def test_without_the_grammar_library_a_constrained_request_gets_a_one_line_400(artifact, tmp_path):
    # a server whose Python cannot import xgrammar (a package of that name that refuses to load comes first on its
    # path), as where the structured extra is not installed
    (tmp_path / "xgrammar").mkdir()
    (tmp_path / "xgrammar" / "__init__.py").write_text("raise ImportError('No module named xgrammar')\n")
    import os

    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    bare = Server(artifact, "--max-batch", "1", env={"PYTHONPATH": path})
    try:
        client = bare.client()
        for extra in ({"response_format": {"type": "json_object"}},
                      {"tools": [WEATHER], "tool_choice": "required"}):
            with pytest.raises(openai.BadRequestError) as error:
                client.chat.completions.create(model=bare.model, messages=USER, max_tokens=4, **extra)
            message = error.value.body["message"]
            assert "pip install 'mla-deploy[structured]'" in message and "\n" not in message, message
        # free requests, and tools read as text, are served as before
        reply = client.chat.completions.create(model=bare.model, messages=USER, max_tokens=4, tools=[WEATHER])
        assert reply.choices[0].finish_reason in ("stop", "length")
    finally:
        assert bare.stop() == 0


def test_n_choices_each_hold_their_own_grammar_and_carry_log_probabilities(server):
    """``n`` constrained choices share one prefill but each its own grammar state: every one validates; a forced
    call's log probabilities come with its deltas, the same entries streamed as not."""
    client = server.client()
    reply = client.chat.completions.create(model=server.model, messages=USER, n=3, temperature=1.1, seed=11,
                                           response_format=_schema_format(PERSON), logprobs=True, top_logprobs=2)
    assert len(reply.choices) == 3 and reply.usage.prompt_tokens > 0
    texts = []
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        entries = choice.logprobs.content
        assert bytes(b for e in entries for b in e.bytes).decode() == choice.message.content
        assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in entries)
        texts.append(choice.message.content)
    assert len(set(texts)) > 1  # sampled choices are independent
    asked = dict(model=server.model, messages=USER, tools=[WEATHER], temperature=0, logprobs=True,
                 tool_choice={"type": "function", "function": {"name": "weather"}})
    whole = client.chat.completions.create(**asked).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.logprobs.content
    chunks = list(client.chat.completions.create(**asked, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole.logprobs.content]
    assert bytes(b for e in streamed for b in e.bytes).decode() == whole.message.tool_calls[0].function.arguments
