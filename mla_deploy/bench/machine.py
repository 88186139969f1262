"""This machine's limits, measured in the same run as the timings, and process memory bookkeeping.

* Read bandwidth: the best the machine reaches, the fastest of several kernels streaming a large fp32 buffer
  (default 512 MiB, far beyond the last-level cache; anonymous memory advised to transparent huge pages where the
  kernel offers them) at the run's thread count: ``torch.sum``, ``torch.amax``, ``torch.mv`` (a matrix-vector
  product, as a batch-1 decode step reads a weight), ``numpy.sum``, ``torch.copy_`` (read plus write bytes), and
  ``torch.sum`` and ``torch.mv`` with the rows split over the threads, each thread pinned to its own CPU; bytes /
  the fastest call, and which kernel it was. A bound must not be beaten by an engine, so each kernel counts its
  fastest call and the reports their best probe (:func:`~.reporting.bound_rates`).
* Matrix-multiply rate: ``torch.mm`` of two fp32 2048 x 2048 matrices at the same thread count.
* Peak process memory of one point: the kernel's high-water mark ``VmHWM``, reset before the point by writing
  ``5`` to ``/proc/self/clear_refs`` (Linux); where that is impossible, ``ru_maxrss`` (peak since the process
  started), flagged as such.
"""

from __future__ import annotations

import os
import re
import resource
import time

from ..host import usable_cpu_ids

GEMM_N = 2048
#: Linux's madvise advice that collapses a range into huge pages now (6.1+; Python's mmap has no name for it)
MADV_COLLAPSE = 25
#: columns of the matrix the matrix-vector read kernel streams
READ_COLUMNS = 4096


def _region(nbytes: int):
    """``(fp32 tensor over nbytes of anonymous memory, the mmap behind it, whether huge pages were advised)``:
    the memory is advised to transparent huge pages (``MADV_HUGEPAGE``) where the platform offers it, then
    written, so its pages exist before any timing, then collapsed (``MADV_COLLAPSE``) so that pages a fault could
    not get as huge ones are huge too. Without it, the same probe gave 37 GB/s in one run and 64 GB/s in the next
    on the development machine; huge pages missing for part of the buffer would explain that, but it was not
    traced."""
    import mmap

    import torch

    region = mmap.mmap(-1, nbytes, flags=getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0))
    huge = False
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
            huge = True
        except OSError:  # a kernel without transparent huge pages
            pass
    buf = torch.frombuffer(region, dtype=torch.float32)
    buf.fill_(1.0)
    if huge:  # pages the fault could not get as huge ones (fragmented memory) are collapsed now: Linux 6.1+
        try:
            region.madvise(MADV_COLLAPSE)
        except OSError:  # an older kernel, or no huge page free: the bound says which pages it had
            pass
    return buf, region, huge


class PinnedThreads:
    """``n`` threads, thread ``i`` pinned to the ``i``-th CPU this process may use (Linux; elsewhere unpinned):
    :meth:`run` gives each one call and returns when all have finished."""

    def __init__(self, n: int):
        import queue
        import threading

        cpus = usable_cpu_ids()
        self._jobs = [queue.SimpleQueue() for _ in range(n)]
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(n):
            cpu = cpus[i % len(cpus)] if cpus else None
            threading.Thread(target=self._loop, args=(self._jobs[i], cpu), daemon=True).start()

    def _loop(self, jobs, cpu: int | None) -> None:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})  # 0: the calling thread
        while (call := jobs.get()) is not None:
            try:
                call()
                self._done.put(None)
            except BaseException as error:  # handed to run()'s caller
                self._done.put(error)

    @property
    def size(self) -> int:
        return len(self._jobs)

    def run(self, calls: list) -> None:
        """Run ``calls[i]`` on thread ``i`` (at most one call per thread); re-raise the first failure."""
        assert len(calls) <= self.size
        for jobs, call in zip(self._jobs, calls):
            jobs.put(call)
        errors = [self._done.get() for _ in calls]
        failed = next((e for e in errors if e is not None), None)
        if failed is not None:
            raise failed

    def close(self) -> None:
        for jobs in self._jobs:
            jobs.put(None)


def _read_kernels(buf, pool: PinnedThreads | None) -> dict:
    """``{name: (call, bytes it moves)}``: ways to stream ``buf`` (fp32, 1-D) through the cores. A reduction
    reads it once; a matrix-vector product (what a batch-1 decode step does with each weight) reads it as a
    ``[rows, 4096]`` matrix; a copy reads one half and writes the other (both halves' bytes counted). With
    ``pool``, the sum and the matrix-vector product again with the rows split into one part per pinned thread,
    each part read by its thread alone (torch's own threads set to 1 meanwhile)."""
    import torch

    n = buf.numel() - buf.numel() % (2 * READ_COLUMNS)
    matrix, vector = buf[:n].view(-1, READ_COLUMNS), torch.ones(READ_COLUMNS)
    source, target = buf[: n // 2], buf[n // 2: n]
    array = buf.numpy()
    kernels = {"torch.sum": (buf.sum, buf.numel() * 4), "torch.amax": (buf.amax, buf.numel() * 4),
               "torch.mv": (lambda: torch.mv(matrix, vector), n * 4),
               "numpy.sum": (array.sum, buf.numel() * 4), "torch.copy_": (lambda: target.copy_(source), n * 4)}
    if pool is None:
        return kernels
    parts = matrix.chunk(pool.size)
    for name, reduce in (("torch.sum", torch.sum), ("torch.mv", lambda part: torch.mv(part, vector))):
        calls = [lambda part=part, reduce=reduce: reduce(part) for part in parts]
        kernels[f"{name} x{len(parts)} pinned"] = (lambda calls=calls: _one_thread_each(pool, calls), n * 4)
    return kernels


def _one_thread_each(pool: PinnedThreads, calls: list) -> None:
    """Run ``calls`` on ``pool``'s threads with torch's intra-op threads set to 1 (each thread reads its part)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pool.run(calls)
    finally:
        torch.set_num_threads(threads)


def _best_seconds(call, reps: int) -> tuple[float, float]:
    """``(fastest, median)`` time of ``reps`` calls of ``call``, after one untimed."""
    call()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times), _median(times)


def read_bandwidth(threads: int, probe_mib: int = 512, reps: int = 5) -> dict:
    """The best read bandwidth of :func:`_read_kernels` over a ``probe_mib`` buffer with ``threads`` threads.

    Returns: ``{"read_gbps" (the fastest kernel's fastest call), "read_kernel", "read_kernels",
    "read_gbps_by_kernel" (each kernel's fastest call), "read_median_gbps_by_kernel", "read_mib",
    "huge_pages" (whether the buffer was advised to huge pages), "pinned_threads"}`` (1 GB = 1e9 bytes)."""
    import torch

    torch.set_num_threads(threads)
    buf, region, huge = _region(probe_mib * (1 << 20))
    pool = PinnedThreads(threads) if threads > 1 else None
    try:
        timed = {name: (nbytes, _best_seconds(call, reps)) for name, (call, nbytes) in _read_kernels(buf, pool).items()}
    finally:
        if pool is not None:
            pool.close()
        del buf
        region.close()
    best = {name: nbytes / seconds[0] / 1e9 for name, (nbytes, seconds) in timed.items()}
    fastest = max(best, key=best.get)
    return {"read_gbps": best[fastest], "read_kernel": fastest, "read_kernels": list(best),
            "read_gbps_by_kernel": {k: round(v, 2) for k, v in best.items()},
            "read_median_gbps_by_kernel": {k: round(nbytes / s[1] / 1e9, 2) for k, (nbytes, s) in timed.items()},
            "read_mib": probe_mib, "huge_pages": huge, "pinned_threads": pool is not None}


def probe(threads: int, probe_mib: int = 512, reps: int = 5) -> dict:
    """One bandwidth probe (:func:`read_bandwidth`) and one GEMM probe, after 0.2 s idle, with torch's threads
    set to ``threads``.

    The read bandwidth is the best the machine reaches: the fastest call of the fastest of several kernels (one
    kernel alone underestimates the memory: a plain ``torch.sum`` read 26.9 GB/s where llama.cpp streamed 34).

    The int8 GEMM rate (``torch._int_mm``, int8 x int8 -> int32: oneDNN's VNNI kernels where the CPU has them) bounds
    the steps of quantized artifacts, whose products ONNX Runtime computes with int8 activations: on an AVX-512 VNNI
    machine they run several times faster than any fp32 GEMM, so the fp32 rate would be no bound for them.

    Returns: :func:`read_bandwidth`'s fields and ``"gemm_gflops", "gemm_n", "int8_gemm_gops"`` (None where torch
    has no int8 product on this CPU).
    """
    import torch

    torch.set_num_threads(threads)
    time.sleep(0.2)
    read = read_bandwidth(threads, probe_mib, reps)
    n = GEMM_N if probe_mib >= 256 else GEMM_N // 2  # small probes (smoke tests): a quicker GEMM too
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen)
    b = torch.randn(n, n, generator=gen)
    calls = max(3, reps // 2)
    gemm = 2 * n ** 3 / _best_seconds(lambda: a @ b, calls)[0] / 1e9
    return {**read, "gemm_gflops": gemm, "gemm_n": n, "int8_gemm_gops": _int8_gemm(n, calls)}


def _int8_gemm(n: int, calls: int) -> float | None:
    """The fastest int8 ``n x n x n`` product (``torch._int_mm``) in GOP/s, or None where torch has none here."""
    import torch

    gen = torch.Generator().manual_seed(1)
    a = torch.randint(-128, 128, (n, n), generator=gen, dtype=torch.int8)
    b = torch.randint(-128, 128, (n, n), generator=gen, dtype=torch.int8)
    try:
        return 2 * n ** 3 / _best_seconds(lambda: torch._int_mm(a, b), calls)[0] / 1e9
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


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
