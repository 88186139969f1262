"""The cost model both benches share: a step's roofline bound from the bytes it must read and the FLOPs it
must compute at this machine's measured rates (:func:`~.machine.probe`), the FLOPs of absorbed MLA attention,
and the memory a worker process needs besides its tensors.

    t_mem  = bytes / measured read bandwidth
    t_flop = FLOPs / measured fp32 GEMM rate
    bound  = max(t_mem, t_flop)
"""

from __future__ import annotations

from ..config import MLAConfig

#: memory every worker process needs besides the tensors a bench counts (interpreter, torch, ONNX Runtime)
PROCESS_OVERHEAD = 600 << 20


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
