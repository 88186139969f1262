"""Benchmark the Triton MLA decode kernels: achieved bandwidth against the GPU's measured copy bandwidth.

    python plugins/mla_decode/bench.py [--batch 1 8 64] [--heads 16 128] [--lengths 1024 8192 32768]

For each (batch, heads, cache length) it times :func:`.triton_kernel.mla_decode` and prints
``bytes read / time``, where bytes read = the valid cache rows ``B x L x C`` plus the query ``B x H x C``
(the output and the split partials are not counted), as a fraction of the device-to-device copy bandwidth
measured in the same run (``torch.Tensor.copy_`` of a 1 GiB buffer, counted as read + write bytes).
``--timing events`` (default) times back-to-back calls between two CUDA events: the host's launch cost (two
allocations, two JIT launches) is counted, and dominates below about 150 us. ``--timing cudagraph`` captures one
call in a CUDA graph and times its replays (``triton.testing.do_bench_cudagraph``): the kernels alone.
Needs a CUDA GPU: timings under Triton's CPU interpreter mean nothing.
"""

from __future__ import annotations

import argparse
import sys

import torch


def _modules():
    if __package__:
        from . import reference, triton_kernel

        return triton_kernel, reference
    from mla_deploy.trt.plugin_loader import load_plugin_module  # run as a script

    return load_plugin_module("triton_kernel"), load_plugin_module("reference")


def _time_ms(fn, iters: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _time_graph_ms(fn, rep_ms: int = 100) -> float:
    """Mean ms of one call replayed from a CUDA graph (Triton's own protocol)."""
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms))


def copy_bandwidth(gib: float = 1.0, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting the bytes read and written."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), iters)
    return 2 * n / (ms * 1e-3)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--rank", type=int, default=512, help="kv_lora_rank (value channels)")
    parser.add_argument("--rope", type=int, default=64, help="qk_rope_head_dim")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--block-n", type=int, default=None, help="cache rows per tile (default: launch_config's)")
    parser.add_argument("--num-splits", type=int, default=None)
    parser.add_argument("--max-gib", type=float, default=8.0, help="skip shapes whose cache exceeds this")
    parser.add_argument("--timing", choices=["events", "cudagraph"], default="events",
                        help="events: back-to-back calls (launch cost included); cudagraph: replays of a captured call")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.py needs a CUDA GPU (timings under Triton's interpreter are meaningless)", file=sys.stderr)
        return 1
    kernel, reference = _modules()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    width, scale = args.rank + args.rope, (args.rank + args.rope) ** -0.5
    peak = copy_bandwidth()
    print(f"GPU {torch.cuda.get_device_name()}; device-to-device copy {peak / 1e9:.0f} GB/s (read + write)")
    print(f"timing: {'CUDA-graph replay (do_bench_cudagraph)' if args.timing == 'cudagraph' else 'CUDA events'}")
    print(f"{'batch':>5} {'heads':>5} {'length':>7} {'splits':>6} {'us':>9} {'GB/s':>8} {'of copy':>8} {'max rel err':>11}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for batch in args.batch:
        for length in args.lengths:
            cache_bytes = batch * length * width * dtype.itemsize
            if cache_bytes > args.max_gib * 2**30:
                continue
            cache = torch.randn((batch, length, width), generator=gen, device="cuda").to(dtype)
            lengths = torch.full((batch,), length, dtype=torch.int64, device="cuda")
            for heads in args.heads:
                q = torch.randn((batch, heads, width), generator=gen, device="cuda").to(dtype)
                out = torch.empty((batch, heads, args.rank), dtype=dtype, device="cuda")

                def run():
                    kernel.mla_decode(q, cache, lengths, scale, args.rank, out=out, num_splits=args.num_splits,
                                      block_n=args.block_n)

                ms = _time_graph_ms(run) if args.timing == "cudagraph" else _time_ms(run, args.iters)
                read = cache_bytes + q.numel() * dtype.itemsize
                bw = read / (ms * 1e-3)
                err = float("nan")
                if batch * heads * length <= 2**24:  # the float32 reference's scores must fit in memory
                    ref = reference.mla_decode_reference(q, cache, lengths, scale, args.rank).float()
                    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                block_h, block_n = kernel.launch_config(heads)[:2]
                splits = args.num_splits or kernel.choose_num_splits(
                    batch, -(-heads // block_h), length, args.block_n or block_n,
                    2 * torch.cuda.get_device_properties(0).multi_processor_count)
                print(f"{batch:>5} {heads:>5} {length:>7} {splits:>6} {ms * 1e3:>9.1f} {bw / 1e9:>8.0f} "
                      f"{bw / peak:>8.1%} {err:>11.2e}")
            del cache
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
