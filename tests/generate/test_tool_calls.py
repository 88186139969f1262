"""Reading tool calls out of a model's text (mla_deploy/generate/tool_calls.py): DeepSeek-V2.5/V3's and V3.1's tool
tokens and the plain ``<tool_call>`` form, whole and streamed; what is not a well-formed call of a known function
stays content; the conversation prepared for a chat template without tool support; the forced-call schema."""

from __future__ import annotations

import json

import pytest

from mla_deploy.generate.tool_calls import (DS_CALL_BEGIN, DS_CALL_END, DS_CALLS_BEGIN, DS_CALLS_END, DS_SEP,
                                            CallScanner, ToolSyntax, forced_calls, forced_schema, prepare_messages,
                                            tool_syntax)

DEEPSEEK, PLAIN = ToolSyntax("deepseek"), ToolSyntax("plain")
NAMES = ["get_weather", "time"]
V3 = (f"Let me check.{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}get_weather\n```json\n"
      f'{{"city": "Paris"}}\n```{DS_CALL_END}{DS_CALL_BEGIN}function{DS_SEP}time\n```json\n{{"zone": "CET"}}\n```'
      f"{DS_CALL_END}{DS_CALLS_END}")
V31 = f'{DS_CALLS_BEGIN}{DS_CALL_BEGIN}get_weather{DS_SEP}{{"city":"Tokyo"}}{DS_CALL_END}{DS_CALLS_END}'
PLAIN_TEXT = 'Sure.\n<tool_call>{"name": "time", "arguments": {"zone": "UTC"}}</tool_call>'


def test_deepseek_v3_and_v31_calls():
    content, calls = DEEPSEEK.parse(V3, NAMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("time", {"zone": "CET"})]
    content, calls = DEEPSEEK.parse(V31, NAMES)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Tokyo"})]
    # the syntax writes what it reads
    written = DEEPSEEK.write([c.to_openai() for c in DEEPSEEK.parse(V3, NAMES)[1]])
    assert [c.name for c in DEEPSEEK.parse(written, NAMES)[1]] == ["get_weather", "time"]


def test_plain_calls_and_what_stays_content():
    content, calls = PLAIN.parse(PLAIN_TEXT, NAMES)
    assert content == "Sure." and calls[0].name == "time" and json.loads(calls[0].arguments) == {"zone": "UTC"}
    call = calls[0].to_openai()
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "time"
    for text in ["no call here", '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
                 "<tool_call>{not json}</tool_call>", '<tool_call>{"name": "time", "arguments": [1]}</tool_call>',
                 '<tool_call>{"name": "time", "arguments": {"zone": "UTC"}}']:  # unknown, broken, not an object, cut
        assert PLAIN.parse(text, NAMES) == (text, []), text
    assert DEEPSEEK.parse(V3.replace("get_weather", "nope").replace("time", "nope"), NAMES)[1] == []


@pytest.mark.parametrize("syntax,text", [(DEEPSEEK, V3), (PLAIN, PLAIN_TEXT), (PLAIN, "just text, <tool no")])
def test_streamed_text_is_released_unless_a_call_may_start_there(syntax, text):
    whole_content, whole_calls = syntax.parse(text, NAMES)
    for size in (1, 3, 7):
        scanner, sent = CallScanner(syntax, NAMES), ""
        for i in range(0, len(text), size):
            sent += scanner.push(text[i:i + size])
            assert syntax.start not in sent  # never a piece of a call
        rest, calls = scanner.finish()
        assert (sent + rest).rstrip() == whole_content.rstrip() and calls == whole_calls


def test_the_conversation_for_a_template_without_tool_support():
    tools = [{"type": "function", "function": {"name": "time", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "time", "arguments": '{"zone":"UTC"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    out = prepare_messages(messages, tools, PLAIN, renders_tools=False, renders_calls=False)
    assert out[0]["role"] == "system" and '"name":"time"' in out[0]["content"]
    assert PLAIN.parse(out[2]["content"], ["time"])[1][0].arguments == '{"zone": "UTC"}'
    assert "tool_calls" in messages[1]  # the caller's messages are left as they were
    same = prepare_messages(messages, tools, PLAIN, renders_tools=True, renders_calls=True)
    assert same == messages
    assert tool_syntax({DS_CALL_BEGIN: 1, DS_SEP: 2}) == DEEPSEEK and tool_syntax({"a": 0}) == PLAIN


def test_forced_schemas_and_their_replies():
    tools = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": {}}}},
             {"type": "function", "function": {"name": "b"}}]
    assert forced_schema(tools, "a", True) == {"type": "object", "properties": {}}
    assert forced_schema(tools, "b", True) == {"type": "object"}
    listed = forced_schema(tools, None, False)
    assert listed["minItems"] == listed["maxItems"] == 1 and len(listed["items"]["anyOf"]) == 2
    assert "maxItems" not in forced_schema(tools, None, True)
    assert forced_calls('{"x":1}', "a")[0].arguments == '{"x":1}'
    calls = forced_calls('[{"name":"b","arguments":{}},{"name":"a","arguments":{"k":2}}]', None)
    assert [(c.name, c.arguments) for c in calls] == [("b", "{}"), ("a", '{"k": 2}')]
    assert forced_calls('{"x":', "a") == []


#: a chat template in DeepSeek-V3's manner (written for this test): the tools in the system turn, an assistant's calls
#: as its tool tokens, tool results in their own turn
DS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>Tools: {{ tools | tojson }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m['tool_calls'] is defined %}<|assistant|>" + DS_CALLS_BEGIN +
    "{% for c in m['tool_calls'] %}" + DS_CALL_BEGIN + "function" + DS_SEP +
    "{{ c['function']['name'] }}\n```json\n{{ c['function']['arguments'] }}\n```" + DS_CALL_END +
    "{% endfor %}" + DS_CALLS_END + "{{ eos_token }}"
    "{% elif m['role'] == 'tool' %}<|tool|>{{ m['content'] }}"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_a_template_with_tool_tokens_renders_tools_and_calls_and_the_reply_keeps_them(tmp_path):
    pytest.importorskip("transformers")
    from hf_oracle import hf_tokenizer
    from mla_deploy.generate.tokenizer import ArtifactTokenizer

    tok = hf_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END,
                                                          DS_SEP]})
    tok.chat_template = DS_TEMPLATE
    tok.save_pretrained(tmp_path)
    tokenizer = ArtifactTokenizer(tmp_path)
    syntax = tool_syntax(tokenizer.backend.get_vocab(with_added_tokens=True))
    assert syntax == DEEPSEEK and tokenizer.template_reads("tools")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21"}]
    prepared = prepare_messages(messages, tools, syntax, renders_tools=True,
                                renders_calls="tool_calls" in tokenizer.chat_template)
    assert prepared == messages  # the template renders both itself
    text = tokenizer.render_chat(prepared, tools=tools)
    assert '"get_weather"' in text.split("<|user|>")[0] and DS_CALL_BEGIN in text
    ids = tokenizer.chat_ids(prepared, tools=tools)
    assert tokenizer.backend.token_to_id(DS_CALL_BEGIN) in ids  # one special token, not its characters
    # a reply in the tool tokens: dropped by the plain detokenizer, kept (and read back) by the one that keeps them
    reply = tokenizer.encode("Sure." + V3.split("Let me check.")[1], add_special_tokens=False)
    plain, kept = tokenizer.detokenizer(), tokenizer.detokenizer(skip_special_tokens=False)
    assert DS_CALL_BEGIN not in "".join(plain.push(i) for i in reply) + plain.flush()
    content, calls = DEEPSEEK.parse("".join(kept.push(i) for i in reply) + kept.flush(), NAMES)
    assert content == "Sure." and [c.name for c in calls] == ["get_weather", "time"]
