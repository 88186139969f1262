"""Checkpoints written by transformers itself, exported end to end: `mla-deploy export --hf`, then ONNX Runtime
greedy generation equals transformers' `generate` token for token, logits within 1e-4."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_oracle import hf_model  # noqa: E402
from mla_deploy.engines.ort_engine import OrtEngine  # noqa: E402

CASES = {  # version, q compression, yarn; all with MoE layers (first layer dense)
    "v2-moe-qlora": (2, 32, False),
    "v3-moe-qlora-yarn": (3, 32, True),
    "v3-moe-noq": (3, None, False),
}
PROMPTS = [[5, 17, 99, 3, 42, 7], [64, 2, 11], [120, 1, 8, 8, 30]]
NEW = 32


def _export(tmp_path, case, cache_mode):
    version, q, yarn = CASES[case]
    hf = hf_model(version, q_lora_rank=q, yarn=yarn, std=0.15)
    ckpt = tmp_path / "ckpt"
    hf.save_pretrained(ckpt)
    out = tmp_path / "onnx"
    done = subprocess.run([sys.executable, "-m", "mla_deploy", "export", "--hf", str(ckpt), "--out", str(out),
                           "--cache-mode", cache_mode], capture_output=True, text=True, timeout=600,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return hf, out


@pytest.mark.slow
@pytest.mark.parametrize("case,cache_mode", [("v2-moe-qlora", "concat"), ("v3-moe-qlora-yarn", "static"),
                                             ("v3-moe-noq", "concat")])
def test_exported_checkpoint_generates_what_transformers_generates(tmp_path, case, cache_mode):
    hf, out = _export(tmp_path, case, cache_mode)
    engine = OrtEngine(out, threads=1, capacity=64)
    result = engine.generate(PROMPTS, NEW)
    for b, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        assert result.tokens[b] == ref.sequences[0, len(prompt):].tolist(), f"prompt {b}"
    # logits, teacher-forced on transformers' tokens, for one prompt through prefill and every decode step
    prompt = PROMPTS[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    state = engine.new_state(1)
    got = [engine.forward("prefill", np.array([prompt]), np.arange(len(prompt))[None], state)["logits"][0, -1]]
    for token in ref.sequences[0, len(prompt):-1].tolist():
        got.append(engine.forward("decode", np.array([[token]]), state.lengths[:, None].copy(), state)["logits"][0, -1])
    want = torch.cat(ref.logits).numpy()
    assert np.abs(np.stack(got) - want).max() <= 1e-4
    # `mla-deploy validate` on the checkpoint's artifact: the reference is rebuilt from the checkpoint itself
    from mla_deploy.validate import validate_artifact

    result = validate_artifact(out, out_dir=tmp_path / "report", steps=4, threads=1)
    assert result.passed, result.summary()
    assert (tmp_path / "report" / "report.html").is_file()
