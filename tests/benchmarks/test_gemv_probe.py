"""benchmarks/gemv_probe as a user runs it: the CPU engine's operator library is built, its BlockwiseMatMul and ONNX
Runtime's MatMulNBits compute the same int4 or int8 product on the same weights (both within the int8 vector's
rounding of the float product, and of each other), each beside a read probe, once over 4 KiB pages and once over
huge pages; bad settings are one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

TOOL = Path(__file__).resolve().parents[2] / "benchmarks" / "gemv_probe"
sys.path.insert(0, str(TOOL.parent))

from gemv_probe.__main__ import BLOCK, relative_error  # noqa: E402

from mla_deploy.ort.record import host_cpu  # noqa: E402
from mla_deploy.ort.operators import why_not_here  # noqa: E402

WHY_NOT = why_not_here(host_cpu("").features)


@pytest.mark.skipif(WHY_NOT is not None, reason=f"no BlockwiseMatMul here: {WHY_NOT}")
@pytest.mark.parametrize("bits", [4, 8])
def test_the_kernel_and_matmulnbits_compute_the_same_product(tmp_path, bits):
    out = tmp_path / "rows.json"
    result = subprocess.run([sys.executable, str(TOOL), "--shape", "300,544", "--bits", str(bits), "--threads", "2",
                             "--repeat", "2", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert report["bits"] == bits
    assert [(r["kernel"], r["huge_pages"]) for r in rows] == [
        ("MatMulNBits", False), ("BlockwiseMatMul", False), ("MatMulNBits", True), ("BlockwiseMatMul", True)]
    for row in rows:  # an int8 vector per block of 32: a few 1e-3 of the row's absolute sum, not more
        assert 0 < row["max_relative_error"] < 1e-2, row
        assert row["seconds"] > 0 and row["gbps"] > 0
        assert row["read_gbps"] > 0 and row["of_read"] == pytest.approx(row["gbps"] / row["read_gbps"])
    assert "GB/s" in result.stdout and f"int{bits} GEMV [300 x 544]" in result.stdout and "x read" in result.stdout


def test_the_error_measure_sees_a_wrong_product():
    rng = np.random.default_rng(1)
    weights = rng.integers(0, 256, size=(8, 64 // BLOCK, BLOCK // 2), dtype=np.uint8)
    scales = rng.random((8, 64 // BLOCK), dtype=np.float32) + 0.1
    x = rng.standard_normal(64, dtype=np.float32)
    values = np.stack([weights & 15, weights >> 4], axis=-1).reshape(8, -1, BLOCK).astype(np.float64) - 8
    exact = ((values * scales[:, :, None]).reshape(8, -1) * x).sum(axis=1)
    assert relative_error(exact.astype(np.float32), weights, scales, x) < 1e-6
    swapped = np.stack([weights >> 4, weights & 15], axis=-1).reshape(8, -1, BLOCK).astype(np.float64) - 8
    wrong = ((swapped * scales[:, :, None]).reshape(8, -1) * x).sum(axis=1)  # nibbles in the other order
    assert relative_error(wrong.astype(np.float32), weights, scales, x) > 0.05


def test_the_error_measure_reads_int8_blocks_with_their_zero_point():
    rng = np.random.default_rng(2)
    weights = rng.integers(0, 256, size=(8, 64 // BLOCK, BLOCK), dtype=np.uint8)
    scales = rng.random((8, 64 // BLOCK), dtype=np.float32) + 0.1
    x = rng.standard_normal(64, dtype=np.float32)
    values = weights.astype(np.float64) - 128
    exact = ((values * scales[:, :, None]).reshape(8, -1) * x).sum(axis=1)
    assert relative_error(exact.astype(np.float32), weights, scales, x) < 1e-6
    unsigned = ((weights.astype(np.float64) * scales[:, :, None]).reshape(8, -1) * x).sum(axis=1)  # no zero point
    assert relative_error(unsigned.astype(np.float32), weights, scales, x) > 0.05


@pytest.mark.parametrize("args, message", [(["--shape", "10,30"], "multiple of 32"),
                                           (["--bits", "3"], "invalid choice"),
                                           (["--shape", "ten"], "expected N,K"),
                                           (["--threads", "0"], "integer >= 1")])
def test_bad_settings_are_one_line(args, message):
    result = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
