"""Facts about the machine this process runs on, in one place: its CPU (architecture, model, instruction-set flags),
the CPUs this process may use, its memory, its transparent huge page setting and its C library. Every other module
asks here (``tests/test_structure.py`` holds the rule), so each fact is read one way everywhere. Reads nothing
until asked, imports nothing heavy.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
MEMINFO = Path("/proc/meminfo")
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
#: a cgroup v2 memory limit and use, where this process runs in one
CGROUP_MEMORY = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current"))


def machine() -> str:
    """The architecture: ``x86_64``, ``aarch64``."""
    return platform.machine()


def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags as ``/proc/cpuinfo`` names them (``flags`` on x86-64, ``Features`` on Arm);
    empty where there is no ``/proc`` (not Linux)."""
    flags: set[str] = set()
    try:
        for line in CPUINFO.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                flags.update(value.split())
    except OSError:
        pass
    return frozenset(flags)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what the platform says."""
    try:
        for line in CPUINFO.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or ""


def usable_cpu_ids() -> list[int]:
    """The CPUs this process may run on (its affinity mask), sorted; empty where the system has no such mask."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return []


def usable_cpus() -> int:
    """How many CPUs this process may run on (its affinity mask; the logical CPU count where there is none)."""
    return len(usable_cpu_ids()) or logical_cpus()


def logical_cpus() -> int:
    """The machine's logical CPUs, whatever this process may use."""
    return os.cpu_count() or 1


def total_memory() -> int | None:
    """The machine's physical memory in bytes (None where unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def available_memory() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` in bytes (None where unknown), capped by a cgroup v2 limit."""
    available = None
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    try:
        limit = CGROUP_MEMORY[0].read_text().strip()
        used = int(CGROUP_MEMORY[1].read_text().strip())
        if limit != "max" and available is not None:
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return available


def thp_setting(source: Path = THP_SETTING) -> str:
    """The system's transparent huge page setting (``always``, ``madvise``, ``never``) as ``source`` (the kernel's
    file) says, or why there is none (``not Linux``, ``unavailable``)."""
    if not sys.platform.startswith("linux"):
        return "not Linux"
    try:
        text = Path(source).read_text()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unavailable"


def glibc_version() -> tuple[int, int] | None:
    """The running glibc's (major, minor), None for another C library."""
    name, version = platform.libc_ver()
    if name != "glibc" or not version:
        return None
    major, _, minor = version.partition(".")
    try:
        return int(major), int(minor.split(".")[0] or 0)
    except ValueError:
        return None


def describe() -> dict[str, object]:
    """CPU model, logical CPUs, total memory, OS and load: the machine section of a report."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"cpu": cpu_model(), "logical_cpus": logical_cpus(), "memory_bytes": total_memory(),
            "platform": platform.platform(), "loadavg_at_start": list(load) if load else None}
