"""The cost model both benches share: a step's roofline bound from the bytes it must read and the FLOPs it
must compute at this machine's measured rates (:func:`~.machine.probe`), and the FLOPs of absorbed MLA attention.

    t_mem  = bytes / measured read bandwidth
    t_flop = FLOPs / measured fp32 GEMM rate
    bound  = max(t_mem, t_flop)
"""

from __future__ import annotations

from ..config import MLAConfig


def attention_flops(c: MLAConfig, rows: int) -> int:
    """FLOPs of one layer's absorbed attention core over ``rows`` (query, cached row) pairs: the scores over
    ``[c_kv | k_pe]`` (C wide) and the weighted sum over ``c_kv`` (r wide), every head."""
    return 2 * c.num_attention_heads * rows * (c.latent_dim + c.kv_lora_rank)


def roofline(nbytes: float, flops: float, read_gbps: float, gemm_gflops: float) -> dict:
    """The bound of a step reading ``nbytes`` and computing ``flops`` at the measured bandwidth (GB/s) and GEMM
    rate (GFLOP/s): ``{"t_mem_ms", "t_flop_ms", "bound_ms", "bound": "memory" | "compute"}``."""
    t_mem = nbytes / (read_gbps * 1e9)
    t_flop = flops / (gemm_gflops * 1e9)
    return {"t_mem_ms": t_mem * 1e3, "t_flop_ms": t_flop * 1e3, "bound_ms": max(t_mem, t_flop) * 1e3,
            "bound": "memory" if t_mem >= t_flop else "compute"}


def check_bound(achieved: dict[str, tuple[float, float]], read_gbps: float, gemm_gflops: float | None) -> dict:
    """Whether the bound held in a run: no engine may stream more bytes per second than the measured read
    bandwidth, nor compute more FLOPs per second than the measured GEMM rate.

    Args:
        achieved: ``{label: (GB/s, GFLOP/s)}``: the bytes (FLOPs) a measured step must read (compute) over its
            time, per engine and point (``label`` as the report names them).
        gemm_gflops: None: FLOPs are not checked (an engine whose FLOPs are not counted).
    Returns:
        ``{"holds", "read_gbps", "gemm_gflops", "fastest" (the label streaming the most), "fastest_gbps",
        "beaten_by": [{"label", "gbps", "gflops"}]}``.
    """
    beaten = [{"label": label, "gbps": gbps, "gflops": gflops} for label, (gbps, gflops) in achieved.items()
              if gbps > read_gbps or (gemm_gflops is not None and gflops > gemm_gflops)]
    fastest = max(achieved, key=lambda label: achieved[label][0]) if achieved else None
    return {"holds": not beaten, "read_gbps": read_gbps, "gemm_gflops": gemm_gflops, "fastest": fastest,
            "fastest_gbps": achieved[fastest][0] if fastest else None, "beaten_by": beaten}


def bound_check_line(check: dict) -> str:
    """One line saying whether :func:`check_bound` held, plainly (``int8_gemm_gops``, where the check has it: the
    rate the quantized artifacts' steps were checked against)."""
    gemm, int8 = check["gemm_gflops"], check.get("int8_gemm_gops")
    rates = f"{check['read_gbps']:.1f} GB/s" + (f" and GEMM rate {gemm:.0f} GFLOP/s" if gemm is not None else "")
    if int8 is not None and gemm is not None and int8 != gemm:
        rates += f" (int8 {int8:.0f} GOP/s for the quantized artifacts)"
    if check["holds"]:
        fastest = (f"; the fastest, {check['fastest']}, streamed {check['fastest_gbps']:.1f} GB/s"
                   if check["fastest"] else "")
        return f"bound check: the measured read bandwidth {rates} bound every measured step{fastest}"
    worst = max(check["beaten_by"], key=lambda b: b["gbps"])
    return (f"THE BOUND DID NOT HOLD in this run: {len(check['beaten_by'])} measured step(s) went faster than it, "
            f"e.g. {worst['label']} streamed {worst['gbps']:.1f} GB/s against the measured {rates}; the bound "
            f"and the achieved/bound ratios of this run understate the machine (or the step's bytes stayed in "
            f"the caches)")
