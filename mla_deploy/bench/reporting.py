"""What both benches' reports share: the machine section (its description and the probes taken during the
run), the package versions, number formats, and writing the report files atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

from .machine import package_version, summarize


def format_ms(value: float) -> str:
    return f"{value:.2f}" if value >= 0.1 else f"{value:.3g}"


def format_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def versions(names: tuple[str, ...]) -> dict[str, str | None]:
    """``{"mla_deploy": ..., name: version or None}`` for each package in ``names``."""
    from .. import __version__

    return {"mla_deploy": __version__, **{name: package_version(name) for name in names}}


def machine_summary(described: dict, threads: int, probes: list[dict], when: str) -> dict:
    """The report's ``machine``: ``described`` (:func:`mla_deploy.host.describe` at the start), the thread count, and
    the read bandwidth, GEMM rate and load average over ``probes`` (:func:`~.machine.probe`'s, taken ``when``)."""
    info = dict(described)
    info["threads"] = threads
    info["read_gbps"] = summarize([p["read_gbps"] for p in probes], "GB/s")
    info["gemm_gflops"] = summarize([p["gemm_gflops"] for p in probes], "GFLOP/s")
    info["int8_gemm_gops"] = summarize([p.get("int8_gemm_gops") for p in probes], "GOP/s")
    info["loadavg_1min_during_run"] = summarize([p.get("loadavg_1min") for p in probes])
    first = probes[0] if probes else {}
    kernels = sorted({p["read_kernel"] for p in probes if p.get("read_kernel")})
    pages = {"huge pages advised" if p.get("huge_pages") else "normal pages" for p in probes if "huge_pages" in p}
    info["read_probe"] = (f"the fastest call of the fastest of {', '.join(first.get('read_kernels', ['torch.sum']))} "
                          f"over {first.get('read_mib', '?')} MiB ({', '.join(sorted(pages)) or 'normal pages'}), "
                          f"{threads} threads, 5 calls each (read_kernel: the fastest, here "
                          f"{', '.join(kernels) or '-'}); {when}; the bound takes the best probe (max)")
    info["gemm_probe"] = (f"torch.mm fp32 {first.get('gemm_n', '?')}^3 and torch._int_mm int8 (the rate of quantized "
                          f"artifacts' steps, whose products compute with int8 activations), {threads} threads, the "
                          f"fastest of 3 calls each, same times; the bound takes the best probe (max)")
    info["loadavg_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return info


#: the probe whose rate bounds the FLOPs of each arithmetic (:attr:`mla_deploy.quant.Quantization.arithmetic`)
GEMM_PROBES = {"fp32": "gemm_gflops", "int8": "int8_gemm_gops"}


def bound_rates(machine: dict, arithmetic: str = "fp32") -> tuple[float, float] | None:
    """``(read GB/s, GEMM rate in G(FL)OP/s)`` a report's bounds use: the best of the run's probes (a bound is the
    best the machine reaches), from :func:`machine_summary`'s ``machine``; None when no probe ran.

    ``arithmetic``: that of the step's products (a quantized artifact's: ``int8``, activations quantized per block):
    its GEMM rate where it was measured and is the faster (a looser bound, as it must be for the fp32 parts of such
    a step), else the fp32 one."""
    bw, gemm = machine.get("read_gbps"), machine.get("gemm_gflops")
    if not (bw and gemm):
        return None
    own = machine.get(GEMM_PROBES.get(arithmetic, "gemm_gflops"))
    return bw["max"], max(gemm["max"], own["max"]) if own else gemm["max"]


def machine_line(report: dict) -> str:
    """One line: the CPU, the threads, the measured bandwidth and GEMM rate, the load average during the run."""
    m = report["machine"]
    bw, gemm = m.get("read_gbps"), m.get("gemm_gflops")
    text = f"{m['cpu']}, {m['threads']} threads"
    if bw and gemm:
        text += (f"; read bandwidth {bw['max']:.1f} GB/s, the best of {bw['n']} probes (median {bw['median']:.1f}, min "
                 f"{bw['min']:.1f}); fp32 GEMM {gemm['max']:.0f} GFLOP/s (median {gemm['median']:.0f}, min "
                 f"{gemm['min']:.0f})")
        int8 = m.get("int8_gemm_gops")
        if int8:
            text += f"; int8 GEMM {int8['max']:.0f} GOP/s (median {int8['median']:.0f}, quantized artifacts' bound)"
        text += "; the bounds take the best"
    if m.get("loadavg_1min_during_run"):
        load = m["loadavg_1min_during_run"]
        text += (f"; 1-min load average during the run {load['median']:.2f} (min {load['min']:.2f}, max "
                 f"{load['max']:.2f}; {m['threads']} threads of this bench count toward it)")
    return text


def write_outputs(report: dict, out: Path, to_markdown: Callable[[dict], str],
                  to_plot: Callable[[dict, Path], None] | None = None) -> dict[str, Path]:
    """Write bench.json, bench.md (``to_markdown(report)``) and, with ``to_plot(report, path)``, bench.png into
    ``out``: each to a temporary name, then renamed."""
    from ..artifact import atomic_file, atomic_write_text

    files = {"bench.json": atomic_write_text(out / "bench.json", json.dumps(report, indent=2) + "\n"),
             "bench.md": atomic_write_text(out / "bench.md", to_markdown(report))}
    if to_plot is None:
        return files
    with atomic_file(out / "bench.png") as tmp:
        to_plot(report, tmp)
    files["bench.png"] = out / "bench.png"
    return files
