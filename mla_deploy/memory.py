"""The check that sizes a user asked for fit in this machine's memory (:func:`mla_deploy.host.total_memory`) before anything is allocated:
a ``--max-batch`` or ``--max-cache-length`` that asks for terabytes is one line naming the option, not a
``MemoryError`` (or the OOM killer) halfway through the work."""

from __future__ import annotations

from .errors import InputError
from .host import total_memory


def size_text(nbytes: int) -> str:
    """``1.5 TiB``-style text of a byte count."""
    size, unit = float(nbytes), "bytes"
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if size < 1024 or unit == "EiB":
            break
        size /= 1024
    return f"{int(size)} bytes" if unit == "bytes" else f"{size:.1f} {unit}"


def check_fits_memory(nbytes: int, what: str) -> None:
    """Refuse ``what`` (``"--max-batch 100000 rows of 256 tokens"``) when its ``nbytes`` exceed this machine's
    physical memory. Raises: InputError."""
    total = total_memory()
    if total is not None and nbytes > total:
        raise InputError(f"{what} needs {size_text(nbytes)} of memory, more than this machine's {size_text(total)}")
