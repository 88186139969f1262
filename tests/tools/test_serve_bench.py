"""tools/serve_bench.py as a user runs it: a real `mla-deploy serve` process over the tiny text artifact, driven
at two concurrencies; its table and JSON rows add up (every request answered, the tokens asked for)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("transformers")

from artifacts import text_artifact  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "serve_bench.py"


def test_the_serving_bench_prints_one_row_per_concurrency(tmp_path):
    out = tmp_path / "rows.json"
    result = subprocess.run([sys.executable, str(SCRIPT), str(text_artifact("static")), "--concurrency", "1,3",
                             "--requests", "2", "--max-tokens", "5", "--threads", "1", "--json", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| concurrency | tok/s (all clients) |" in result.stdout and "server's own overhead" in result.stdout
    rows = json.loads(out.read_text())
    assert [r["concurrency"] for r in rows] == [1, 3] and [r["requests"] for r in rows] == [2, 6]
    for row in rows:
        assert row["errors"] == 0 and 0 < row["tokens"] <= 5 * row["requests"]
        assert row["tokens_per_second"] > 0 and 0 < row["engine_share"] < 1 and row["rows_per_step"] >= 1


def test_an_artifact_without_a_tokenizer_is_refused_in_one_line():
    from artifacts import tiny_artifact

    result = subprocess.run([sys.executable, str(SCRIPT), str(tiny_artifact("static"))], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 1 and result.stderr.strip().endswith("has no tokenizer files (mla-deploy serve needs them)")
    assert "Traceback" not in result.stderr
