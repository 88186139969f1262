"""Tool calls in a model's text: how a checkpoint writes them, and reading them back.

* :class:`ToolSyntax` and :func:`tool_syntax`: the way a tokenizer's model writes a call. DeepSeek-V2.5/V3/V3.1
  checkpoints have tool tokens (``<｜tool▁calls▁begin｜>`` ...) and write
  ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>`` (V3.1 drops the
  ``function`` and the code fence: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>``); any other
  tokenizer gets the plain-text form ``<tool_call>{"name": NAME, "arguments": ARGS}</tool_call>``.
* :meth:`ToolSyntax.parse`: a whole reply's text into its content and its calls; :class:`CallScanner`: the same
  while text streams in (content is released as soon as it cannot be the start of a call).
* :func:`instructions`: the system text that tells a model its tools, for a chat template that does not render
  ``tools`` itself; :func:`render_calls`: an assistant message's ``tool_calls`` as the syntax writes them, for a
  template that does not render ``tool_calls``.
* :func:`forced_schema`: the JSON schema of the output when a call is forced (``tool_choice`` ``required`` or a
  named function), which the constrained decoding holds the model to; :func:`forced_calls` reads that output.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

#: DeepSeek's tool tokens
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_DS_CALL = re.compile(re.escape(DS_CALL_BEGIN) + r"(?:function" + re.escape(DS_SEP) +
                      r"(?P<name>[^\n]+)\n```json\n(?P<args>.*?)\n```|(?P<name31>.*?)" + re.escape(DS_SEP) +
                      r"(?P<args31>.*?))" + re.escape(DS_CALL_END), re.S)
_PLAIN_CALL = re.compile(r"<tool_call>\s*(?P<body>.*?)\s*</tool_call>", re.S)


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's ``name`` and its ``arguments`` as JSON text; ``id`` as the reply names it."""

    name: str
    arguments: str
    id: str = ""

    def to_openai(self, index: int | None = None) -> dict:
        """OpenAI's ``tool_calls`` entry (with ``index`` for a streamed delta)."""
        out = {"id": self.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class ToolSyntax:
    """How a model writes calls: ``deepseek`` (its tool tokens) or ``plain`` (``<tool_call>`` JSON)."""

    kind: str

    @property
    def start(self) -> str:
        """The text every reply with a call holds where its first call starts."""
        return DS_CALLS_BEGIN if self.kind == "deepseek" else "<tool_call>"

    def parse(self, text: str, names: Sequence[str]) -> tuple[str, list[ToolCall]]:
        """``(content, calls)`` of a reply: the text before the first call, and every well-formed call of a known
        function (``names``). Text without a well-formed call is all content."""
        at = text.find(self.start)
        if at < 0:
            return text, []
        calls = []
        if self.kind == "deepseek":
            for match in _DS_CALL.finditer(text, at):
                name = (match.group("name") or match.group("name31") or "").strip()
                arguments = match.group("args") if match.group("args") is not None else match.group("args31")
                calls += _call(name, arguments, names)
        else:
            for match in _PLAIN_CALL.finditer(text, at):
                try:
                    body = json.loads(match.group("body"))
                except ValueError:
                    continue
                if isinstance(body, dict) and isinstance(body.get("name"), str):
                    arguments = body.get("arguments", body.get("parameters", {}))
                    calls += _call(body["name"], json.dumps(arguments, ensure_ascii=False), names)
        if not calls:
            return text, []
        return text[:at].rstrip(), calls

    def write(self, calls: Sequence[dict]) -> str:
        """OpenAI ``tool_calls`` entries as this syntax writes them (what the model would have written)."""
        if self.kind == "deepseek":
            body = "".join(f"{DS_CALL_BEGIN}function{DS_SEP}{c['function']['name']}\n```json\n"
                           f"{c['function'].get('arguments') or '{}'}\n```{DS_CALL_END}" for c in calls)
            return f"{DS_CALLS_BEGIN}{body}{DS_CALLS_END}"
        return "\n".join("<tool_call>" + json.dumps({"name": c["function"]["name"],
                                                     "arguments": _loads(c["function"].get("arguments"))},
                                                    ensure_ascii=False) + "</tool_call>" for c in calls)


def _loads(arguments) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments if arguments is not None else {}


def _call(name: str, arguments: str | None, names: Sequence[str]) -> list[ToolCall]:
    """The call, when its function is known and its arguments are a JSON object."""
    if name not in names or arguments is None:
        return []
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return []
    if not isinstance(parsed, dict):
        return []
    return [ToolCall(name, json.dumps(parsed, ensure_ascii=False))]


def tool_syntax(vocabulary: dict) -> ToolSyntax:
    """The syntax of a tokenizer's model, by its vocabulary (``{token: id}``, added tokens included)."""
    return ToolSyntax("deepseek" if DS_CALL_BEGIN in vocabulary and DS_SEP in vocabulary else "plain")


class CallScanner:
    """A streamed reply's content, released as it comes unless it may be where a call starts; the rest is held for
    :meth:`finish`, which parses it. ``push(text) -> content to send now``."""

    def __init__(self, syntax: ToolSyntax, names: Sequence[str]):
        self.syntax, self.names = syntax, list(names)
        self.text, self.sent, self.calling = "", 0, False

    def push(self, text: str) -> str:
        self.text += text
        if self.calling:
            return ""
        at = self.text.find(self.syntax.start, self.sent)
        if at >= 0:
            self.calling = True
            return self._release(at)
        return self._release(len(self.text) - _partial(self.text, self.syntax.start))

    def finish(self) -> tuple[str, list[ToolCall]]:
        """``(content not yet sent, calls)``: what the whole text holds past what :meth:`push` released."""
        content, calls = self.syntax.parse(self.text, self.names)
        if calls:
            return content[self.sent:] if len(content) > self.sent else "", calls
        return self.text[self.sent:], []

    def _release(self, end: int) -> str:
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out


def _partial(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (text held back: a call may start there)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def instructions(tools: Sequence[dict], syntax: ToolSyntax) -> str:
    """A system message telling the model its tools and how to call them (for a template without ``tools``)."""
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False, separators=(",", ":")) for t in tools)
    if syntax.kind == "deepseek":
        form = (f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}NAME\n```json\nARGUMENTS\n```{DS_CALL_END}"
                f"{DS_CALLS_END}")
    else:
        form = '<tool_call>{"name":NAME,"arguments":ARGUMENTS}</tool_call>'
    return f"Tools:\n{listed}\nCall one with {form}"


def forced_schema(tools: Sequence[dict], name: str | None, parallel: bool) -> dict:
    """The output's JSON schema when a call is forced: the named function's arguments (its ``parameters``), or, for
    ``required``, a list of ``{"name", "arguments"}`` calls of any of ``tools`` (one only unless ``parallel``)."""
    if name is not None:
        function = next(t["function"] for t in tools if t["function"]["name"] == name)
        return function.get("parameters") or {"type": "object"}
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               "arguments": t["function"].get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return {"type": "array", "items": {"anyOf": calls}, "minItems": 1, **({} if parallel else {"maxItems": 1})}


def forced_calls(text: str, name: str | None) -> list[ToolCall]:
    """The calls of a forced reply (its text held to :func:`forced_schema`); [] when it is cut short (``length``)."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if name is not None:
        return [ToolCall(name, text)]
    return [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in value]


def prepare_messages(messages: Sequence[dict], tools: Sequence[dict] | None, syntax: ToolSyntax,
                     renders_tools: bool, renders_calls: bool) -> list[dict]:
    """The conversation as a chat template that lacks tool support can still carry it: with ``tools`` and a template
    that does not render them (``renders_tools`` false), their :func:`instructions` join the system message (a new
    one first where there is none); with a template that does not render an assistant's ``tool_calls``
    (``renders_calls`` false), they become its content, as the syntax writes them."""
    out = [dict(m) for m in messages]
    if not renders_calls:
        for message in out:
            if message.get("tool_calls"):
                calls = syntax.write(message.pop("tool_calls"))
                message["content"] = f"{message['content']}{calls}" if message.get("content") else calls
    if tools and not renders_tools:
        text = instructions(tools, syntax)
        if out and out[0].get("role") == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{text}" if out[0].get("content") else text
        else:
            out.insert(0, {"role": "system", "content": text})
    return out
