"""What a decode step must read and compute, per point, and how much memory each path needs.

The roofline bound of a point is the same for every path: the decode step of the benched unit done the
minimal way (absorbed MLA: read every weight once and the latent cache once; the matrix FLOPs of the
projections plus the score product over ``[c_kv | k_pe]`` (C wide) and the weighted sum over ``c_kv``
(r wide), over the ``T + 1`` attended rows):

    t_mem  = (weight bytes + B * T * C * itemsize) * layers / measured read bandwidth
    t_flop = FLOPs / measured fp32 GEMM rate
    bound  = max(t_mem, t_flop)

Each path also gets its FLOPs as implemented (the naive path re-expands K/V from the whole latent every
step; the absorbed graphs compute the weighted sum over the full C-wide rows, the static one over every slot
of its capacity), for the report only.
"""

from __future__ import annotations

from ...config import MLAConfig
from ...weight_bytes import PROCESS_OVERHEAD
from ..bound import attention_flops
from .spec import fixed_capacity

FP32 = 4
GIB = float(1 << 30)


def matrix_params(c: MLAConfig) -> int:
    """Matrix parameters of one attention layer (q path, kv_a, W_UK + W_UV = kv_b, o_proj)."""
    h = c.num_attention_heads
    q = c.hidden_size * h * c.qk_head_dim if c.q_lora_rank is None else \
        c.hidden_size * c.q_lora_rank + c.q_lora_rank * h * c.qk_head_dim
    kv_a = c.hidden_size * c.latent_dim
    kv_b = c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim)
    o = h * c.v_head_dim * c.hidden_size
    return q + kv_a + kv_b + o


def layer_params(c: MLAConfig) -> int:
    """Every parameter of one attention layer (matrices plus RMSNorm scales)."""
    return matrix_params(c) + c.kv_lora_rank + (c.q_lora_rank or 0)


def cache_bytes_per_token(c: MLAConfig, path: str, itemsize: int = FP32) -> int:
    """Cache bytes one token occupies in one layer: the latent row (C), or per-head K and V for the CD form."""
    if path == "torch-cd":
        return c.num_attention_heads * (c.qk_head_dim + c.v_head_dim) * itemsize
    return c.latent_dim * itemsize


def step_cost(c: MLAConfig, layers: int, context: int, batch: int, itemsize: int = FP32) -> dict[str, float]:
    """The minimal decode step: ``bytes`` to read and matrix ``flops``, for ``layers`` layers."""
    rows = context + 1
    weights = layer_params(c) * itemsize
    cache = batch * context * c.latent_dim * itemsize
    flops = 2 * batch * matrix_params(c) + attention_flops(c, batch * rows)
    return {"weight_bytes": layers * weights, "cache_bytes": layers * cache,
            "bytes": layers * (weights + cache), "flops": layers * flops}


def implemented_flops(c: MLAConfig, path: str, layers: int, context: int, batch: int, capacity: int) -> float:
    """Matrix FLOPs of one step as ``path`` computes it."""
    h, rows = c.num_attention_heads, context + 1
    proj = 2 * batch * matrix_params(c)
    if path.startswith("hf-"):
        expand = 2 * batch * rows * c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim)
        attn = 2 * batch * h * rows * (c.qk_head_dim + c.v_head_dim)
        return layers * (proj + expand + attn)
    if path == "torch-cd":
        return layers * (proj + 2 * batch * h * rows * (c.qk_head_dim + c.v_head_dim))
    slots = capacity if fixed_capacity(path) else rows
    return layers * (proj + 2 * batch * h * slots * 2 * c.latent_dim)


def memory_estimate(c: MLAConfig, path: str, layers: int, context: int, batch: int, capacity: int) -> int:
    """Bytes a worker needs for one point of ``path`` (weights, caches, the step's transients), roughly."""
    h = c.num_attention_heads
    weights = layers * layer_params(c) * FP32
    latent_layer = batch * context * c.latent_dim * FP32
    latent = layers * latent_layer
    if path.startswith("hf-"):
        expanded = batch * (context + 1) * h * (c.qk_nope_head_dim + c.v_head_dim + c.qk_head_dim + c.v_head_dim) * FP32
        need = 2 * latent + latent_layer + expanded
    elif path == "torch-cd":
        cd = layers * batch * context * cache_bytes_per_token(c, path)
        need = 2 * cd + latent_layer + batch * context * h * (c.qk_nope_head_dim + c.v_head_dim) * FP32
    elif path == "torch-absorbed":
        need = 2 * latent + batch * (context + 1) * h * 2 * FP32
    elif fixed_capacity(path):  # ORT static, TensorRT host side
        need = layers * batch * capacity * c.latent_dim * FP32 + latent_layer + 2 * weights
    else:  # ORT concat
        need = 2 * latent + latent_layer + 2 * weights
    return int(weights + need + PROCESS_OVERHEAD)
