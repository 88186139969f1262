"""`mla-deploy serve` of a LongCat-Flash model (the tiny `longcat_flash` checkpoint written by transformers, with a
tokenizer: two latent caches per layer, zero experts): concurrent greedy completions over real HTTP, sharing the
continuous batch's static cache (four latent caches, row views and cleared rows), each equal to the same prompt
generated alone in this process (whose tokens tests/model/test_family.py ties to transformers')."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("openai")

import family_checkpoints  # noqa: E402
from cli_run import cli, ok  # noqa: E402
from hf_oracle import hf_tokenizer  # noqa: E402
from serving import Server, load, solo  # noqa: E402


@pytest.mark.slow
def test_concurrent_completions_equal_their_solo_runs(tmp_path):
    tokenizer = hf_tokenizer()
    ckpt = tmp_path / "ckpt"
    family_checkpoints.write("longcat_flash", ckpt, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(ckpt)
    out = tmp_path / "onnx"
    ok(cli("export", "--hf", ckpt, "--out", out, "--max-cache-length", "128"))
    alone = solo(out)
    server = Server(out, "--max-batch", "4")
    try:
        seen = load(server, alone, clients=6, seconds=0)
    finally:
        server.stop()
    assert seen.replies == 6 and not seen.wrong and not seen.errors, (seen.wrong, seen.errors)
