"""Click types of the ``bench`` command's options: each converts its value with :mod:`.parsing`'s parsers, so a
bad value is an :class:`~mla_deploy.errors.InputError` naming the option (the CLI prints it as one line), and
``--help`` shows what each option takes instead of ``TEXT``.

Imported by the CLI at startup: nothing heavy here (the parsers are imported when a value is converted).
"""

from __future__ import annotations

import click


def _option(param) -> str:
    return param.opts[0] if param is not None and param.opts else "the option"


class IntList(click.ParamType):
    """A comma-separated list of integers >= ``minimum`` -> a tuple (duplicates dropped)."""

    name = "integers"

    def __init__(self, minimum: int = 1):
        self.minimum = minimum

    def get_metavar(self, param, ctx=None) -> str:
        return "N[,N...]"

    def convert(self, value, param, ctx):
        from .parsing import parse_int_list

        return parse_int_list(value, _option(param), self.minimum)


class Int(click.ParamType):
    """One integer >= ``minimum``."""

    name = "integer"

    def __init__(self, minimum: int = 1):
        self.minimum = minimum

    def get_metavar(self, param, ctx=None) -> str:
        return "N"

    def convert(self, value, param, ctx):
        from .parsing import parse_int

        return parse_int(value, _option(param), self.minimum)


class Positive(click.ParamType):
    """One positive number."""

    name = "number"

    def get_metavar(self, param, ctx=None) -> str:
        return "SECONDS"

    def convert(self, value, param, ctx):
        from .parsing import parse_float

        return parse_float(value, _option(param))


class PathList(click.ParamType):
    """The attention bench's variants: a comma-separated subset of :data:`~.attention.spec.PATHS`, or ``all``."""

    name = "paths"

    def get_metavar(self, param, ctx=None) -> str:
        return "PATH[,PATH...]|all"

    def convert(self, value, param, ctx):
        from .attention.spec import parse_paths

        return value if isinstance(value, tuple) else parse_paths(value)
