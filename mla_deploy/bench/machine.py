"""This machine's limits, measured in the same run as the timings, and process memory bookkeeping.

* Read bandwidth: the fastest of several kernels streaming a large fp32 buffer (default 512 MiB, far beyond the
  last-level cache) at the run's thread count: ``torch.sum``, ``torch.amax``, ``torch.mv`` (a matrix-vector
  product, as a batch-1 decode step reads a weight), ``numpy.sum``, ``torch.copy_`` (read plus write bytes);
  bytes / seconds, and which kernel it was.
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
#: columns of the matrix the matrix-vector read kernel streams
READ_COLUMNS = 4096


def _read_kernels(buf) -> dict:
    """``{name: (call, bytes it moves)}``: ways to stream ``buf`` (fp32, 1-D) through the cores. A reduction
    reads it once; a matrix-vector product (what a batch-1 decode step does with each weight) reads it as a
    ``[rows, 4096]`` matrix; a copy reads one half and writes the other (both halves' bytes counted)."""
    import torch

    n = buf.numel() - buf.numel() % (2 * READ_COLUMNS)
    matrix, vector = buf[:n].view(-1, READ_COLUMNS), torch.ones(READ_COLUMNS)
    source, target = buf[: n // 2], buf[n // 2: n]
    array = buf.numpy()
    return {"torch.sum": (buf.sum, buf.numel() * 4), "torch.amax": (buf.amax, buf.numel() * 4),
            "torch.mv": (lambda: torch.mv(matrix, vector), n * 4), "numpy.sum": (array.sum, buf.numel() * 4),
            "torch.copy_": (lambda: target.copy_(source), n * 4)}


def _seconds(call, reps: int) -> float:
    """The median time of ``reps`` calls of ``call``, after one untimed."""
    call()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return _median(times)


def probe(threads: int, probe_mib: int = 512, reps: int = 5) -> dict:
    """One bandwidth probe and one GEMM probe, after 0.2 s idle, with torch's threads pinned to ``threads``.

    The read bandwidth is the fastest of several kernels streaming a ``probe_mib`` buffer (far beyond the
    last-level cache; each the median of ``reps`` calls; see :func:`_read_kernels`): one kernel alone
    underestimates what the memory gives (a plain ``torch.sum`` read 26.9 GB/s where llama.cpp streamed 34).

    Returns: ``{"read_gbps", "read_kernel" (the fastest), "read_kernels", "read_gbps_by_kernel", "read_mib",
    "gemm_gflops", "gemm_n"}`` (1 GB = 1e9 bytes).
    """
    import torch

    torch.set_num_threads(threads)
    time.sleep(0.2)
    buf = torch.ones(probe_mib * (1 << 20) // 4, dtype=torch.float32)
    rates = {name: nbytes / _seconds(call, reps) / 1e9 for name, (call, nbytes) in _read_kernels(buf).items()}
    del buf
    best = max(rates, key=rates.get)
    n = GEMM_N if probe_mib >= 256 else GEMM_N // 2  # small probes (smoke tests): a quicker GEMM too
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen)
    b = torch.randn(n, n, generator=gen)
    gemm = 2 * n ** 3 / _seconds(lambda: a @ b, max(3, reps // 2)) / 1e9
    return {"read_gbps": rates[best], "read_kernel": best, "read_kernels": list(rates),
            "read_gbps_by_kernel": {k: round(v, 2) for k, v in rates.items()}, "read_mib": probe_mib,
            "gemm_gflops": gemm, "gemm_n": n}


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
