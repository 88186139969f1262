"""This machine's limits, measured in the same run as the timings, and process memory bookkeeping.

* Read bandwidth: ``torch.sum`` over a large fp32 buffer (default 512 MiB, far beyond the last-level cache),
  at the run's thread count; bytes read / seconds.
* Matrix-multiply rate: ``torch.mm`` of two fp32 2048 x 2048 matrices at the same thread count.
* Peak process memory of one point: the kernel's high-water mark ``VmHWM``, reset before the point by writing
  ``5`` to ``/proc/self/clear_refs`` (Linux); where that is impossible, ``ru_maxrss`` (peak since the process
  started), flagged as such.
"""

from __future__ import annotations

import os
import platform
import re
import resource
import time

GEMM_N = 2048


def probe(threads: int, probe_mib: int = 512, reps: int = 5) -> dict[str, float]:
    """One bandwidth probe and one GEMM probe (each the median of ``reps`` calls), after 0.2 s idle.

    Returns: ``{"read_gbps": ..., "gemm_gflops": ...}`` (1 GB = 1e9 bytes).
    """
    import torch

    torch.set_num_threads(threads)
    time.sleep(0.2)
    buf = torch.ones(probe_mib * (1 << 20) // 4, dtype=torch.float32)
    buf.sum()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - start)
    read = buf.numel() * 4 / _median(times) / 1e9
    del buf
    n = GEMM_N if probe_mib >= 256 else GEMM_N // 2  # small probes (smoke tests): a quicker GEMM too
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen)
    b = torch.randn(n, n, generator=gen)
    a @ b
    times = []
    for _ in range(max(3, reps // 2)):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    gemm = 2 * n ** 3 / _median(times) / 1e9
    return {"read_gbps": read, "gemm_gflops": gemm, "gemm_n": n, "read_mib": probe_mib}


def summarize(values, unit: str | None = None) -> dict | None:
    """``{"median", "min", "max", "n"}`` of ``values`` (plus ``unit`` and the rounded ``samples`` when a unit is
    given), as bench reports show a probe; None when there are none."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    out = {"median": _median(values), "min": min(values), "max": max(values), "n": len(values)}
    if unit:
        out.update(unit=unit, samples=[round(v, 2) for v in values])
    return out


def _median(values):
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def available_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` (None where unknown), capped by a cgroup v2 limit."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        return None
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        used = int(open("/sys/fs/cgroup/memory.current").read().strip())
        if limit != "max" and avail is not None:
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail


def reset_peak() -> bool:
    """Reset this process's peak-RSS mark; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_bytes() -> int:
    """This process's peak resident memory: ``VmHWM`` (since the last :func:`reset_peak`), else ``ru_maxrss``."""
    try:
        status = open("/proc/self/status").read()
        match = re.search(r"VmHWM:\s+(\d+)\s+kB", status)
        if match:
            return int(match.group(1)) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def describe() -> dict[str, object]:
    """CPU model, logical CPUs, total memory, OS: for the report."""
    model = platform.processor() or ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    total = None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"cpu": model, "logical_cpus": os.cpu_count(), "memory_bytes": total, "platform": platform.platform(),
            "loadavg_at_start": list(load) if load else None}


def package_version(name: str) -> str | None:
    """The version of the installed package ``name`` (``"?"`` when it has none), None when it does not import."""
    try:
        module = __import__(name)
    except Exception:  # not installed, or its libraries do not load
        return None
    return getattr(module, "__version__", "?")


def load_average() -> float | None:
    """The 1-minute load average (other processes competing for the cores show up here)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def prefer_as_oom_victim() -> None:
    """Should a measurement exhaust memory after all, let the kernel kill this worker rather than another process."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
