"""A chat reply that may hold tool calls, as OpenAI shapes it: the whole ``message`` with its ``tool_calls`` and
``finish_reason: "tool_calls"``, or the streamed ``delta`` s (``tool_calls: [{"index", "id", "type", "function":
{"name", "arguments"}}]``, the arguments in pieces).

A reply is read one of three ways (:class:`Calls`): not at all (no tools, ``tool_choice: "none"``); as a forced call
(``required`` or a named function), whose whole text is the JSON that constrained decoding held to
:func:`~mla_deploy.generate.tool_calls.forced_schema`; or as free text that may hold calls in the model's syntax
(``auto``), which :class:`~mla_deploy.generate.tool_calls.CallScanner` finds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from ..generate.tool_calls import CallScanner, ToolCall, ToolSyntax, forced_calls


@dataclass(frozen=True)
class Calls:
    """How a reply's text is read: ``syntax`` set for ``auto``; ``forced`` for a forced call (``name``: of which
    function, None for ``required``); neither: plain text."""

    names: list[str] = field(default_factory=list)
    syntax: ToolSyntax | None = None
    forced: bool = False
    name: str | None = None

    def message(self, text: str, reason: str) -> tuple[dict, str]:
        """``(message, finish_reason)`` of a whole reply."""
        calls: list[ToolCall] = []
        content: str | None = text
        if self.forced and reason == "stop":
            content, calls = None, forced_calls(text, self.name)
        elif self.syntax is not None:
            content, calls = self.syntax.parse(text, self.names)
        if not calls:
            return {"role": "assistant", "content": text}, reason
        return ({"role": "assistant", "content": content or None,
                 "tool_calls": [call.to_openai() for call in calls]}, "tool_calls")

    async def deltas(self, pieces) -> AsyncIterator[tuple[dict[str, Any], str | None]]:
        """``(delta, finish_reason)`` of each streamed chunk after the first, from the request's pieces."""
        if self.forced and self.name is not None:
            async for delta in self._named(pieces):
                yield delta
            return
        scanner = CallScanner(self.syntax, self.names) if self.syntax is not None else None
        text, reason = [], None
        async for piece in pieces:
            reason = piece.finish_reason
            if self.forced:
                text.append(piece.text)
                shown = ""
            else:
                shown = scanner.push(piece.text) if scanner is not None else piece.text
            if reason is None:
                if shown:
                    yield {"content": shown}, None
                continue
            calls: list[ToolCall] = []
            if self.forced:
                calls = forced_calls("".join(text), None) if reason == "stop" else []
                shown = "" if calls else "".join(text)
            elif scanner is not None:
                rest, calls = scanner.finish()
                shown += rest
            if shown:
                yield {"content": shown}, None if calls else reason
            if calls:
                yield {"tool_calls": [call.to_openai(i) for i, call in enumerate(calls)]}, "tool_calls"
            elif not shown:
                yield {}, reason

    async def _named(self, pieces) -> AsyncIterator[tuple[dict[str, Any], str | None]]:
        """A named forced call: its arguments stream as they come."""
        head = ToolCall(self.name, "").to_openai(0)
        async for piece in pieces:
            call = {"index": 0, "function": {"arguments": piece.text}}
            if head is not None:  # the first delta names the call
                call, head = {**head, "function": {"name": self.name, "arguments": piece.text}}, None
            finish = None if piece.finish_reason is None else \
                "tool_calls" if piece.finish_reason == "stop" else piece.finish_reason
            yield ({"tool_calls": [call]} if piece.text or "id" in call else {}), finish
