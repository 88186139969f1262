"""Click types of the command line's options: each converts its value or raises an
:class:`~mla_deploy.errors.InputError` naming the option (the CLI prints it as one line, exit 1), and ``--help``
shows what each option takes instead of ``TEXT``.

Imported at startup: nothing heavy here.
"""

from __future__ import annotations

import click

from ..errors import InputError
from ..host import usable_cpus
from ..values import parse_int, parse_int_list  # one parser of option values, shared with the benches' specs


def option_name(param) -> str:
    """``--threads``: how the user spelled the option (its first declaration)."""
    return param.opts[0] if param is not None and param.opts else "the option"


class Int(click.ParamType):
    """One integer >= ``minimum``."""

    name = "integer"

    def __init__(self, minimum: int = 1):
        self.minimum = minimum

    def get_metavar(self, param, ctx=None) -> str:
        return "N"

    def convert(self, value, param, ctx):
        return parse_int(value, option_name(param), self.minimum)


class IntOrAuto(Int):
    """``auto`` (None) or one integer >= ``minimum``."""

    name = "integer or auto"

    def __init__(self, minimum: int = 0):
        super().__init__(minimum)

    def get_metavar(self, param, ctx=None) -> str:
        return "N|auto"

    def convert(self, value, param, ctx):
        if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
            return None
        try:
            return super().convert(value, param, ctx)
        except InputError as exc:
            raise InputError(f"{exc} (or auto)") from None


class Threads(click.ParamType):
    """A thread count: from 1 to the CPUs this process may use (:func:`~mla_deploy.host.usable_cpus`). More threads than CPUs
    only contend, and a count in the thousands makes ONNX Runtime start that many threads before anything runs."""

    name = "threads"

    def get_metavar(self, param, ctx=None) -> str:
        return "N"

    def convert(self, value, param, ctx):
        option, cpus = option_name(param), usable_cpus()
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
