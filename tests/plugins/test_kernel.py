"""The Triton MLA decode kernels against the pure-PyTorch reference.

Without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``: the kernel code executed by
NumPy on the CPU, block by block): the logic is exercised, not the compiled code, so float32 and float16
only (Triton 3.9's interpreter computes ``tl.dot`` of bfloat16 operands wrongly, checked on a standalone
16x16 dot). The ahead-of-time compile tests prove the kernels compile to PTX and a cubin for sm_90 with
Triton's CUDA backend, without a GPU, and read what the compiled code does (load widths, spills, wgmma);
not how fast it runs. Tests marked ``gpu`` need CUDA and run the compiled kernels.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from mla_deploy.exporter.decode_plugin import mla_decode as eager_mla_decode

HAS_CUDA = torch.cuda.is_available()  # else the kernels run under Triton's interpreter (see conftest.py)


def _case(batch, heads, steps, slots, rank, rope, dtype, device, seed=0, full=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn((batch, heads, steps, rank + rope), generator=gen).to(dtype)
    cache = torch.randn((batch, 1, slots, rank + rope), generator=gen).to(dtype)
    lengths = torch.randint(steps, slots + 1, (batch,), generator=gen)
    if full:
        lengths.fill_(slots)
    else:
        lengths[0] = steps  # the shortest a sequence can be: only this step's rows
    return q.to(device), cache.to(device), lengths.to(device), 1.0 / math.sqrt(rank + rope)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max())


# reference ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("steps", [1, 3])
def test_reference_equals_the_exported_op(reference, steps):
    """The kernel's reference and the eager op the decode graph exports (standard ops) agree."""
    q, cache, lengths, scale = _case(2, 4, steps, 9, 16, 8, torch.float32, "cpu")
    ref = reference.mla_decode_reference(q, cache, lengths, scale, 16)
    eager = eager_mla_decode(q, cache, lengths, scale, 16)
    assert ref.shape == eager.shape == (2, 4, steps, 16)
    assert rel_err(ref, eager) < 1e-6


def test_reference_layouts_and_empty_rows(reference):
    q, cache, lengths, scale = _case(2, 4, 1, 7, 16, 8, torch.float32, "cpu")
    full = reference.mla_decode_reference(q, cache, lengths, scale, 16)
    flat = reference.mla_decode_reference(q[:, :, 0], cache[:, 0], lengths, scale, 16)
    assert flat.shape == (2, 4, 16) and torch.equal(flat, full[:, :, 0])
    empty = reference.mla_decode_reference(q, cache, torch.zeros(2, dtype=torch.long), scale, 16)
    assert torch.count_nonzero(empty) == 0
    with pytest.raises(ValueError, match="disagree"):
        reference.mla_decode_reference(q, cache[..., :-1], lengths, scale, 16)


# kernel (GPU, or the interpreter on the CPU) -----------------------------------------------------
CASES = [  # batch, heads, steps, slots, rank, rope, splits
    pytest.param(2, 4, 1, 40, 16, 8, 3, id="tiny-3splits"),
    pytest.param(3, 16, 1, 70, 32, 16, None, id="16heads-auto-splits"),
    pytest.param(2, 20, 1, 33, 24, 8, 2, id="heads-not-multiple-of-block-rank-not-pow2"),
    pytest.param(2, 4, 2, 33, 16, 8, 2, id="two-new-tokens"),
    pytest.param(1, 4, 1, 1, 16, 8, 1, id="one-slot"),
    pytest.param(2, 4, 1, 20, 16, 8, 8, id="more-splits-than-tiles"),
]


@pytest.mark.parametrize("batch,heads,steps,slots,rank,rope,splits", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_kernel_matches_reference(kernel, reference, device, batch, heads, steps, slots, rank, rope, splits, dtype):
    q, cache, lengths, scale = _case(batch, heads, steps, slots, rank, rope, dtype, device)
    out = kernel.mla_decode(q, cache, lengths, scale, rank, num_splits=splits)
    ref = reference.mla_decode_reference(q, cache, lengths, scale, rank)
    assert out.shape == ref.shape and out.dtype == dtype
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 2e-3)


def test_kernel_layouts_out_buffer_and_strides(kernel, reference, device):
    """[B, H, C] queries, a [B, T, C] cache that is a strided view, int32 lengths, an ``out`` buffer."""
    q, cache, lengths, scale = _case(2, 4, 1, 30, 16, 8, torch.float32, device)
    wide = torch.zeros((2, 40, 24 + 8), device=device)
    wide[:, 5:35, :24] = cache[:, 0]
    view = wide[:, 5:35, :24]  # row stride 32, batch stride 1280: not contiguous
    out = torch.full((2, 4, 16), float("nan"), device=device)
    got = kernel.mla_decode(q[:, :, 0], view, lengths.to(torch.int32), scale, 16, out=out, num_splits=2)
    assert got is out
    assert rel_err(out, reference.mla_decode_reference(q[:, :, 0], cache, lengths, scale, 16)) < 1e-5


def test_kernel_empty_sequence_gives_zeros(kernel, device):
    q, cache, _, scale = _case(2, 4, 1, 12, 16, 8, torch.float32, device)
    out = kernel.mla_decode(q, cache, torch.tensor([0, 5], device=device), scale, 16, num_splits=2)
    assert torch.count_nonzero(out[0]) == 0 and torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_kernel_clamps_lengths_to_the_capacity(kernel, reference, device, dtype):
    """A length past the capacity T gives the answer for T, a negative one that for 0: the cache is a view whose
    rows past T are NaN in the same allocation, so any read beyond T would poison the output."""
    q, cache, _, scale = _case(3, 4, 2, 21, 16, 8, torch.float32, device)
    padded = torch.full((3, 21 + 64, 24), float("nan"), device=device)
    padded[:, :21] = cache[:, 0]
    view = padded[:, :21]
    huge = 2**40 if dtype == torch.int64 else 2**31 - 1  # a garbage int64 must not wrap into range either
    bad = torch.tensor([21 + 50, huge, -7], dtype=dtype, device=device)
    clamped = torch.tensor([21, 21, 0], dtype=dtype, device=device)
    for splits in (1, 3):
        out = kernel.mla_decode(q, view, bad, scale, 16, num_splits=splits)
        assert torch.isfinite(out).all()
        assert torch.equal(out, kernel.mla_decode(q, view, clamped, scale, 16, num_splits=splits))
        assert rel_err(out, reference.mla_decode_reference(q, cache, clamped, scale, 16)) < 1e-5
        assert torch.count_nonzero(out[2]) == 0


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_kernel_one_split_is_one_pass(kernel, reference, device, monkeypatch, steps, dtype):
    """With one split stage 1 writes the output and the reduce never launches; the result is the two-stage
    path's exactly (the reduce of one split multiplies by exp2(0) = 1 and divides by 1)."""
    q, cache, lengths, scale = _case(3, 20, steps, 45, 32, 16, dtype, device)
    lengths[1] = 0
    two_stage = kernel.mla_decode(q, cache, lengths, scale, 32, num_splits=1, single_pass=False)
    launches = []
    real = kernel._reduce_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(kernel, "_reduce_kernel", Spy())
    out = kernel.mla_decode(q, cache, lengths, scale, 32, num_splits=1)
    assert launches == [] and out.dtype == dtype
    assert torch.equal(out, two_stage)
    assert rel_err(out, reference.mla_decode_reference(q, cache, lengths, scale, 32)) < (
        1e-5 if dtype == torch.float32 else 2e-3)
    kernel.mla_decode(q, cache, lengths, scale, 32, num_splits=2)
    assert len(launches) == 1  # two splits still reduce


def test_launch_config(kernel):
    """Head blocks up to 64 rows: 16 heads one block, 128 heads two; 8 warps (two warpgroups) at 64 rows."""
    assert kernel.launch_config(16) == (16, 32, 4, 3)
    assert kernel.launch_config(20) == (32, 32, 4, 3)
    assert kernel.launch_config(128) == (64, 32, 8, 3)
    assert kernel.launch_config(1) == (16, 32, 4, 3)  # tl.dot's minimum M


@pytest.mark.parametrize("heads,steps", [(16, 1), (128, 1), (128, 2)], ids=["h16", "h128", "h128-s2"])
@pytest.mark.parametrize("splits", [None, 1, 3], ids=["auto-splits", "1split", "3splits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_kernel_default_config_ragged_batch(kernel, reference, device, heads, steps, splits, dtype):
    """The default launch (64-row head blocks at 128 heads, 32-row cache tiles, grid (head blocks, splits, B))
    against the reference on a ragged batch: an empty-but-for-this-step sequence, a full one, lengths that
    end inside a tile and on a tile boundary."""
    q, cache, lengths, scale = _case(5, heads, steps, 77, 32, 16, dtype, device, seed=heads + steps)
    lengths.copy_(torch.tensor([steps, 77, 33, 64, 50]))
    out = kernel.mla_decode(q, cache, lengths, scale, 32, num_splits=splits)
    ref = reference.mla_decode_reference(q, cache, lengths, scale, 32)
    assert out.shape == ref.shape and out.dtype == dtype
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 2e-3)


def test_kernel_rejects_bad_arguments(kernel, device):
    q, cache, lengths, scale = _case(1, 4, 1, 8, 16, 8, torch.float32, device)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        kernel.mla_decode(q, cache, lengths, scale, 24)
    with pytest.raises(ValueError, match="dtype"):
        kernel.mla_decode(q, cache.half(), lengths, scale, 16)
    with pytest.raises(ValueError, match="out must be"):
        kernel.mla_decode(q, cache, lengths, scale, 16, out=torch.empty(1, 4, 1, 8, device=device))


def test_choose_num_splits(kernel):
    assert kernel.choose_num_splits(1, 1, 32768, 16, 264) == 64  # capped at MAX_SPLITS
    assert kernel.choose_num_splits(64, 8, 32768, 16, 264) == 1  # 512 programs already
    assert kernel.choose_num_splits(1, 1, 20, 16, 264) == 2  # no more splits than tiles
    assert kernel.choose_num_splits(4, 1, 4096, 16, 64) == 16


AOT_PROBE = """
import json, os, re, subprocess, sys, tempfile
from triton.backends.nvidia.compiler import get_ptxas
from mla_deploy.trt.plugin_loader import load_plugin_module
kernels = load_plugin_module('triton_kernel')
ptxas = get_ptxas(90).path
report = {}
for tag, kw in (('h16', dict(rows=16)), ('h128', dict(rows=128)), ('h16-nohints', dict(rows=16, hints=False))):
    for name, k in kernels.compile_kernels('bf16', 90, 512, 64, **kw).items():
        ptx = k.asm['ptx']
        arch = re.search(r'[.]target (sm_[0-9a-z]+)', ptx).group(1)
        with tempfile.NamedTemporaryFile('w', suffix='.ptx', delete=False) as f:
            f.write(ptx)
        done = subprocess.run([ptxas, '-v', f'-arch={arch}', f.name, '-o', os.devnull], capture_output=True, text=True)
        os.unlink(f.name)
        assert done.returncode == 0, done.stderr
        report[f'{tag}/{name}'] = dict(
            name=k.metadata.name, cubin=len(k.asm['cubin']), arch=arch, shared=k.metadata.shared,
            ld_v4=len(re.findall(r'ld[.]global(?:[.][a-z0-9]+)*[.]v4', ptx)),
            cp_async_16=len(re.findall(r'cp[.]async[.]c[ag][.]shared[.]global[^;]*, (?:16|0x10)\\b', ptx)),
            wgmma=len(re.findall(r'wgmma[.]mma_async', ptx)), mma_sync=len(re.findall(r'mma[.]sync', ptx)),
            spill_stores=sum(int(n) for n in re.findall(r'([0-9]+) bytes spill stores', done.stderr)),
            registers=max(int(n) for n in re.findall(r'Used ([0-9]+) registers', done.stderr)))
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def sm90():
    """The kernels compiled ahead of time for sm_90 (Triton's CUDA backend and its ptxas, no GPU needed), each
    with ``ptxas -v``'s spill and register figures and counts of instructions read from its PTX.

    Runs in a subprocess: under the interpreter the @triton.jit functions are not compilable objects.
    """
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_DEFAULT_FP_FUSION="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", AOT_PROBE], capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0 and ("ptxas" in done.stderr and ("No such file" in done.stderr
                                                           or "not found" in done.stderr)):
        pytest.skip(f"Triton's ptxas cannot run here: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_kernels_compile_for_sm90_without_a_gpu(sm90):
    """Every variant (partials, one-split output, reduce) compiles to sm_90a PTX and a cubin."""
    assert sm90["h16/split"]["name"] == sm90["h16/single"]["name"] == "_split_kernel"
    assert sm90["h16/reduce"]["name"] == "_reduce_kernel"
    assert all(r["cubin"] > 0 and r["arch"] == "sm_90a" for r in sm90.values())
    assert all(r["shared"] <= 227 * 1024 for r in sm90.values())  # an H100/H200 block's shared memory


def test_sm90_loads_are_16_bytes_wide(sm90):
    """With the divisibility hints the cache tiles are copied by 16-byte ``cp.async`` and the query and the
    partials read by ``ld.global.v4``; without them the same kernel has neither (so the hints are what buys it)."""
    for tag in ("h16", "h128"):
        for name in ("split", "single"):
            assert sm90[f"{tag}/{name}"]["cp_async_16"] > 0 and sm90[f"{tag}/{name}"]["ld_v4"] > 0, (tag, name)
        assert sm90[f"{tag}/reduce"]["ld_v4"] > 0
    assert sm90["h16-nohints/split"]["cp_async_16"] == 0 and sm90["h16-nohints/split"]["ld_v4"] == 0


def test_sm90_register_spills(sm90):
    """``ptxas -v``: no spill at 16 heads (16-row blocks, 4 warps) nor in the reduce. At 128 heads (64-row
    blocks, 8 warps, 32-row tiles, 3 stages) the 64x512 float32 accumulator alone is 128 of a thread's 255
    registers, and Triton 3.9 + its ptxas spill 40 bytes in the partials variant and 188 in the one-split one,
    some of it reloaded (LDL) inside the tile loop (16-row tiles spill none; 2 stages spill 20 bytes): bounded
    here so that it cannot grow unseen, to be weighed on a GPU against 16-row tiles (bench.py --block-n 16).
    wgmma (Hopper's warpgroup MMA) appears only with 64-row blocks: recorded, not required."""
    for name in ("split", "single", "reduce"):
        assert sm90[f"h16/{name}"]["spill_stores"] == 0, name
    assert sm90["h128/reduce"]["spill_stores"] == 0
    for name in ("split", "single"):
        assert sm90[f"h128/{name}"]["spill_stores"] <= 256, sm90[f"h128/{name}"]
    print({k: (v["wgmma"], v["mma_sync"], v["spill_stores"], v["registers"]) for k, v in sm90.items()})


def test_bench_refuses_without_a_gpu(capsys):
    if HAS_CUDA:
        pytest.skip("a GPU is present: the benchmark would run")
    from mla_deploy.trt.plugin_loader import load_plugin_module

    assert load_plugin_module("bench").main(["--lengths", "16"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err


# GPU ----------------------------------------------------------------------------------------------
GPU_GRID = [(b, h, n) for b in (1, 8, 64) for h in (16, 128) for n in (1, 1000, 32768)]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (the compiled kernels)")
@pytest.mark.parametrize("batch,heads,slots", GPU_GRID, ids=[f"b{b}-h{h}-t{n}" for b, h, n in GPU_GRID])
def test_gpu_bf16_deepseek_sizes(kernel, reference, batch, heads, slots):
    """bf16 at DeepSeek's latent width (512 + 64), fp32 accumulation: within 2e-2 of the float32 reference."""
    if batch * heads * slots > 64 * 128 * 8192:
        batch = max(1, 64 * 128 * 8192 // (heads * slots))  # keeps the reference's float32 scores < 2 GiB
    q, cache, lengths, _ = _case(batch, heads, 1, slots, 512, 64, torch.bfloat16, "cuda")
    scale = 0.1352337788608801  # DeepSeek-V3's (192 ** -0.5 with YaRN mscale)
    out = kernel.mla_decode(q[:, :, 0], cache, lengths, scale, 512)
    ref = reference.mla_decode_reference(q[:, :, 0], cache, lengths, scale, 512)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    assert rel_err(out.float(), ref.float()) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (the compiled kernels)")
def test_gpu_fp32_is_exact_enough(kernel, reference):
    """float32 inputs use IEEE dots (no TF32): 1e-5 relative."""
    q, cache, lengths, scale = _case(4, 128, 1, 4096, 512, 64, torch.float32, "cuda", full=True)
    out = kernel.mla_decode(q, cache, lengths, scale, 512)
    assert rel_err(out, reference.mla_decode_reference(q, cache, lengths, scale, 512)) < 1e-5
