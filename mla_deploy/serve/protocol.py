"""The OpenAI API's requests and errors, as this server takes them: pydantic models of ``/v1/completions`` and
``/v1/chat/completions`` bodies, and :class:`ApiError`, the ``{"error": {...}}`` reply with its HTTP status.

A body field that the API defines and this server does not implement is refused when it asks for something
(non-zero penalties, a ``logit_bias``, ``best_of``, ``suffix``), never silently ignored; a field the API
does not define is refused as the API refuses it ("Unrecognized request argument"). Types are strict (pydantic's
strict mode): ``max_tokens: true``, ``"16"`` or ``16.0`` are refused, not coerced; a string holding a lone UTF-16
surrogate (``"\\ud800"``, which JSON can spell but no UTF-8 text holds, and no tokenizer takes) is refused too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from ..generate.batching import MAX_CHOICES
from ..generate.logprobs import MAX_TOP_LOGPROBS

#: a function's name as OpenAI allows it
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class ApiError(Exception):
    """An OpenAI error reply: ``status`` and ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _lone_surrogate(value, where: str = "") -> str | None:
    """Where in a JSON value a string holds a lone surrogate (not UTF-8 text), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where or "body"
    elif isinstance(value, dict):
        for key, item in value.items():
            found = _lone_surrogate(key, where) or _lone_surrogate(item, f"{where}.{key}" if where else str(key))
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _lone_surrogate(item, f"{where}.{i}" if where else str(i))
            if found:
                return found
    return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: StrictBool = False


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchema(_Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchema


#: ``response_format``: free text, any JSON object, or JSON valid under a schema
ResponseFormat = Annotated[Union[TextFormat, JsonObjectFormat, JsonSchemaFormat], Field(discriminator="type")]


class _Sampling(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _utf8(cls, data):
        where = _lone_surrogate(data)
        if where:
            raise ValueError(f"{where} holds a lone UTF-16 surrogate, which is not text (send UTF-8 text)")
        return data

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)  # not in OpenAI's API; vLLM and llama-server take it
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # each choice a row of the batch: also at most --max-batch
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = Field(None, validate_default=True)
    seed: int | None = Field(None, ge=0)
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None

    def output_schema(self) -> tuple[bool, dict | None]:
        """``(constrained, schema)``: whether ``response_format`` holds the output to JSON, and its schema (None:
        any JSON object)."""
        form = self.response_format
        if isinstance(form, JsonSchemaFormat):
            return True, form.json_schema.json_schema
        return isinstance(form, JsonObjectFormat), None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(s == "" for s in stops):
            raise ValueError("a stop sequence cannot be empty")
        return stops

    def unsupported(self) -> list[tuple[str, str]]:
        """``(field, why)`` of each field that asks for what this server does not do."""
        out = []
        if self.presence_penalty or self.frequency_penalty:
            out.append(("presence_penalty" if self.presence_penalty else "frequency_penalty",
                        "presence and frequency penalties are not supported"))
        if self.logit_bias:
            out.append(("logit_bias", "logit_bias is not supported"))
        return out


class CompletionRequest(_Sampling):
    """A ``/v1/completions`` body. ``prompt``: a string, a list of token ids, or one of either in a list."""

    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = Field(16, ge=1)
    echo: StrictBool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.best_of not in (None, 1):
            out.append(("best_of", "best_of > 1 is not supported"))
        if self.suffix:
            out.append(("suffix", "suffix (insertion) is not supported"))
        return out


class FunctionCall(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str


class ToolCallIn(_Strict):
    """A call of an earlier assistant message, as the reply gave it."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class Function(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: Function


class NamedFunction(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    # extra: name, ...: passed to the chat template as given
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _calls(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only an assistant message has tool_calls, not a {self.role} message")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def text(self) -> str:
        """The message's text: a string, or its ``text`` parts joined (other parts are refused)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"message content parts must be text parts, got type {part.get('type')!r}",
                               param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Sampling):
    """A ``/v1/chat/completions`` body."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: StrictBool | None = None

    @model_validator(mode="after")
    def _tools(self):
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools: two functions have the same name")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names the function {self.tool_choice.function.name!r}, which is not "
                             f"in tools")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if self.forced_call()[0] and self.output_schema()[0]:
            raise ValueError("a forced tool call (tool_choice) and response_format cannot be combined")
        return self

    def forced_call(self) -> tuple[bool, str | None]:
        """``(forced, name)``: whether ``tool_choice`` forces a call, and of which function (None: any)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return True, self.tool_choice.function.name
        return self.tool_choice == "required", None

    def calls_parsed(self) -> bool:
        """Whether the reply's text is read for calls (tools given, ``tool_choice`` ``auto`` or absent)."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them (OpenAI's shape), None without tools."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @model_validator(mode="after")
    def _top_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them (content as text; ``developer`` as ``system``; calls as
        OpenAI gives them, arguments a JSON string)."""
        out = []
        for message in self.messages:
            extra = {k: v for k, v in (message.model_extra or {}).items()}
            role = "system" if message.role == "developer" else message.role
            if message.tool_calls:
                extra["tool_calls"] = [call.model_dump() for call in message.tool_calls]
            if message.tool_call_id is not None:
                extra["tool_call_id"] = message.tool_call_id
            # an assistant message of calls alone keeps no content (templates test for it: DeepSeek-V3's)
            text = None if message.content is None and message.tool_calls else message.text()
            out.append({**extra, "role": role, "content": text})
        return out


def validation_error(errors: list[dict]) -> ApiError:
    """The 400 reply of pydantic's first error (``loc``, ``msg``): what a client reads in one line."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = loc[0] if loc else None
    if first.get("type") == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {'.'.join(loc)}", param=param)
    if first.get("type") == "json_invalid":
        return ApiError(400, "the body is not valid JSON", code="invalid_json")
    where = ".".join(loc) or "body"
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if not loc:  # a check of the whole body names its field itself
        return ApiError(400, message)
    return ApiError(400, f"{where}: {message}", param=param)
