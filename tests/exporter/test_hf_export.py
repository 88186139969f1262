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


def test_checkpoint_export_keeps_one_copy_and_refuses_a_changed_checkpoint(tmp_path):
    """A checkpoint export is one graph over one weights file, with no copy of the checkpoint's weights for
    validation: the reference is the checkpoint itself, recorded by path, size and sampled hash, and a checkpoint
    that changed since the export is refused in one line."""
    from safetensors.torch import load_file, save_file

    from mla_deploy.artifact import load_manifest
    from mla_deploy.errors import ArtifactError
    from mla_deploy.validate import validate_artifact

    _, out = _export(tmp_path, "v2-moe-qlora", "static")
    manifest = load_manifest(out)
    assert {g.file for g in manifest.graphs.values()} == {"model.onnx"}  # prefill and decode: one graph
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "model.onnx"]  # tiny: weights inline
    assert manifest.weights.kind == "hf" and [f["file"] for f in manifest.weights.files] == ["model.safetensors"]
    assert validate_artifact(out, write_reports=False, steps=2, threads=1).passed
    shard = tmp_path / "ckpt" / "model.safetensors"
    state = load_file(str(shard))
    name = next(k for k in state if k.endswith("kv_b_proj.weight"))
    state[name] = state[name] * 1.01  # same names, shapes and size: only values differ
    save_file(state, str(shard), metadata={"format": "pt"})
    with pytest.raises(ArtifactError, match="changed since the export"):
        validate_artifact(out, write_reports=False, steps=2, threads=1)
