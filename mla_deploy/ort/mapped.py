"""Mapped weights faulted in when an engine opens: the one place mla-deploy populates its file mappings.

ONNX Runtime maps a CPU engine's weights file (``cpu/<graph>.data``, :mod:`~mla_deploy.ort.cpu_build`) with
``mmap`` and reads nothing of it until an operator does. Each page's first read in the process is then a page fault,
even when the file is in the page cache, and the routed experts make those reads arrive over many steps: a decode
step reads only the 6 of 64 experts its token chose, so the first tens of steps after the engine opens each meet
experts never read before. llama.cpp maps its GGUF file with ``MAP_POPULATE`` (``llama-mmap.cpp``) for the same
reason.

:func:`populate` asks the kernel to fault in, at once, every readable mapping of the files under a folder
(``madvise(MADV_POPULATE_READ)``, Linux 5.14+): pages already in the page cache are only entered in the page
tables; pages that are not are read from the disk, as the first steps would have read most of them anyway. It
advises each mapping ``MADV_HUGEPAGE`` first, as the operators do before their first read (``cpu_ops.c``,
``advise_huge``): without that, a cold start read the file into 4 KiB pages, and its steps were slower.

Measured on the development machine, full-size V2-Lite int4 engine (8.9 GiB), 2 threads, each run a fresh process:

* file in the page cache, the first 16 decode steps after a 1-token prompt: median 72.8 and 49.3 ms per step without
  this, 47.1 and 47.0 ms with it (alternating); the fault-in took 0.3-0.9 s;
* every file of the artifact dropped from the page cache, ``mla-deploy run ART --prompt-ids 1,2,3,4
  --max-new-tokens 16``: 7.0 s with it (4.1 s of fault-in, then 101 ms per step), 7.2 s without (200 ms per step);
  peak RSS 9.0 GiB against 7.3 GiB, every weight resident. Without ``MADV_HUGEPAGE`` first it took 12.1 s
  (9.7 s without either, in that pair).
"""

from __future__ import annotations

import errno
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

#: ``madvise`` advice: populate (prefault) page tables readable, faulting in all pages (``<linux/mman.h>``)
MADV_POPULATE_READ = 22
#: ``madvise`` advice: back the range with transparent huge pages where possible (``<asm-generic/mman-common.h>``)
MADV_HUGEPAGE = 14


@dataclass(frozen=True)
class Populated:
    """What :func:`populate` did.

    Attributes:
        mapped_bytes: the bytes of the readable mappings found (0: none).
        populated_bytes: of them, faulted in.
        seconds: how long it took.
        reason: why nothing or only part was populated (None: all of it).
    """

    mapped_bytes: int
    populated_bytes: int
    seconds: float
    reason: str | None = None

    def describe(self) -> str:
        """One line, e.g. ``8.6 GiB of 8.6 GiB of mapped files faulted in in 1.9 s``."""
        if not self.mapped_bytes:
            return f"no mapped files ({self.reason})" if self.reason else "no mapped files"
        text = (f"{_size(self.populated_bytes)} of {_size(self.mapped_bytes)} of mapped files faulted in in "
                f"{self.seconds:.1f} s")
        return text + (f" ({self.reason})" if self.reason else "")


def _size(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def mappings(folder: str | Path, maps: str | None = None) -> list[tuple[int, int]]:
    """``[(start, end)]`` of this process's readable mappings of the files under ``folder``.

    Args:
        folder: a directory.
        maps: the text of ``/proc/self/maps`` (None: read it).
    """
    prefix = str(Path(folder).resolve()) + os.sep
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return []
    found = []
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[1].startswith("r") and parts[5].startswith(prefix):
            start, _, end = parts[0].partition("-")
            found.append((int(start, 16), int(end, 16)))
    return found


def populate(folder: str | Path) -> Populated:
    """Fault in every readable mapping this process holds of the files under ``folder`` (see the module docstring).
    Never raises: where the kernel refuses (before Linux 5.14: ``EINVAL``), the result says why."""
    start = time.perf_counter()
    if not sys.platform.startswith("linux"):
        return Populated(0, 0, 0.0, "not Linux")
    ranges = mappings(folder)
    total = sum(end - begin for begin, end in ranges)
    if not ranges:
        return Populated(0, 0, 0.0)
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done, reason = 0, None
    for begin, end in ranges:
        # asked first, as the operators ask before their first read (cpu_ops.c, advise_huge): where the file is not
        # cached yet, its pages are then read into 2 MiB folios and mapped so; a hint, its refusal changes nothing
        libc.madvise(begin, end - begin, MADV_HUGEPAGE)
        if libc.madvise(begin, end - begin, MADV_POPULATE_READ) == 0:
            done += end - begin
            continue
        code = ctypes.get_errno()
        reason = ("the kernel has no MADV_POPULATE_READ (Linux 5.14+)" if code == errno.EINVAL
                  else f"madvise: {os.strerror(code)}")
        if code == errno.EINVAL:
            break
    return Populated(total, done, time.perf_counter() - start, reason)
