"""An artifact's tokenizer: text to ids and back with the ``tokenizers`` library (no transformers at runtime).

* :func:`load_tokenizer` ``(artifact) -> ArtifactTokenizer | None``: the tokenizer files the export copied from
  the checkpoint (:class:`~mla_deploy.artifact.TokenizerFiles`), None for an artifact without them.
* :class:`ArtifactTokenizer`: :meth:`~ArtifactTokenizer.encode` gives the ids transformers 5's
  ``tokenizer(text)`` gives: ``tokenizer.json``'s own pipeline, its post-processor adding the BOS (and any
  other special tokens) it declares; :meth:`~ArtifactTokenizer.chat_ids` those of ``apply_chat_template(...,
  add_generation_prompt=True)`` (the template rendered by :mod:`mla_deploy.generate.chat_template`, then encoded without
  special tokens); :attr:`~ArtifactTokenizer.eos_ids` the end-of-sequence ids ``generate`` stops at.
* :class:`IncrementalDetokenizer`: text out as ids come in, never cutting a multi-byte character: the
  concatenation of its pieces equals ``decode(all ids, skip_special_tokens=True)``.

The chat template is ``chat_template.jinja`` when present (as transformers 5 writes it), else
``tokenizer_config.json``'s ``chat_template`` (a string, or named templates with a ``default``). The end-of-
sequence ids are ``generation_config.json``'s ``eos_token_id`` (an int or a list), else the tokenizer's
``eos_token``. ``clean_up_tokenization_spaces`` (a WordPiece-era decode option) is not applied.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import ArtifactError, InputError

#: the named special tokens a chat template sees (transformers' ``SPECIAL_TOKENS_ATTRIBUTES``)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def load_tokenizer(artifact: str | Path) -> "ArtifactTokenizer | None":
    """The tokenizer an artifact carries, or None when it has none.

    Raises:
        ArtifactError: the manifest or a tokenizer file is missing or unreadable.
    """
    from ..artifact import load_manifest

    manifest = load_manifest(artifact)
    if manifest.tokenizer is None:
        return None
    return ArtifactTokenizer(artifact, manifest.tokenizer.names)


class ArtifactTokenizer:
    """The tokenizer files of a folder (an artifact, or a checkpoint).

    Args:
        folder: holding ``tokenizer.json`` and, optionally, ``tokenizer_config.json``, ``special_tokens_map.json``,
            ``chat_template.jinja``, ``generation_config.json``.
        names: the files to read (default: those present).
    Attributes:
        backend: the ``tokenizers.Tokenizer``; special_tokens: ``{"bos_token": "<s>", ...}``; chat_template: the
        Jinja source or None; eos_ids: tuple of ids.
    """

    def __init__(self, folder: str | Path, names: Sequence[str] | None = None):
        from tokenizers import AddedToken, Tokenizer

        folder = Path(folder)
        present = set(names) if names is not None else {p.name for p in folder.iterdir()}
        try:
            self.backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises its own Exception type
            raise ArtifactError(f"{folder / 'tokenizer.json'} is not a readable tokenizer ({exc})") from None
        config = _json(folder, "tokenizer_config.json", present)
        token_map = _json(folder, "special_tokens_map.json", present)
        self.special_tokens = {}
        for name in SPECIAL_TOKEN_NAMES:
            value = _token_text(config.get(name, token_map.get(name)))
            if value is not None:
                self.special_tokens[name] = value
        missing = [t for t in self.special_tokens.values() if self.backend.token_to_id(t) is None]
        if missing:  # as transformers does: a named special token absent from the vocabulary is added
            self.backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
        if config.get("split_special_tokens"):
            self.backend.encode_special_tokens = True
        self.chat_template = _chat_template(folder, config, present)
        generation = _json(folder, "generation_config.json", present)
        self.eos_ids = _eos_ids(generation.get("eos_token_id"), self.special_tokens.get("eos_token"), self.backend)
        self._byte_decoder: dict | None = None  # token_bytes' map, made on first use

    def encode(self, text: str, add_special_tokens: bool = True, release_gil: bool = False) -> list[int]:
        """The ids of ``text`` (``add_special_tokens``: as the post-processor adds them, e.g. a BOS).

        ``release_gil``: encode without holding Python's interpreter lock (``tokenizers`` releases it in
        ``encode_batch``, not in ``encode``), so that other threads, a server's event loop, run meanwhile; the ids
        are the same. Only for a process that does not fork afterwards: ``tokenizers`` then warns that its thread
        pool was used before the fork.
        """
        if release_gil:
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: list | None = None) -> str:
        """The conversation rendered by the chat template (``tools``: OpenAI's function definitions, as
        ``apply_chat_template(tools=...)`` hands them to it). Raises: InputError when there is no template."""
        from .chat_template import render_chat

        if self.chat_template is None:
            raise InputError("this tokenizer has no chat template (no chat_template.jinja, none in "
                             "tokenizer_config.json)")
        return render_chat(self.chat_template, messages, self.special_tokens, add_generation_prompt, tools=tools)

    def template_reads(self, name: str) -> bool:
        """Whether the chat template reads the variable ``name`` (``tools``: it renders function definitions)."""
        from .chat_template import template_variables

        return self.chat_template is not None and name in template_variables(self.chat_template)

    def chat_ids(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                 release_gil: bool = False, tools: list | None = None) -> list[int]:
        """The ids of the rendered conversation (the template writes the special tokens; none are added);
        ``release_gil`` as :meth:`encode`; ``tools`` as :meth:`render_chat`."""
        return self.encode(self.render_chat(messages, add_generation_prompt, tools), add_special_tokens=False,
                           release_gil=release_gil)

    def token_bytes(self, token: int) -> bytes:
        """The bytes token ``token`` stands for (a byte-level vocabulary's part of a UTF-8 character included, which
        decoding it alone would turn into U+FFFD); a special token's own text. What a log probability entry names."""
        if self._byte_decoder is None:
            from tokenizers import decoders

            level = isinstance(self.backend.decoder, decoders.ByteLevel)
            self._byte_decoder = _byte_level_decoder() if level else {}
        piece = self.backend.id_to_token(int(token))
        if piece is None:
            return b""
        if self._byte_decoder and all(c in self._byte_decoder for c in piece):
            return bytes(self._byte_decoder[c] for c in piece)
        return self.backend.decode([int(token)], skip_special_tokens=False).encode("utf-8")

    def detokenizer(self, skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        """A new :class:`IncrementalDetokenizer` over this tokenizer."""
        return IncrementalDetokenizer(self.backend, skip_special_tokens)


class IncrementalDetokenizer:
    """Text of a growing id sequence, given piece by piece.

    Each :meth:`push` decodes a short window, the ids since the last piece plus those of the piece before
    (so decoders that treat a sequence's first token specially, such as a leading space, see the same context),
    and returns the text the new ids add, or ``""`` while that text ends in an incomplete UTF-8 sequence
    (decoded as U+FFFD); :meth:`flush` returns whatever is left. The pieces joined equal
    ``decode(ids, skip_special_tokens)`` of every id pushed.
    """

    def __init__(self, backend, skip_special_tokens: bool = True):
        self.backend, self.skip = backend, skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0

    def push(self, token: int) -> str:
        """Add one id; returns the new text it completes (possibly empty)."""
        self.ids.append(int(token))
        return self._advance(final=False)

    def flush(self) -> str:
        """The text not yet returned (an incomplete character at the end decodes as U+FFFD, as ``decode`` gives)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix = self.backend.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip)
        text = self.backend.decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip)
        if len(text) <= len(prefix) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix):]


def _byte_level_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's ``bytes_to_unicode``) read backwards: each of its 256 characters to the
    byte it spells (printable bytes spell themselves, the others are shifted past U+0100)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, shifted = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + shifted)
            shifted += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _json(folder: Path, name: str, present: set) -> dict:
    if name not in present or not (folder / name).is_file():
        return {}
    try:
        data = json.loads((folder / name).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{folder / name} is not readable JSON ({exc})") from None
    return data if isinstance(data, dict) else {}


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(folder: Path, config: dict, present: set) -> str | None:
    if "chat_template.jinja" in present and (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _eos_ids(configured, eos_token: str | None, backend) -> tuple[int, ...]:
    """generation_config.json's ``eos_token_id`` (int or list), else the id of the tokenizer's ``eos_token``."""
    if configured is not None:
        ids = configured if isinstance(configured, list) else [configured]
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ArtifactError(f"generation_config.json: eos_token_id {configured!r} is not an id or a list of ids")
        return tuple(ids)
    if eos_token is not None and backend.token_to_id(eos_token) is not None:
        return (backend.token_to_id(eos_token),)
    return ()
