"""Constrained decoding: a request's tokens held to a JSON schema (or to any JSON object) by a token mask that the
grammar library xgrammar computes for each step.

* :class:`Grammars` (one per tokenizer and vocabulary): compiles a schema into a grammar (cached), and starts a
  :class:`Constraint` on one.
* :class:`Constraint`: one request's grammar state. The continuous batcher calls :meth:`Constraint.mask` on that
  request's row of logits before its sampler chooses (disallowed tokens get ``-inf``), then
  :meth:`Constraint.advance` with the chosen token; :attr:`Constraint.complete` says that the grammar is satisfied
  and allows nothing but an end-of-sequence token, where the request ends.

xgrammar was chosen over llguidance by the per-token mask cost measured on this project's tokenizer of DeepSeek's
vocabulary size (benchmarks/structured_mask.py, docs/serving.md). It is an optional dependency (the ``structured``
extra); it is imported, with the tokenizer's vocabulary handed over, on the first constrained request, not at start.
The JSON is compact (no whitespace between tokens of the syntax: a model cannot pad it without end).
"""

from __future__ import annotations

import functools
import json
import re
import threading
from typing import Any, Sequence

import numpy as np

from ..errors import InputError, RuntimeMissingError

#: what a user installs for constrained decoding
EXTRA = "pip install 'mla-deploy[structured]'"


class Grammars:
    """Grammars over one tokenizer: compile schemas, start constraints. Thread-safe.

    Args:
        tokenizer: the artifact's :class:`~mla_deploy.generate.tokenizer.ArtifactTokenizer` (its ``backend``).
        vocab_size: the model's vocabulary (the logits' width, which may exceed the tokenizer's).
        stop_ids: the end-of-sequence ids, allowed once the grammar is complete.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Sequence[int]):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, int(vocab_size), [int(i) for i in stop_ids]
        self._compiler = None
        self._lone_lead = self._continues = None  # the surrogate rule's token sets (:class:`Constraint`)
        self._lock = threading.Lock()

    def compile(self, schema: dict | None) -> "Grammar":
        """The grammar of JSON valid under ``schema`` (None: any JSON object), compiled once per distinct schema.

        Raises: RuntimeMissingError: xgrammar is not installed. InputError: the schema is not one xgrammar takes
            (the message in one line).
        """
        unenforced = _unenforced(schema) if schema is not None else None
        if unenforced:
            raise InputError(f"the JSON schema cannot be used: {unenforced} cannot be enforced while decoding "
                             f"(refused rather than ignored: the reply must validate)")
        try:  # the properties' order is the output's: not sorted
            key = json.dumps(schema, allow_nan=False) if schema is not None else None
        except ValueError:
            raise InputError("the JSON schema holds a number that is not finite (NaN, Infinity)") from None
        return self._compiled(key)

    @functools.lru_cache(maxsize=64)
    def _compiled(self, key: str | None) -> "Grammar":
        compiler = self._xgrammar_compiler()
        try:
            if key is None:
                compiled = compiler.compile_json_schema({"type": "object"}, any_whitespace=False,
                                                        separators=(",", ":"))
            else:
                compiled = compiler.compile_json_schema(key, any_whitespace=False, separators=(",", ":"),
                                                        strict_mode=True)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InputError(f"the JSON schema cannot be used: {_one_line(exc)}") from None
        grammar = Grammar(compiled, self.vocab_size, self.stop_ids, self._lone_lead, self._continues)
        # a schema that no value satisfies ({"anyOf": []}) would leave a row no token to choose
        first = grammar.start().allowed().copy()
        first[grammar.stop_ids] = False
        if not first.any():
            raise InputError("the JSON schema cannot be used: no JSON value satisfies it")
        return grammar

    def _xgrammar_compiler(self):
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar
                except ImportError:
                    raise RuntimeMissingError(f"structured outputs need the xgrammar library: {EXTRA}") from None

                encoded = _encoded_vocab(self.tokenizer.backend, self.vocab_size)
                kind = _vocab_type(xgrammar, self.tokenizer.backend)
                # xgrammar 0.2.9 lets a UTF-8-encoded surrogate (ED A0..BF ..) into a string, which is not UTF-8
                # (it decodes to three U+FFFD): tokens holding one are never allowed, and a token ending in the
                # lead byte ED is never followed by one starting with A0..BF (Constraint.allowed)
                pieces = [_token_bytes(t) if kind == xgrammar.VocabType.BYTE_LEVEL else b"" for t in encoded]
                encoded = [("" if _SURROGATE.search(b) else t) for t, b in zip(encoded, pieces)]
                self._lone_lead = np.array([b.endswith(b"\xed") for b in pieces], dtype=bool)
                self._continues = np.array([b[:1] >= b"\xa0" and b[:1] <= b"\xbf" and b != b"" for b in pieces],
                                           dtype=bool)
                info = xgrammar.TokenizerInfo(encoded, kind, vocab_size=self.vocab_size,
                                              stop_token_ids=self.stop_ids or None, add_prefix_space=False)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
            return self._compiler


class Grammar:
    """A compiled grammar: :meth:`start` a :class:`Constraint` on it for each request."""

    def __init__(self, compiled, vocab_size: int, stop_ids: Sequence[int], lone_lead: np.ndarray,
                 continues: np.ndarray):
        self.compiled, self.vocab_size, self.stop_ids = compiled, vocab_size, list(stop_ids)
        self.lone_lead, self.continues = lone_lead, continues

    def start(self) -> "Constraint":
        return Constraint(self)


class Constraint:
    """One request's state in its grammar (see the module docstring). Used on the engine's thread only."""

    def __init__(self, grammar: Grammar):
        import xgrammar

        self.vocab_size, self.grammar = grammar.vocab_size, grammar
        self.stop_ids = np.array(grammar.stop_ids, dtype=np.int64)
        self._after_lead = False  # the last token ended in the byte ED
        self.matcher = xgrammar.GrammarMatcher(grammar.compiled, override_stop_tokens=grammar.stop_ids or None)
        self._bits = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        self._allowed: np.ndarray | None = None  # of the next token, computed once per step
        self.complete = False

    def allowed(self) -> np.ndarray:
        """``[V]`` bool: the tokens the grammar allows next."""
        if self._allowed is None:
            self.matcher.fill_next_token_bitmask(self._bits)
            packed = self._bits.numpy()[0].view(np.uint8)
            self._allowed = np.unpackbits(packed, bitorder="little", count=self.vocab_size).view(bool)
            if self._after_lead:
                self._allowed &= ~self.grammar.continues
        return self._allowed

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """``logits [V]`` with the tokens the grammar does not allow next at ``-inf`` (a new float32 array)."""
        return np.where(self.allowed(), np.asarray(logits, dtype=np.float32), np.float32(-np.inf))

    def advance(self, token: int) -> None:
        """Take the chosen ``token`` (one the mask allowed); sets :attr:`complete` once only an end-of-sequence id
        may follow."""
        accepted = self.matcher.accept_token(int(token))
        assert accepted, f"the grammar refused token {token}, which its mask allowed"
        self._allowed = None
        self._after_lead = bool(self.grammar.lone_lead[token])
        if self.matcher.is_terminated():
            self.complete = True
        elif self.matcher.is_completed():
            allowed = self.allowed()
            self.complete = not allowed.any() or bool(np.isin(np.flatnonzero(allowed), self.stop_ids).all())


def _encoded_vocab(backend, vocab_size: int) -> list[str]:
    """Each id's entry as ``tokenizer.json`` spells it, ``""`` (which xgrammar never allows) for special tokens
    (not text: the detokenizer drops them), ids the tokenizer lacks, and tokens whose text holds a control character:
    compact JSON has none outside its escapes, and xgrammar 0.2.9's string rule would let them into a string."""
    vocab = [""] * vocab_size
    for token, index in backend.get_vocab(with_added_tokens=True).items():
        if index < vocab_size:
            vocab[index] = token
    for index, added in backend.get_added_tokens_decoder().items():
        if index < vocab_size and added.special:
            vocab[index] = ""
    texts = backend.decode_batch([[i] for i in range(min(vocab_size, backend.get_vocab_size()))],
                                 skip_special_tokens=False)
    for index, text in enumerate(texts):
        if _CONTROL.search(text):
            vocab[index] = ""
    return vocab


_CONTROL = re.compile(r"[\x00-\x1f]")


def _token_bytes(token: str) -> bytes:
    """The bytes a byte-level vocabulary entry stands for (GPT-2's byte-to-character map reversed); an entry of
    other characters (an added token) as its UTF-8."""
    decoder = _byte_decoder()
    if all(ch in decoder for ch in token):
        return bytes(decoder[ch] for ch in token)
    return token.encode("utf-8")


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict:
    """GPT-2's byte-level map, character to byte: printable bytes are themselves, the others 256 + n in order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + n): b for n, b in enumerate(moved)}}


_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


def _vocab_type(xgrammar, backend):
    """How the vocabulary spells bytes: byte-level (GPT-2's, DeepSeek's), byte fallback (``<0x0A>``), or raw."""
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", []) if isinstance(d, dict)}
    if "ByteLevel" in kinds:
        return xgrammar.VocabType.BYTE_LEVEL
    if "ByteFallback" in kinds:
        return xgrammar.VocabType.BYTE_FALLBACK
    return xgrammar.VocabType.RAW


def _one_line(exc: Exception) -> str:
    """xgrammar's message without its ``[time] file.cc:line:`` prefix, on one line."""
    text = re.sub(r"\[[0-9:]+\] \S+:\d+: |Check failed: \(.*?\) is false: ", "", str(exc))
    return " ".join(text.split()) or type(exc).__name__


#: keywords that xgrammar 0.2.9 does not hold a reply to (it would accept values they exclude)
UNENFORCED = ("not", "if", "then", "else")
#: keywords whose value maps names to schemas, holds a list of schemas, or holds data (not schemas)
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_DATA = ("enum", "const", "default", "examples", "required", "description", "title", "pattern")


def _unenforced(schema: Any, depth: int = 0) -> str | None:
    """The first keyword of ``schema`` (nested schemas included) that decoding cannot enforce, or None."""
    if depth > 64:
        return "a schema nested more than 64 deep"
    if not isinstance(schema, dict):
        return None
    for key in UNENFORCED:
        if key in schema:
            return f"the keyword {key!r}"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return "'allOf' of several schemas"
    if schema.get("uniqueItems") is True:
        return "'uniqueItems'"
    nested = []
    for key, value in schema.items():
        if key in _NAMED and isinstance(value, dict):
            nested += value.values()
        elif key in _LISTS and isinstance(value, list):
            nested += value
        elif key not in _DATA:
            nested.append(value)
    return next((found for found in (_unenforced(v, depth + 1) for v in nested) if found), None)
