"""The default export is the artifact every command takes: `export --hf CKPT --out ART` with no other option, then
`run`, `validate`, `build --target cpu`, `bench model` and `serve` on it, as a user runs them (real processes)."""

from __future__ import annotations

import json

import pytest

from cli_run import cli_process
from hf_oracle import text_checkpoint
from mla_deploy.artifact import load_manifest
from serving import Server


@pytest.mark.slow
def test_a_default_export_is_taken_by_every_command(tmp_path):
    """`export --hf CKPT --out ART` with no other option writes the static cache every command takes: `run`,
    `validate`, `build --target cpu`, `bench model` and `serve` (which refuses a concat artifact in one line)."""

    checkpoint, art = tmp_path / "ckpt", tmp_path / "art"
    text_checkpoint(checkpoint, 2)
    done = cli_process("export", "--hf", str(checkpoint), "--out", str(art))
    assert done.returncode == 0, done.stderr
    manifest = load_manifest(art)
    assert manifest.layout.mode == "static" and manifest.capacity == 4096
    for command in (("run", str(art), "--prompt", "Hello", "--max-new-tokens", "4"), ("validate", str(art)),
                    ("build", str(art), "--target", "cpu"),
                    ("bench", "model", "--artifact", str(art), "--context", "0", "--batch", "1", "--repeat", "1",
                     "--warmup", "0", "--prompt-length", "4", "--no-transformers", "--out", str(tmp_path / "bench"))):
        ran = cli_process(*command)
        assert ran.returncode == 0, f"{command[0]}: {ran.stderr}"
    server = Server(art)
    try:
        status, _, reply = server.raw("/v1/completions", json.dumps(
            {"model": server.model, "prompt": "Hello", "max_tokens": 4}).encode())
        assert status == 200 and reply["usage"]["completion_tokens"] == 4, reply
    finally:
        assert server.stop() == 0
