"""Weights on huge pages: the one place mla-deploy decides whether its process's memory is backed by 2 MiB pages.

A decode step streams every weight it uses once. Over 4 KiB pages that stream needs a page-table walk per 4 KiB,
and on a virtual machine each walk is nested. On the development machine (2 cores of an AMD EPYC under KVM) a
2-thread read loop reached 34 GB/s over 4 KiB pages and 64 GB/s over huge pages, and ONNX Runtime's
``MatMulNBits`` (int4, blocks of 32, one row) went from 24.4 to 29.6 GB/s on V2-Lite's ``lm_head`` in one
measurement (29-32 GB/s either way in ``benchmarks/gemv_probe``'s later runs). A 4-layer V2-Lite int4 decode step was
3% shorter (17.6 -> 17.1 ms, medians of 6 alternating runs), a full-size one about 2%.

Linux backs anonymous memory with transparent huge pages (THP) as the system's THP setting (:func:`mla_deploy.host.thp_setting`)
says: ``always``, ``madvise`` (most distributions' default: only memory advised with ``MADV_HUGEPAGE``) or
``never``. ONNX Runtime allocates weights and pre-packed weights with ``malloc``, which advises nothing, unless
glibc's tunable ``glibc.malloc.hugetlb=1`` (glibc 2.35+) is set when the process starts: then every ``mmap`` glibc
makes for a large allocation is advised, and the weights are faulted in on huge pages as they are loaded, at no
extra cost (loading got faster: fewer faults). A tunable is read once, at process start, so the command line
re-executes itself with it (:func:`environment_with_huge_pages`, applied by :func:`mla_deploy.cli.entry`); a
program using the Python API sets it itself. A ``GLIBC_TUNABLES`` that already names ``glibc.malloc.hugetlb``
is left as it is: ``GLIBC_TUNABLES=glibc.malloc.hugetlb=0 mla-deploy ...`` turns it off.

Collapsing the loaded weights afterwards (``MADV_COLLAPSE``) was measured too: the same decode speed, but about
0.8 s per GiB at load, 8 s on a full-size V2-Lite int4 artifact.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..host import glibc_version, thp_setting

TUNABLE = "glibc.malloc.hugetlb"


def _glibc() -> bool:
    """Whether this Python runs on glibc 2.35 or newer (the first with the ``hugetlb`` tunable)."""
    version = glibc_version()
    return version is not None and version >= (2, 35)


def environment_with_huge_pages(environ: Mapping[str, str], thp: str | None = None) -> dict[str, str] | None:
    """``environ`` with ``glibc.malloc.hugetlb=1`` added to ``GLIBC_TUNABLES``, or None where nothing is to change:
    not glibc 2.35+, THP (``thp``, else the system's setting) ``never`` or absent, or ``GLIBC_TUNABLES`` already
    names the tunable (either value)."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    thp = thp_setting() if thp is None else thp
    if TUNABLE in tunables or thp not in ("always", "madvise") or not _glibc():
        return None
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1"}


def requested(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` (this process's, read at its start) asks glibc to advise huge pages."""
    return any(item.strip() == f"{TUNABLE}=1" for item in environ.get("GLIBC_TUNABLES", "").split(":"))


@dataclass(frozen=True)
class HugePages:
    """How much of a process's memory is on huge pages.

    Attributes:
        setting: the system's THP setting (:func:`thp_setting`).
        requested: whether the process started with ``glibc.malloc.hugetlb=1``.
        anonymous_bytes: the process's resident anonymous memory (its weights, once loaded).
        huge_bytes: of it, on huge pages.
    """

    setting: str
    requested: bool
    anonymous_bytes: int
    huge_bytes: int

    def describe(self) -> str:
        """One line, e.g. ``1.9 of 2.0 GiB on huge pages (THP madvise, glibc.malloc.hugetlb=1)``."""
        gib = 1 << 30
        how = f"THP {self.setting}" + (f", {TUNABLE}=1" if self.requested else "")
        return f"{self.huge_bytes / gib:.1f} of {self.anonymous_bytes / gib:.1f} GiB on huge pages ({how})"


def huge_pages(environ: Mapping[str, str] | None = None) -> HugePages:
    """This process's anonymous memory and how much of it is on huge pages (``/proc/self/smaps_rollup``; zeros
    where there is none). ``environ``: the environment the process started with (default ``os.environ``)."""
    import os

    fields = {}
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            key, _, value = line.partition(":")
            parts = value.split()
            if len(parts) == 2 and parts[1] == "kB":
                fields[key] = int(parts[0]) * 1024
    except OSError:
        pass
    return HugePages(thp_setting(), requested(os.environ if environ is None else environ),
                     fields.get("Anonymous", 0), fields.get("AnonHugePages", 0))


def probe(size: int = 32 << 20) -> bool:
    """Whether memory this process allocates now lands on huge pages: a ``size``-byte ``malloc``, written, and the
    process's huge-page bytes before and after (``/proc/self/smaps_rollup``). False where it cannot be told."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
    except (OSError, AttributeError):
        return False
    before = huge_pages().huge_bytes
    address = libc.malloc(size)
    if not address:
        return False
    try:
        ctypes.memset(address, 1, size)
        return huge_pages().huge_bytes - before >= size // 2
    finally:
        libc.free(address)
