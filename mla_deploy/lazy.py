"""Lazy package attributes: a package names what it offers without importing torch, onnxruntime or tensorrt
until a name is used (so ``mla-deploy --help`` stays instant)."""

from __future__ import annotations

from importlib import import_module
from typing import Any, Callable


def lazy_getattr(package: str, table: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``table`` maps a name to the module (absolute, or relative to
    ``package``) that defines it."""

    def __getattr__(name: str) -> Any:
        if name in table:
            return getattr(import_module(table[name], package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
