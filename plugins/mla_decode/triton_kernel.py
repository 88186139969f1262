"""Split-K flash decoding over the MLA latent cache, in Triton.

Every query head attends the same latent rows (one KV "head", ``C = r + dr`` wide), so a program takes a
block of ``BLOCK_H`` query rows and one slice ("split") of a sequence's cache, streams that slice in tiles
of ``BLOCK_N`` rows, and keeps an online softmax in float32:

* stage 1 (:func:`_split_kernel`), grid ``(cdiv(H*S, BLOCK_H), splits, B)``: scores
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

Every head block reads its whole split of the cache, so the launch (:func:`launch_config`) makes the blocks
as wide as one Hopper warpgroup MMA allows (64 query rows: 128 heads are two blocks, not eight) and puts the
head block on the grid's fastest axis, so the blocks that read the same rows run side by side and the second
finds them in L2. :func:`compile_kernels` builds the same kernels ahead of time with the divisibility hints
Triton's JIT would infer (:data:`AOT_DIVISIBLE`): without them the cache rows cannot be proved 16-byte
aligned and are not loaded 16 bytes at a time.

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
    rows = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)  # query rows h*S + s
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)  # b * stride_cb passes 2**31 elements at e.g. 128 x 32k x 576
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


def launch_config(rows: int) -> tuple[int, int, int, int]:
    """``(BLOCK_H, BLOCK_N, num_warps, num_stages)`` for ``rows = H*S`` query rows per sequence.

    Every head block streams the whole of its split of the cache, so fewer, wider head blocks read it fewer
    times: ``BLOCK_H = min(64, next_power_of_2(rows))`` (at least 16, ``tl.dot``'s minimum) makes 16 heads one
    block and 128 heads two, and those two are adjacent programs of the grid's fastest axis, so the second
    finds the tile in L2. 64 rows is the M of one Hopper warpgroup MMA (``wgmma``), run by 8 warps. Tiles of
    32 cache rows (36 KB at 576 bf16 channels) in 3 stages keep the copies in flight within shared memory;
    64-row tiles in 3 stages would not fit beside the query block.
    """
    block_h = min(64, max(16, triton.next_power_of_2(max(rows, 1))))
    return block_h, 32, 8 if block_h >= 64 else 4, 3


def _programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def mla_decode(q: torch.Tensor, cache: torch.Tensor, lengths: torch.Tensor, softmax_scale: float,
               kv_lora_rank: int, out: torch.Tensor | None = None, num_splits: int | None = None,
               block_h: int | None = None, block_n: int | None = None, num_warps: int | None = None,
               num_stages: int | None = None, single_pass: bool = True) -> torch.Tensor:
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
            Each of these four left ``None`` takes :func:`launch_config`'s value.
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
    auto = launch_config(m)
    block_h, block_n, num_warps, num_stages = (given if given is not None else chosen for given, chosen in
                                               zip((block_h, block_n, num_warps, num_stages), auto))
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
    _split_kernel[(triton.cdiv(m, block_h), splits, batch)](
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


# Arguments the ahead-of-time kernels are compiled as multiples of 16 (``tt.divisibility=16``; bytes for a
# pointer, elements for an integer). A launcher must pass only such values: 16-byte aligned buffers (every
# torch/ORT allocation is) and channel counts r, dr that are multiples of 16 (512 and 64 at DeepSeek's sizes),
# which makes every row and batch stride of q, the cache, the partials and the output one. The log-sum-exp
# strides (H*S*splits, splits) and the sizes are not, so they stay plain.
AOT_DIVISIBLE = {
    "split": ("q_ptr", "cache_ptr", "lengths_ptr", "part_ptr", "lse_ptr", "stride_qb", "stride_qm", "stride_cb",
              "stride_ct", "stride_pb", "stride_pm", "stride_ps"),
    "reduce": ("part_ptr", "lse_ptr", "out_ptr", "stride_pb", "stride_pm", "stride_ps", "stride_ob", "stride_om"),
}


def compile_kernels(dtype: str = "bf16", arch: int = 90, kv_lora_rank: int = 512, rope_dim: int = 64,
                    rows: int = 16, block_h: int | None = None, block_n: int | None = None,
                    num_warps: int | None = None, num_stages: int | None = None, hints: bool = True) -> dict:
    """Compile the kernels ahead of time for ``sm_<arch>`` (Triton's CUDA backend and its bundled ptxas; no GPU
    needed). Raises what Triton raises if a kernel does not compile. Not usable under the interpreter.

    Args:
        rows: H*S, the query rows per sequence, which picks :func:`launch_config` for the options left ``None``.
        hints: declare the :data:`AOT_DIVISIBLE` arguments multiples of 16, as Triton's JIT does by itself for
            the values it is called with. Without them an ahead-of-time kernel cannot prove a cache row
            16-byte aligned and loads it in narrower pieces. Needs ``kv_lora_rank`` and ``rope_dim`` multiples
            of 16 (else refused).

    Returns: ``{"split": ..., "single": ..., "reduce": ...}`` CompiledKernels (``.asm["ptx"]``, ``.asm["cubin"]``,
    ``.metadata``): stage 1 writing partials, stage 1 writing the output (one split, ``FINAL``), stage 2.
    """
    from triton.backends.compiler import GPUTarget

    if hints and (kv_lora_rank % 16 or rope_dim % 16):
        raise ValueError(f"divisibility hints need kv_lora_rank {kv_lora_rank} and rope_dim {rope_dim} "
                         "to be multiples of 16; pass hints=False")
    auto = launch_config(rows)
    block_h, block_n, num_warps, num_stages = (given if given is not None else chosen for given, chosen in
                                               zip((block_h, block_n, num_warps, num_stages), auto))
    elem = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}[dtype]
    target = GPUTarget("cuda", arch, 32)
    block_r, block_p = max(16, triton.next_power_of_2(kv_lora_rank)), max(16, triton.next_power_of_2(rope_dim))

    def source(fn, signature, constexprs, divisible):
        signature = {**signature, **{n: "constexpr" for n in constexprs}}
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible} if hints else {}
        return triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)

    def split_source(final):
        sig = {"q_ptr": f"*{elem}", "cache_ptr": f"*{elem}", "lengths_ptr": "*i64",
               "part_ptr": f"*{elem}" if final else "*fp32", "lse_ptr": "*fp32"}
        sig.update({n: "i32" for n in ("stride_qb", "stride_qm", "stride_cb", "stride_ct", "stride_pb",
                                       "stride_pm", "stride_ps", "stride_lb", "stride_lm", "M", "T", "STEPS",
                                       "NUM_SPLITS")})
        sig["scale_log2"] = "fp32"
        const = {"R": kv_lora_rank, "P": rope_dim, "BLOCK_H": block_h, "BLOCK_N": block_n, "BLOCK_R": block_r,
                 "BLOCK_P": block_p, "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32", "FINAL": final}
        return source(_split_kernel, sig, const, AOT_DIVISIBLE["split"])

    reduce_sig = {"part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": f"*{elem}"}
    reduce_sig.update({n: "i32" for n in ("stride_pb", "stride_pm", "stride_ps", "stride_lb", "stride_lm",
                                          "stride_ob", "stride_om", "NUM_SPLITS")})
    reduce = source(_reduce_kernel, reduce_sig, {"R": kv_lora_rank, "BLOCK_R": block_r}, AOT_DIVISIBLE["reduce"])
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return {
        "split": triton.compile(split_source(False), target=target, options=options),
        "single": triton.compile(split_source(True), target=target, options=options),
        "reduce": triton.compile(reduce, target=target, options={"num_warps": 4}),
    }
