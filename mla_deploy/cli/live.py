"""What ``run`` prints of the sequences it generates, as they are generated and when it is interrupted.

* One sequence, without ``--json``, is printed as it comes: its text (``--prompt``), or ``sequence 0: `` and its
  ids (``--prompt-ids``), ended by a newline. A batch is printed once it has finished: each text under a
  ``--- sequence i (N tokens, reason) ---`` header, or ``sequence i: ids`` lines.
* Interrupted (Ctrl-C, SIGTERM, SIGHUP) during the generation: the line being streamed is ended and what each
  sequence has so far is printed (headed ``interrupted`` for a batch of texts; nothing for ``--json``, which
  prints a whole record or none), then :class:`~mla_deploy.cli.contract.Interrupted` carries the signal to the
  error contract: one error line, exit 128 + the signal number.
"""

from __future__ import annotations

import signal
import sys

import click

from .contract import Interrupted


def generate_and_show(engine, tokenizer, ids: list[list[int]], max_new_tokens: int, sampling, stop,
                      from_text: bool, as_json: bool):
    """Generate (text through ``tokenizer`` when there is one) and print the sequences as the module docstring says.

    Returns:
        ``(Generation, texts)``; ``texts`` is None without a tokenizer.
    Raises:
        Interrupted: a signal arrived during the generation (what was generated has been printed).
    """
    from ..generate.text import stream_text

    text = None if tokenizer is None else stream_text(engine, tokenizer, ids, max_new_tokens, sampling, stop)
    steps = engine.stream(ids, max_new_tokens, sampling) if text is None else text.steps
    shown = _Shown(from_text, live=len(ids) == 1 and not as_json)
    try:
        for piece in text if text is not None else steps:
            shown.update(piece, steps.tokens)
    except (KeyboardInterrupt, Interrupted) as exc:
        signum = getattr(exc, "signum", signal.SIGINT)
        for other in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a second signal must not cut the output
            signal.signal(other, signal.SIG_IGN)
        if not as_json:
            shown.interrupted(steps.tokens, text.texts if text is not None else None)
        raise Interrupted(signum) from None
    if text is None:
        result, texts = steps.result(), None
    else:
        done = text.result()
        result, texts = done.generation, done.texts
    if not as_json:
        shown.finished(result, texts)
    return result, texts


class _Shown:
    """The sequences on stdout: ``live`` streams the one sequence; otherwise all are printed at the end."""

    def __init__(self, from_text: bool, live: bool):
        self.from_text, self.live = from_text, live
        self.started, self.printed = False, 0  # the live line has begun; ids of it printed

    def update(self, piece, tokens: list[list[int]]) -> None:
        """After each piece of text (or step of ids): the live sequence's new text, or its new ids."""
        if not self.live:
            return
        if self.from_text:
            self.started = self.started or bool(piece.text)
            click.echo(piece.text, nl=False)
        else:
            self._new_ids(tokens[0])
        sys.stdout.flush()

    def finished(self, result, texts) -> None:
        """The end of the live line, or every sequence of the batch."""
        if self.live:
            self._end_live(result.tokens)
        elif self.from_text:
            for i, (text, tokens) in enumerate(zip(texts, result.tokens)):
                click.echo(f"--- sequence {i} ({len(tokens)} tokens, {result.finish_reasons[i]}) ---")
                click.echo(text)
        else:
            self._ids(result.tokens)

    def interrupted(self, tokens: list[list[int]], texts) -> None:
        """What each sequence has so far: the live line ended as it stands (an id made but not yet shown when the
        signal came is left out, so none is shown twice), or the batch headed ``interrupted``."""
        if self.live:
            if not self.from_text and not self.started:
                self._new_ids([])  # interrupted before the first id: the line says there is none
            if self.started:
                click.echo("")
        elif self.from_text:
            for i, (text, ids) in enumerate(zip(texts, tokens)):
                click.echo(f"--- sequence {i} ({len(ids)} tokens, interrupted) ---")
                click.echo(text)
        else:
            self._ids(tokens)
        sys.stdout.flush()

    def _new_ids(self, ids: list[int]) -> None:
        """Print the ids of the live line not printed yet (the state first: a signal between the two loses a
        piece of the line rather than printing it twice)."""
        head = "" if self.started else "sequence 0: "
        new, self.started, self.printed = ids[self.printed:], True, len(ids)
        if head or new:
            click.echo(head + ("," if self.printed > len(new) else "") + ",".join(map(str, new)), nl=False)

    def _end_live(self, tokens: list[list[int]]) -> None:
        """End the finished live line (even an empty one)."""
        if not self.from_text:
            self._new_ids(tokens[0])
        click.echo("")

    @staticmethod
    def _ids(tokens: list[list[int]]) -> None:
        for i, ids in enumerate(tokens):
            click.echo(f"sequence {i}: {','.join(map(str, ids))}")
