"""Text in, text out: prompts encoded with the artifact's tokenizer, the generation loop
(:func:`~mla_deploy.generate.loop.stream_tokens`), and the new text streamed as it is decoded.

* :func:`encode_prompts` ``(tokenizer, texts, chat, system) -> ids``: plain text, or a chat turn through the
  checkpoint's chat template.
* :class:`TextStream` (from :func:`stream_text`): iterate it for :class:`TextPiece` (a sequence's new text);
  its :meth:`~TextStream.result` is a :class:`TextGeneration`. :func:`generate_text` runs it to the end.

Each sequence stops at the tokenizer's end-of-sequence ids, at ``max_new_tokens``, or when its text contains
one of the ``stop`` strings: the text then ends before the stop string, and the tokens keep the one that
completed it. Text that could be the start of a stop string is held back until it is known not to be one, so
streamed text never has to be taken back. Without a stop string the pieces of a sequence joined equal
``decode(its new ids, skip_special_tokens=True)``.

Example::

    engine, tokenizer = OrtEngine("build/v2"), load_tokenizer("build/v2")
    ids = encode_prompts(tokenizer, ["Hello"], chat=True)
    for piece in stream_text(engine, tokenizer, ids, 64, SamplingConfig(temperature=0.7, top_p=0.9, seed=0)):
        print(piece.text, end="", flush=True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..errors import InputError
from .engine import GenerationEngine
from .loop import Generation, stream_tokens
from .sampling import SamplingConfig
from .tokenizer import ArtifactTokenizer


def encode_prompts(tokenizer: ArtifactTokenizer, texts: Sequence[str], chat: bool = False,
                   system: str | None = None) -> list[list[int]]:
    """The ids of each prompt: ``tokenizer.encode(text)``, or with ``chat`` the chat template applied to
    ``[{"role": "system", "content": system}] + [{"role": "user", "content": text}]`` with the generation prompt.

    Raises:
        InputError: ``system`` without ``chat``; ``chat`` and no chat template; the template refused.
    """
    if system is not None and not chat:
        raise InputError("a system message needs the chat template (--chat)")
    if not chat:
        return [tokenizer.encode(text) for text in texts]
    head = [{"role": "system", "content": system}] if system is not None else []
    return [tokenizer.chat_ids(head + [{"role": "user", "content": text}]) for text in texts]


@dataclass(frozen=True)
class TextPiece:
    """New text of one sequence. ``finished``: the sequence's finish reason when this is its last piece."""

    sequence: int
    text: str
    finished: str | None = None


@dataclass
class TextGeneration:
    """The result of a :class:`TextStream`: ``generation`` (ids, finish reasons, timings) and each sequence's text."""

    generation: Generation
    texts: list[str]


class StopText:
    """Holds back text that may be the beginning of a stop string; finds the first stop string. :meth:`feed` new
    text, get back ``(text safe to show, whether a stop string was found)``; :meth:`flush` at the end."""

    def __init__(self, stops: Sequence[str]):
        self.stops, self.pending = tuple(stops), ""

    def feed(self, text: str) -> tuple[str, bool]:
        """``(text that is safe to show, whether a stop string was found)``; after a stop, nothing more is shown."""
        self.pending += text
        found = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if found:
            out, self.pending = self.pending[: min(found)], ""
            return out, True
        keep = max((n for s in self.stops for n in range(1, len(s)) if self.pending.endswith(s[:n])), default=0)
        out, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class TextStream:
    """Text generation over an engine's generation stream (see the module docstring).

    Args:
        engine: a :class:`~mla_deploy.generate.engine.GenerationEngine` (any engine of :mod:`mla_deploy.engines`).
        tokenizer: the artifact's tokenizer.
        prompts: ``B`` lists of ids (:func:`encode_prompts`).
        max_new_tokens: most new tokens per sequence.
        sampling: greedy by default.
        stop: strings that end a sequence's text.
        eos_ids: ids that end a sequence (default: the tokenizer's).
    Raises:
        InputError: an empty stop string; as :class:`~mla_deploy.generate.loop.GenerationStream`.
    Attributes:
        texts: each sequence's text so far (also after an interrupted iteration).
    """

    def __init__(self, engine: GenerationEngine, tokenizer: ArtifactTokenizer, prompts: Sequence[Sequence[int]],
                 max_new_tokens: int, sampling: SamplingConfig | None = None, stop: Sequence[str] = (),
                 eos_ids: Sequence[int] | None = None):
        if any(s == "" for s in stop):
            raise InputError("a stop string cannot be empty")
        eos = tokenizer.eos_ids if eos_ids is None else eos_ids
        self.steps = stream_tokens(engine, prompts, max_new_tokens, sampling, eos)
        self.detokenizers = [tokenizer.detokenizer() for _ in prompts]
        self.stops = [StopText(stop) for _ in prompts]
        self.texts = ["" for _ in prompts]
        self._pieces = self._loop()

    def __iter__(self):
        return self

    def __next__(self) -> TextPiece:
        return next(self._pieces)

    def result(self) -> TextGeneration:
        """Ids, finish reasons, timings and texts (after the iteration has ended)."""
        return TextGeneration(self.steps.result(), list(self.texts))

    def _loop(self):
        for step in self.steps:
            for b, token in enumerate(step.tokens):
                if token is None:
                    continue
                finished = step.finished[b]
                text = self.detokenizers[b].push(token) + (self.detokenizers[b].flush() if finished else "")
                shown, hit = self.stops[b].feed(text)
                if hit:
                    self.steps.finish(b, "stop")
                    finished = self.steps.finished[b]
                elif finished:
                    shown += self.stops[b].flush()
                self.texts[b] += shown
                if shown or finished:
                    yield TextPiece(b, shown, finished)


def stream_text(engine: GenerationEngine, tokenizer: ArtifactTokenizer, prompts: Sequence[Sequence[int]],
                max_new_tokens: int, sampling: SamplingConfig | None = None, stop: Sequence[str] = (),
                eos_ids: Sequence[int] | None = None) -> TextStream:
    """A :class:`TextStream` (arguments as its)."""
    return TextStream(engine, tokenizer, prompts, max_new_tokens, sampling, stop, eos_ids)


def generate_text(engine: GenerationEngine, tokenizer: ArtifactTokenizer, prompts: Sequence[Sequence[int]],
                  max_new_tokens: int, sampling: SamplingConfig | None = None, stop: Sequence[str] = (),
                  eos_ids: Sequence[int] | None = None) -> TextGeneration:
    """:func:`stream_text` run to the end."""
    stream = stream_text(engine, tokenizer, prompts, max_new_tokens, sampling, stop, eos_ids)
    for _ in stream:
        pass
    return stream.result()
