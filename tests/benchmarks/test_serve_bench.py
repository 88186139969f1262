"""benchmarks/serve_bench.py as a user runs it: a real `mla-deploy serve` process over the tiny text artifact, driven
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

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_bench.py"


def test_the_serving_bench_prints_one_row_per_concurrency(tmp_path):
    out = tmp_path / "rows.json"
    result = subprocess.run([sys.executable, str(SCRIPT), str(text_artifact("static")), "--concurrency", "1,3",
                             "--requests", "2", "--max-tokens", "5", "--threads", "1", "--json", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| concurrency | tok/s (all clients) |" in result.stdout and "server's own overhead" in result.stdout
    rows = json.loads(out.read_text())
    served = [r for r in rows if r["server"] == "mla-deploy"]
    assert [r["concurrency"] for r in served] == [1, 3] and [r["requests"] for r in served] == [2, 6]
    for row in served:
        assert row["errors"] == 0 and 0 < row["tokens"] <= 5 * row["requests"]
        assert row["tokens_per_second"] > 0 and 0 < row["engine_share"] < 1 and row["rows_per_step"] >= 1
    # the same first prompts as one `mla-deploy run` batch: one request per client, as many tokens
    batches = [r for r in rows if r["server"] == "mla-deploy run"]
    assert [(r["concurrency"], r["requests"], r["errors"]) for r in batches] == [(1, 1, 0), (3, 3, 0)]
    for row in batches:
        assert 0 < row["tokens"] <= 5 * row["requests"] and row["tokens_per_second"] > 0 and row["ttft_ms"] > 0
    assert "| mla-deploy run | 3 |" in result.stdout


def test_the_features_bench_measures_the_prefix_cache_and_chunked_prefill(tmp_path):
    out = tmp_path / "features.json"
    result = subprocess.run([sys.executable, str(SCRIPT), str(text_artifact("static")), "--features",
                             "--system-length", "100", "--hits", "2", "--long-prompt", "200", "--long-count", "1",
                             "--streams", "2", "--prefill-chunk", "32,auto", "--threads", "1", "--json", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "faster than without the prefix cache" in result.stdout and "| --prefill-chunk 32 |" in result.stdout
    assert "| --prefill-chunk auto (time-budgeted) |" in result.stdout
    rows = json.loads(out.read_text())
    prefix, chunks = rows["prefix_cache"], rows["chunked_prefill"]
    assert prefix["tokens_reused"] == 2 * 96 and prefix["ttft_hit_ms"] > 0 and prefix["speedup"] > 0
    servers = chunks["servers"]
    assert list(servers) == ["--prefill-chunk 0", "--prefill-chunk 32", "--prefill-chunk auto (time-budgeted)"]
    for row in servers.values():
        assert row["gaps"] > 0 and row["max_ms"] >= row["p99_ms"] > 0
        assert row["p99_over_steady"] == pytest.approx(row["p99_ms"] / row["steady_p50_ms"])
        assert row["p99_over_after"] == pytest.approx(row["p99_ms"] / row["after_p50_ms"])


def test_an_artifact_without_a_tokenizer_is_refused_in_one_line():
    from artifacts import tiny_artifact

    result = subprocess.run([sys.executable, str(SCRIPT), str(tiny_artifact("static"))], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 1 and result.stderr.strip().endswith("has no tokenizer files (mla-deploy serve needs them)")
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args, line", [
    (["--llama-server", "x"], "serve_bench: --llama-server and --gguf go together"),
    (["--llama-server", "/nonexistent/llama-server", "--gguf", "x.gguf"],
     "serve_bench: --llama-server /nonexistent/llama-server is not an executable file"),
    (["--llama-server", sys.executable, "--gguf", "/nonexistent/x.gguf"], "serve_bench: --gguf /nonexistent/x.gguf is not a file"),
    (["--max-cache-length", "20"], "serve_bench: --max-cache-length 20 is shorter than a request needs "
                                   "(--prompt-length + --max-tokens + 2 = 66)"),
    (["--json", "/nonexistent/rows.json"], "serve_bench: --json /nonexistent/rows.json cannot be written"),
])
def test_bad_settings_are_refused_in_one_line_before_anything_starts(args, line):
    result = subprocess.run([sys.executable, str(SCRIPT), str(text_artifact("static")), *args],
                            capture_output=True, text=True, timeout=600)
    assert (result.returncode, result.stderr.strip(), result.stdout) == (1, line, "")


def test_a_folder_that_is_no_artifact_is_refused_in_one_line(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "no manifest.json" in result.stderr
    assert result.stderr.startswith("serve_bench: ")


def test_the_bench_tokenizer_covers_the_whole_vocabulary(tmp_path):
    """benchmarks/bench_tokenizer.py: every id of the config decodes to text (what llama.cpp's converter keeps as a
    user-defined token, not a control token it would not print)."""
    from tokenizers import Tokenizer

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    script = SCRIPT.parent / "bench_tokenizer.py"
    result = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "1000 ids" in result.stdout, result.stderr
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 1000 and tokenizer.decode([999]) == "[t999]"
    assert (tmp_path / "chat_template.jinja").is_file()
    refused = subprocess.run([sys.executable, str(script), str(tmp_path / "none")], capture_output=True, text=True)
    assert refused.returncode == 1 and "usage:" in refused.stderr and "Traceback" not in refused.stderr
