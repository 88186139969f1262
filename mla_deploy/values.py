"""Option values parsed one way for the command line's option types and the benches' specs: a bad value is an
:class:`~mla_deploy.errors.InputError` naming the option."""

from __future__ import annotations

from .errors import InputError


def parse_int_list(text: str | int | list, option: str, minimum: int = 1) -> tuple[int, ...]:
    """``"1024,4096"`` -> ``(1024, 4096)``; a user error is an :class:`~mla_deploy.errors.InputError`."""
    if isinstance(text, int):
        items = [text]
    elif isinstance(text, (list, tuple)):
        items = list(text)
    else:
        parts = [p.strip() for p in str(text).split(",")]
        if not parts or any(p == "" for p in parts):
            raise InputError(f"{option} takes a comma-separated list of integers, got {text!r}")
        try:
            items = [int(p) for p in parts]
        except ValueError:
            raise InputError(f"{option} takes a comma-separated list of integers, got {text!r}") from None
    for v in items:
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            raise InputError(f"{option} values must be integers >= {minimum}, got {v!r}")
        if v > INT_MAX:
            raise InputError(f"{option} values must be <= {INT_MAX}, got {v!r}")
    return tuple(dict.fromkeys(items))


#: the largest integer an option takes: every count and size ends up in an int64 (NumPy, torch, ONNX Runtime)
INT_MAX = 2 ** 63 - 1


def parse_int(text: str | int, option: str, minimum: int = 1, maximum: int = INT_MAX) -> int:
    """One integer option from ``minimum`` to ``maximum``; a user error is an
    :class:`~mla_deploy.errors.InputError`."""
    try:
        value = int(str(text).strip())
    except ValueError:
        raise InputError(f"{option} takes an integer, got {text!r}") from None
    if value < minimum:
        raise InputError(f"{option} must be >= {minimum}, got {value}")
    if value > maximum:
        raise InputError(f"{option} must be <= {maximum}, got {value}")
    return value


def parse_float(text: str | float, option: str) -> float:
    """One positive number option; a user error is an :class:`~mla_deploy.errors.InputError`."""
    try:
        value = float(str(text).strip())
    except ValueError:
        raise InputError(f"{option} takes a number, got {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise InputError(f"{option} must be a positive number, got {text!r}")
    return value
