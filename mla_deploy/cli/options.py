"""Click types of the command line's options: each converts its value or raises an
:class:`~mla_deploy.errors.InputError` naming the option (the CLI prints it as one line, exit 1), and ``--help``
shows what each option takes instead of ``TEXT``.

Imported at startup: nothing heavy here.
"""

from __future__ import annotations

import os
import click

from ..bench.parsing import parse_int, parse_int_list  # one parser of option values, shared with the benches' specs
from ..errors import InputError


def option_name(param) -> str:
    """``--threads``: how the user spelled the option (its first declaration)."""
    return param.opts[0] if param is not None and param.opts else "the option"


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


class Int(click.ParamType):
    """One integer >= ``minimum``."""

    name = "integer"

    def __init__(self, minimum: int = 1):
        self.minimum = minimum

    def get_metavar(self, param, ctx=None) -> str:
        return "N"

    def convert(self, value, param, ctx):
        return parse_int(value, option_name(param), self.minimum)


class Threads(click.ParamType):
    """A thread count: from 1 to the CPUs this process may use (:func:`available_cpus`). More threads than CPUs
    only contend, and a count in the thousands makes ONNX Runtime start that many threads before anything runs."""

    name = "threads"

    def get_metavar(self, param, ctx=None) -> str:
        return "N"

    def convert(self, value, param, ctx):
        option, cpus = option_name(param), available_cpus()
        threads = parse_int(value, option, 1)
        if threads > cpus:
            raise InputError(f"{option} must be <= {cpus}, the CPUs this process may use, got {threads}")
        return threads


class IntList(click.ParamType):
    """A comma-separated list of integers >= ``minimum`` -> a tuple (duplicates dropped)."""

    name = "integers"

    def __init__(self, minimum: int = 1):
        self.minimum = minimum

    def get_metavar(self, param, ctx=None) -> str:
        return "N[,N...]"

    def convert(self, value, param, ctx):
        return parse_int_list(value, option_name(param), self.minimum)


class TokenIds(click.ParamType):
    """One prompt's token ids, ``"1,2,3"`` -> ``[1, 2, 3]`` in order; an empty item (``"1,,2"``, ``"1,"``) is
    refused; ``""`` is an empty prompt (the engine says what a prompt needs)."""

    name = "ids"

    def get_metavar(self, param, ctx=None) -> str:
        return "ID[,ID...]"

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        text = str(value).replace(" ", "")
        if text == "":
            return []
        try:
            return [int(x) for x in text.split(",")]  # int("") raises: an empty item is refused
        except ValueError:
            raise InputError(f"{option_name(param)} takes comma-separated integers, got {value!r}") from None


class Positive(click.ParamType):
    """One positive, finite number."""

    name = "number"

    def get_metavar(self, param, ctx=None) -> str:
        return "SECONDS"

    def convert(self, value, param, ctx):
        option = option_name(param)
        try:
            number = float(str(value).strip())
        except ValueError:
            raise InputError(f"{option} takes a number, got {value!r}") from None
        if not number > 0 or number == float("inf"):
            raise InputError(f"{option} must be a positive number, got {value!r}")
        return number


class PathList(click.ParamType):
    """The attention bench's variants: a comma-separated subset of its paths, or ``all``
    (:func:`mla_deploy.bench.attention.spec.parse_paths` says which)."""

    name = "paths"

    def get_metavar(self, param, ctx=None) -> str:
        return "PATH[,PATH...]|all"

    def convert(self, value, param, ctx):
        from ..bench.attention.spec import parse_paths

        return value if isinstance(value, tuple) else parse_paths(value)
