"""A checkpoint's chat template rendered with Jinja2 the way transformers 5 renders it (``apply_chat_template``).

The environment is transformers': a sandboxed, immutable Jinja2 environment with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, the ``{% generation %}`` block (rendered as its body),
a ``tojson`` filter that does not escape HTML and keeps non-ASCII text, and the globals ``raise_exception``,
``strftime_now``, ``dict`` and ``namespace`` (which refuses underscore-prefixed attributes). The template sees
``messages`` (keys whose value is None dropped), ``tools``, ``documents``, ``add_generation_prompt`` and the
tokenizer's named special tokens (``bos_token``, ``eos_token``, ...) as strings.

jinja2 is imported when a template is compiled, not with this module.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any, Mapping, Sequence

from ..errors import InputError


def render_chat(template: str, messages: Sequence[Mapping[str, Any]], special_tokens: Mapping[str, str],
                add_generation_prompt: bool = True, tools: list | None = None, documents: list | None = None) -> str:
    """The conversation as the template renders it.

    Args:
        template: the Jinja source.
        messages: ``[{"role": ..., "content": ...}, ...]``.
        special_tokens: ``{"bos_token": "<s>", ...}``, the template's variables for the named special tokens.
        add_generation_prompt: end with the header of an assistant turn.
    Raises:
        InputError: the template raised (``raise_exception``) or failed to render.
    """
    import jinja2

    chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
    try:
        return _compile(template).render(messages=chat, tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt, **dict(special_tokens))
    except jinja2.TemplateError as exc:
        raise InputError(f"the chat template refused the conversation: {exc}") from None


@functools.lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset:
    """The variables a template reads from its context (``messages``, ``tools``, ...): what it renders of a request.

    Raises: InputError: the template is not valid Jinja."""
    import jinja2
    import jinja2.meta

    try:
        return frozenset(jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template)))
    except jinja2.TemplateSyntaxError as exc:
        raise InputError(f"the chat template is not valid Jinja: {exc} (line {exc.lineno})") from None


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_tag(), jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _namespace_class()
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise InputError(f"the chat template is not valid Jinja: {exc} (line {exc.lineno})") from None


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


class _TemplateDict:
    """``dict(...)`` inside a template, without exposing the type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


@functools.lru_cache(maxsize=1)
def _namespace_class():
    import jinja2
    import jinja2.utils

    class TemplateNamespace(jinja2.utils.Namespace):
        """Jinja's namespace, refusing underscore-prefixed attributes."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set the attribute {name!r}")

    return TemplateNamespace


@functools.lru_cache(maxsize=1)
def _generation_tag():
    """The ``{% generation %}...{% endgeneration %}`` block (marks assistant text for training masks): its body."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationTag
