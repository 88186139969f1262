"""python benchmarks/gemv_probe [--shape N,K] [--bits 4|8] [--threads T] [--repeat R] [--json FILE]: how fast this machine
streams a quantized matrix-vector product (int4 or int8, blocks of 32, zero point 8 or 128, fp32 scales, the vector
quantized to int8 per block) with ONNX Runtime's ``MatMulNBits`` (``accuracy_level`` 4, as mla-deploy runs it) and
with mla-deploy's own ``BlockwiseMatMul`` (the CPU engine's operator, :mod:`mla_deploy.ort.operators`: AVX-512
VNNI), on the same weights, over 4 KiB pages and over huge pages, each beside a read probe of the machine's
bandwidth taken just before it (the bench's bound: :func:`mla_deploy.bench.machine.read_bandwidth`), so that a
kernel's GB/s reads against what the memory gave at that moment (``x read``).

Why: a quantized decode step is such products; this says how the two kernels stream them on this machine, for
one product at a time (which the CPU engine's swap of ``MatMulNBits`` by size rests on). Both are checked against
the float product of the same weights (error relative to the row's absolute sum; the int8 vector's rounding is
the only difference). Each measurement runs in its own process, with the engine's session options, under
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` or ``=0`` (how mla-deploy's command line loads weights, or not).
Needs what the CPU engine's operators need (a C compiler, one of their fast paths, the source checkout); the library
is compiled into a temporary folder, for the best fast path this CPU has.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BLOCK = 32
#: a product computed from an int8 vector is this close to the float one (measured: 2-4e-3 at K = 2048)
TOLERANCE = 1e-2


class ProbeError(Exception):
    """A bad setting or a missing tool, said in one line."""


def _shape(text: str) -> tuple[int, int]:
    try:
        n, k = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N,K, got {text!r}") from None
    if n < 1 or k < BLOCK or k % BLOCK:
        raise argparse.ArgumentTypeError(f"N >= 1 and K a multiple of {BLOCK}, got {n},{k}")
    return n, k


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def build(into: Path) -> Path:
    """The CPU engine's operator library, compiled for this CPU into ``into``."""
    from mla_deploy.ort.operators import compile_library

    library = compile_library(into)
    if library.path is None:
        raise ProbeError(f"no BlockwiseMatMul here: {library.why_not}")
    return library.path


def write_inputs(folder: Path, n: int, k: int, bits: int = 4, seed: int = 0) -> tuple[np.ndarray, np.ndarray,
                                                                                        np.ndarray]:
    """Random weights ``[N, K/32, 32 * bits / 8]`` uint8 (MatMulNBits' layout), scales ``[N, K/32]`` and a vector
    ``[K]`` (float32), written for the worker processes."""
    rng = np.random.default_rng(seed)
    weights = rng.integers(0, 256, size=(n, k // BLOCK, BLOCK * bits // 8), dtype=np.uint8)
    scales = (rng.random((n, k // BLOCK), dtype=np.float32) * 0.02 + 1e-4).astype(np.float32)
    x = rng.standard_normal(k, dtype=np.float32)
    weights.tofile(folder / "weights.bin")
    scales.tofile(folder / "scales.bin")
    x.tofile(folder / "x.bin")
    return weights, scales, x


def relative_error(y: np.ndarray, weights: np.ndarray, scales: np.ndarray, x: np.ndarray) -> float:
    """The largest ``|y - W x| / sum|W * x|`` over the rows, ``W`` dequantized in float64 (int4 when a block holds 16
    bytes, low nibble first, zero point 8; int8 when it holds 32, zero point 128), in chunks of rows."""
    n = weights.shape[0]
    worst = 0.0
    for start in range(0, n, 4096):
        packed = weights[start:start + 4096].astype(np.int16)
        if weights.shape[-1] == BLOCK:
            values = packed.reshape(len(packed), -1, BLOCK) - 128
        else:
            values = np.stack([packed & 15, packed >> 4], axis=-1).reshape(len(packed), -1, BLOCK) - 8
        w = (values * scales[start:start + 4096, :, None].astype(np.float64)).reshape(len(packed), -1)
        terms = w * x.astype(np.float64)
        reference, magnitude = terms.sum(axis=1), np.abs(terms).sum(axis=1)
        worst = max(worst, float((np.abs(y[start:start + 4096] - reference) / np.maximum(magnitude, 1e-30)).max()))
    return worst


#: the kernels compared: ONNX Runtime's, and the CPU engine's own
KERNELS = ("MatMulNBits", "BlockwiseMatMul")


def ort_worker(folder: Path, n: int, k: int, threads: int, repeat: int, kernel: str, bits: int = 4) -> dict:
    """``kernel`` (:data:`KERNELS`) on the written weights in this process, with the engine's session options (and
    ``folder``'s operator library for ours): the best of ``repeat`` runs; writes ``y_<kernel>.bin``."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    weights = np.fromfile(folder / "weights.bin", dtype=np.uint8).reshape(n, k // BLOCK, BLOCK * bits // 8)
    scales = np.fromfile(folder / "scales.bin", dtype=np.float32).reshape(n, k // BLOCK)
    x = np.fromfile(folder / "x.bin", dtype=np.float32).reshape(1, k)
    from mla_deploy.ort.operators import LIBRARY, register
    from mla_deploy.ort.swaps import DOMAIN

    if kernel == "MatMulNBits":
        node = helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=k, N=n, bits=bits,
                                block_size=BLOCK, accuracy_level=4)
    else:
        node = helper.make_node(kernel, ["x", "w", "s"], ["y"], domain=DOMAIN, K=k, N=n, bits=bits, block_size=BLOCK)
    graph = helper.make_graph([node], "gemv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
                              initializer=[numpy_helper.from_array(weights, "w"), numpy_helper.from_array(scales, "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1),
                                                    helper.make_opsetid(DOMAIN, 1)])
    model.ir_version = 10
    if kernel == "MatMulNBits":
        onnx.checker.check_model(model)
    from mla_deploy.ort.engine import session_options

    # the engine's own session options (threads, spinning, no arena), as `mla-deploy run` opens its graphs
    options = session_options(threads, spin=True)
    if kernel != "MatMulNBits":
        register(options, folder / LIBRARY)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    del model, graph, weights
    best = float("inf")
    for i in range(repeat + 1):  # the first run is untimed
        start = time.perf_counter()
        y = session.run(None, {"x": x})[0]
        if i:
            best = min(best, time.perf_counter() - start)
    y.reshape(n).astype(np.float32).tofile(folder / f"y_{kernel}.bin")
    from mla_deploy.ort.huge_pages import huge_pages

    return {"seconds": best, "huge_page_bytes": huge_pages().huge_bytes}


def measure(n: int, k: int, threads: int, repeat: int, bits: int = 4) -> list[dict]:
    """One row per (pages, kernel): milliseconds, GB/s streamed, huge-page bytes, the error against float and the read
    bandwidth probed just before it (:func:`read_probe`)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="gemv-probe-") as tmp:
        folder = Path(tmp)
        build(folder)
        weights, scales, x = write_inputs(folder, n, k, bits)
        nbytes = weights.nbytes + scales.nbytes
        for huge in (0, 1):
            for kernel in KERNELS:
                read_gbps = read_probe(threads)
                proc = subprocess.run([sys.executable, str(Path(__file__).parent), "--ort-worker", str(folder),
                                       "--kernel", kernel, "--shape", f"{n},{k}", "--threads", str(threads),
                                       "--repeat", str(repeat), "--bits", str(bits)], capture_output=True, text=True,
                                      env={**os.environ, "GLIBC_TUNABLES": f"glibc.malloc.hugetlb={huge}"})
                if proc.returncode != 0:
                    raise ProbeError(f"{kernel} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
                out = json.loads(proc.stdout.strip().splitlines()[-1])
                y = np.fromfile(folder / f"y_{kernel}.bin", dtype=np.float32)
                rows.append({"kernel": kernel, "huge_pages": bool(huge), "seconds": out["seconds"],
                             "huge_page_bytes": out["huge_page_bytes"], "read_gbps": read_gbps,
                             "max_relative_error": relative_error(y, weights, scales, x)})
    for row in rows:
        row["gbps"] = nbytes / row["seconds"] / 1e9
        row["of_read"] = row["gbps"] / row["read_gbps"]
    return rows


def read_probe(threads: int) -> float:
    """The machine's read bandwidth now, GB/s: the bench's bound probe (several kernels, threads pinned, huge pages
    advised), as ``bench`` and ``benchmarks/compare_llama_cpp.sh`` take it."""
    from mla_deploy.bench.machine import read_bandwidth

    return float(read_bandwidth(threads)["read_gbps"])


def table(rows: list[dict], n: int, k: int, threads: int, bits: int = 4) -> str:
    lines = [f"int{bits} GEMV [{n} x {k}], blocks of {BLOCK}, int8 vector, {threads} thread(s): best of the timed "
             f"calls; read: the bound's probe just before each kernel, x read: the kernel's GB/s over it", "",
             f"{'kernel':<40} {'pages':<6} {'ms':>8} {'GB/s':>6} {'read GB/s':>9} {'x read':>6} {'on huge pages':>14} "
             f"{'max rel. error':>14}"]
    for r in rows:
        lines.append(f"{r['kernel']:<40} {'2 MiB' if r['huge_pages'] else '4 KiB':<6} {r['seconds'] * 1e3:8.3f} "
                     f"{r['gbps']:6.1f} {r['read_gbps']:9.1f} {r['of_read']:6.2f} "
                     f"{r['huge_page_bytes'] / 2**20:10.0f} MiB {r['max_relative_error']:14.2e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/gemv_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=_shape, default=(102400, 2048),
                        help="N,K (default: 102400,2048, DeepSeek-V2-Lite's lm_head)")
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4, help="weight bits (default 4)")
    parser.add_argument("--threads", type=_positive, default=2)
    parser.add_argument("--repeat", type=_positive, default=30)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--ort-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--kernel", choices=KERNELS, default=KERNELS[0], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    n, k = args.shape
    if args.ort_worker:
        print(json.dumps(ort_worker(args.ort_worker, n, k, args.threads, args.repeat, args.kernel, args.bits)))
        return 0
    try:
        rows = measure(n, k, args.threads, args.repeat, args.bits)
        if args.json:
            args.json.write_text(json.dumps({"n": n, "k": k, "bits": args.bits, "threads": args.threads,
                                             "rows": rows}, indent=2))
    except (ProbeError, OSError) as exc:
        print(f"gemv_probe: {exc}", file=sys.stderr)
        return 1
    print(table(rows, n, k, args.threads, args.bits))
    bad = [r["kernel"] for r in rows if r["max_relative_error"] > TOLERANCE]
    if bad:
        print(f"gemv_probe: {', '.join(bad)} off the float product by more than {TOLERANCE:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
