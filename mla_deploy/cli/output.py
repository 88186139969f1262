"""What several commands print: sizes, timed log lines, a progress line, a validation's verdicts."""

from __future__ import annotations

import sys

import click


def size_text(nbytes: int) -> str:
    """``0.34 MB`` / ``4.30 GB``."""
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.2f} MB"


def log_line(start: float):
    """A ``log(line)`` callback printing ``[  12.3 s] line`` on stderr."""
    import time

    def log(line: str) -> None:
        click.echo(f"[{time.perf_counter() - start:7.1f} s] {line}", err=True)

    return log


def progress_line(label: str):
    """A ``progress(done, total, seconds)`` callback: one updating line on a terminal (a line per update, at most
    one a second, elsewhere)."""
    tty = sys.stderr.isatty()
    shown = [-1.0]

    def show(done: int, total: int, seconds: float) -> None:
        last = bool(total) and done >= total
        if not last and seconds - shown[0] < (0.2 if tty else 1.0):
            return
        shown[0] = seconds
        rate = done / max(seconds, 1e-9)
        left = f", {(total - done) / rate:.0f} s left" if total and rate and not last else ""
        scale, unit = (1e9, "GB") if total >= 1e9 else (1e6, "MB")
        text = f"{label}: {done / scale:.2f} / {total / scale:.2f} {unit}, {rate / 1e6:.0f} MB/s{left}"
        if tty:
            click.echo(f"\r{text}   ", err=True, nl=last)
        else:
            click.echo(text, err=True)

    return show



def report_validation(result) -> None:
    """One line per verdict of a validation (the graphs; a quantized artifact's quantization): the passing ones on
    stdout, the failing ones as the error (exit 1)."""
    failing = result.failures()
    for line in result.lines():
        if line not in failing:
            click.echo(line)
    result.raise_for_failure()
