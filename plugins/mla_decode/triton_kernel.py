"""Split-K flash decoding over the MLA latent cache, in Triton.

Every query head attends the same latent rows (one KV "head", ``C = r + dr`` wide), so a program takes a
block of ``BLOCK_H`` query rows and one slice ("split") of a sequence's cache, streams that slice in tiles
of ``BLOCK_N`` rows, and keeps an online softmax in float32:

* stage 1 (:func:`_split_kernel`), grid ``(B, cdiv(H*S, BLOCK_H), splits)``: scores
  ``q_lat . c_kv^T + q_pe . k_pe^T`` (two dots, float32 accumulation), scaled, masked beyond the row's valid
  length; writes the split's normalised partial output ``[B, H*S, splits, r]`` and its log-sum-exp
  (base 2) ``[B, H*S, splits]``, both float32.
* stage 2 (:func:`_reduce_kernel`), grid ``(B, H*S)``: combines the splits by their log-sum-exp and writes
  ``[B, H*S, r]`` in the query's dtype. With one split it does not run: stage 1 (``FINAL``) normalises and
  writes ``[B, H*S, r]`` itself, which saves a launch and the float32 round trip of the partials.

Each sequence's length is clamped to ``[0, T]`` on the device before it bounds any read: the length tensor
comes from the caller (a graph input, a serving loop), and an oversized or garbage value must not turn into a
read past the cache's allocation.

Each sequence's split length is computed on the device from its own ``lengths[b]``, so no host sync is
needed and short sequences in a long static cache still spread over all splits.

Run on an NVIDIA GPU with CUDA tensors, or, for testing the kernel logic, under Triton's interpreter
(``TRITON_INTERPRET=1`` set before this module is imported) with CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import as_rows

MAX_SPLITS = 64


@triton.jit
def _split_kernel(q_ptr, cache_ptr, lengths_ptr, part_ptr, lse_ptr,
                  stride_qb, stride_qm, stride_cb, stride_ct, stride_pb, stride_pm, stride_ps,
                  stride_lb, stride_lm, M, T, STEPS, NUM_SPLITS, scale_log2,
                  R: tl.constexpr, P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  FINAL: tl.constexpr):
    b = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # query rows h*S + s
    split = tl.program_id(2)
    row_ok = rows < M
    # Clamped in the loaded dtype (an int64 garbage value must not wrap into range) to the capacity T: the
    # cache rows read are always rows [0, T) of this sequence, whatever the caller passed.
    length = tl.minimum(tl.maximum(tl.load(lengths_ptr + b), 0), T).to(tl.int32)
    limit = length - STEPS + 1 + rows % STEPS  # [BLOCK_H]: slots < limit are visible
    chunk = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, length)

    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    q_rows = q_ptr + b * stride_qb + rows[:, None] * stride_qm
    q_lat = tl.load(q_rows + offs_r[None, :], mask=row_ok[:, None] & (offs_r[None, :] < R), other=0.0)
    q_pe = tl.load(q_rows + R + offs_p[None, :], mask=row_ok[:, None] & (offs_p[None, :] < P), other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        c_rows = cache_ptr + b * stride_cb + offs_n[:, None] * stride_ct
        c_kv = tl.load(c_rows + offs_r[None, :], mask=n_ok[:, None] & (offs_r[None, :] < R), other=0.0)
        k_pe = tl.load(c_rows + R + offs_p[None, :], mask=n_ok[:, None] & (offs_p[None, :] < P), other=0.0)
        s = tl.dot(q_lat, tl.trans(c_kv), input_precision=DOT_PRECISION)
        s = tl.dot(q_pe, tl.trans(k_pe), acc=s, input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N] fp32
        s = s * scale_log2
        seen = (offs_n[None, :] < limit[:, None]) & n_ok[None, :]
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet stays at 0
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c_kv.dtype), c_kv, input_precision=DOT_PRECISION)
        m_i = m_new

    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    part = part_ptr + b * stride_pb + rows[:, None] * stride_pm + split * stride_ps + offs_r[None, :]
    tl.store(part, out.to(part_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_r[None, :] < R))
    if not FINAL:
        tl.store(lse_ptr + b * stride_lb + rows * stride_lm + split, lse, mask=row_ok)


@triton.jit
def _reduce_kernel(part_ptr, lse_ptr, out_ptr, stride_pb, stride_pm, stride_ps, stride_lb, stride_lm,
                   stride_ob, stride_om, NUM_SPLITS, R: tl.constexpr, BLOCK_R: tl.constexpr):
    b = tl.program_id(0)
    m = tl.program_id(1)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    m_max = float("-inf")
    total = 0.0
    acc = tl.zeros([BLOCK_R], tl.float32)
    for split in range(0, NUM_SPLITS):
        lse = tl.load(lse_ptr + b * stride_lb + m * stride_lm + split)
        part = tl.load(part_ptr + b * stride_pb + m * stride_pm + split * stride_ps + offs_r, mask=r_ok, other=0.0)
        m_new = tl.maximum(m_max, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_max - m_safe)
        weight = tl.exp2(lse - m_safe)
        acc = acc * alpha + weight * part
        total = total * alpha + weight
        m_max = m_new
    out = acc / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + m * stride_om + offs_r, out.to(out_ptr.dtype.element_ty), mask=r_ok)


def choose_num_splits(batch: int, row_blocks: int, slots: int, block_n: int, programs: int) -> int:
    """Splits per sequence so that about ``programs`` stage-1 programs run, within ``[1, MAX_SPLITS]``.

    Args:
        batch: B. row_blocks: ``cdiv(H*S, BLOCK_H)``. slots: T (cache rows). block_n: rows per tile.
        programs: the wanted number of concurrent programs (e.g. 2 x the GPU's multiprocessors).
    """
    wanted = triton.cdiv(max(programs, 1), max(batch * row_blocks, 1))
    return max(1, min(wanted, triton.cdiv(max(slots, 1), block_n), MAX_SPLITS))


def _programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def mla_decode(q: torch.Tensor, cache: torch.Tensor, lengths: torch.Tensor, softmax_scale: float,
               kv_lora_rank: int, out: torch.Tensor | None = None, num_splits: int | None = None,
               block_h: int = 16, block_n: int = 16, num_warps: int = 4, num_stages: int = 2,
               single_pass: bool = True) -> torch.Tensor:
    """MLA decode attention with the Triton kernels (see the module docstring); matches
    :func:`.reference.mla_decode_reference`.

    Args:
        q: ``[B, H, C]`` or ``[B, H, S, C]``, float32/float16/bfloat16; channels contiguous.
        cache: ``[B, T, C]`` or ``[B, 1, T, C]``, q's dtype; channels contiguous (any row/batch strides).
        lengths: ``[B]`` int32 or int64, valid rows per sequence (this step's S rows included); the kernel
            clamps each to ``[0, T]``, so a wrong length gives a wrong answer but never a read outside the cache.
        softmax_scale: score multiplier. kv_lora_rank: r (values are channels ``[0, r)``).
        out: optional ``[B, H, r]`` / ``[B, H, S, r]`` contiguous output buffer of q's dtype.
        num_splits: splits per sequence (default: :func:`choose_num_splits`).
        block_h, block_n: query rows and cache rows per tile (powers of two, >= 16).
        num_warps, num_stages: Triton launch options (ignored by the interpreter).
        single_pass: with one split, let stage 1 write the output (``False`` keeps the reduce pass, for tests).
    Returns:
        ``out`` (or a new tensor): ``[B, H, r]`` or ``[B, H, S, r]`` in q's dtype.
    """
    q4, cache3, steps = as_rows(q, cache)
    batch, heads, _, width = q4.shape
    rank, rope = kv_lora_rank, width - kv_lora_rank
    if not 0 < rank < width:
        raise ValueError(f"kv_lora_rank {rank} must lie in (0, {width})")
    if cache3.dtype != q.dtype or lengths.dtype not in (torch.int32, torch.int64) or lengths.shape != (batch,):
        raise ValueError(f"cache must have q's dtype {q.dtype} and lengths be int32/int64 [B]; got "
                         f"{cache3.dtype}, {lengths.dtype} {tuple(lengths.shape)}")
    if cache3.stride(-1) != 1:
        raise ValueError("cache channels must be contiguous")
    rows = q4.reshape(batch, heads * steps, width).contiguous()  # row h*S + s
    m = heads * steps
    block_r, block_p = max(16, triton.next_power_of_2(rank)), max(16, triton.next_power_of_2(rope))
    splits = num_splits or choose_num_splits(batch, triton.cdiv(m, block_h), cache3.shape[1], block_n,
                                             _programs(q.device))
    shape = (*q4.shape[:-1], rank) if q.dim() == 4 else (batch, heads, rank)
    if out is None:
        out = torch.empty(shape, dtype=q.dtype, device=q.device)
    elif tuple(out.shape) != shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {q.dtype} tensor of shape {shape}")
    flat = out.view(batch, m, rank)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    final = splits == 1 and single_pass
    if final:  # stage 1 normalises and writes the output itself: no partials, no second launch
        part, lse, part_strides, lse_strides = flat, flat, (flat.stride(0), flat.stride(1), 0), (0, 0)
    else:
        part = torch.empty((batch, m, splits, rank), dtype=torch.float32, device=q.device)
        lse = torch.empty((batch, m, splits), dtype=torch.float32, device=q.device)
        part_strides, lse_strides = (part.stride(0), part.stride(1), part.stride(2)), (lse.stride(0), lse.stride(1))
    _split_kernel[(batch, triton.cdiv(m, block_h), splits)](
        rows, cache3, lengths, part, lse,
        rows.stride(0), rows.stride(1), cache3.stride(0), cache3.stride(1), *part_strides, *lse_strides,
        m, cache3.shape[1], steps, splits, float(softmax_scale) * 1.4426950408889634,
        R=rank, P=rope, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_P=block_p,
        DOT_PRECISION=precision, FINAL=final, num_warps=num_warps, num_stages=num_stages)
    if not final:
        _reduce_kernel[(batch, m)](
            part, lse, flat, *part_strides, *lse_strides, flat.stride(0), flat.stride(1), splits,
            R=rank, BLOCK_R=block_r, num_warps=4)
    return out


def compile_kernels(dtype: str = "bf16", arch: int = 90, kv_lora_rank: int = 512, rope_dim: int = 64,
                    block_h: int = 16, block_n: int = 16, num_warps: int = 4, num_stages: int = 2) -> dict:
    """Compile both kernels ahead of time for ``sm_<arch>`` (Triton's CUDA backend and its bundled ptxas; no GPU
    needed). Raises what Triton raises if a kernel does not compile. Not usable under the interpreter.

    Returns: ``{"split": CompiledKernel, "reduce": CompiledKernel}`` (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata``).
    """
    from triton.backends.compiler import GPUTarget

    elem = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}[dtype]
    target = GPUTarget("cuda", arch, 32)
    block_r, block_p = max(16, triton.next_power_of_2(kv_lora_rank)), max(16, triton.next_power_of_2(rope_dim))
    split_sig = {"q_ptr": f"*{elem}", "cache_ptr": f"*{elem}", "lengths_ptr": "*i64", "part_ptr": "*fp32",
                 "lse_ptr": "*fp32"}
    split_sig.update({n: "i32" for n in ("stride_qb", "stride_qm", "stride_cb", "stride_ct", "stride_pb",
                                         "stride_pm", "stride_ps", "stride_lb", "stride_lm", "M", "T", "STEPS",
                                         "NUM_SPLITS")})
    split_sig["scale_log2"] = "fp32"
    split_const = {"R": kv_lora_rank, "P": rope_dim, "BLOCK_H": block_h, "BLOCK_N": block_n, "BLOCK_R": block_r,
                   "BLOCK_P": block_p, "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32", "FINAL": False}
    split_sig.update({n: "constexpr" for n in split_const})
    reduce_sig = {"part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": f"*{elem}"}
    reduce_sig.update({n: "i32" for n in ("stride_pb", "stride_pm", "stride_ps", "stride_lb", "stride_lm",
                                          "stride_ob", "stride_om", "NUM_SPLITS")})
    reduce_const = {"R": kv_lora_rank, "BLOCK_R": block_r}
    reduce_sig.update({n: "constexpr" for n in reduce_const})
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return {
        "split": triton.compile(triton.compiler.ASTSource(fn=_split_kernel, signature=split_sig,
                                                          constexprs=split_const), target=target, options=options),
        "reduce": triton.compile(triton.compiler.ASTSource(fn=_reduce_kernel, signature=reduce_sig,
                                                           constexprs=reduce_const), target=target,
                                 options={"num_warps": 4}),
    }
