"""`mla-deploy serve` of the model types whose cache is more than one latent per layer, each a tiny checkpoint written
by transformers with a tokenizer: DeepSeek Sparse Attention (`deepseek_v32`, `index_topk` 4: latent and index-key
caches) and LongCat-Flash (`longcat_flash`: two latent caches per layer, zero experts). Concurrent greedy completions
over real HTTP share the continuous batch's static cache (row views and cleared rows), each equal to the same prompt
generated alone in this process (whose tokens tests/model/test_sparse_attention.py and test_family.py tie to
transformers')."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("openai")

import family_checkpoints  # noqa: E402
from cli_run import cli, ok  # noqa: E402
from hf_oracle import hf_tokenizer  # noqa: E402
from serving import Server, load, solo  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("case", ["deepseek_v32-sparse", "longcat_flash"])
def test_concurrent_completions_equal_their_solo_runs(tmp_path, case):
    tokenizer = hf_tokenizer()
    ckpt = tmp_path / "ckpt"
    family_checkpoints.write(case, ckpt, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(ckpt)
    out = tmp_path / "onnx"
    ok(cli("export", "--hf", ckpt, "--out", out, "--max-cache-length", "128"))
    alone = solo(out)
    if case == "deepseek_v32-sparse":  # the prompts reach past the top-k
        assert max(len(alone.tokenizer.encode(p)) for p in ("Hello world", "The quick brown fox")) > 4
    server = Server(out, "--max-batch", "4")
    try:
        seen = load(server, alone, clients=6, seconds=0)
    finally:
        server.stop()
    assert seen.replies == 6 and not seen.wrong and not seen.errors, (seen.wrong, seen.errors)
