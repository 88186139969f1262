"""Checkpoints written by transformers itself, exported end to end: `mla-deploy export --hf`, then ONNX Runtime
greedy generation equals transformers' `generate` token for token, logits within 1e-4."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cli_run import cli, ok  # noqa: E402
from hf_oracle import assert_engine_matches_hf, hf_model  # noqa: E402
from mla_deploy.ort.engine import OrtEngine  # noqa: E402

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
    ok(cli("export", "--hf", ckpt, "--out", out, "--cache-mode", cache_mode))
    return hf, out


@pytest.mark.slow
@pytest.mark.parametrize("case,cache_mode", [("v2-moe-qlora", "concat"), ("v3-moe-qlora-yarn", "static"),
                                             ("v3-moe-noq", "concat")])
def test_exported_checkpoint_generates_what_transformers_generates(tmp_path, case, cache_mode):
    hf, out = _export(tmp_path, case, cache_mode)
    assert_engine_matches_hf(OrtEngine(out, threads=1, capacity=64), hf, PROMPTS, NEW)
    # `mla-deploy validate` on the checkpoint's artifact: the reference is rebuilt from the checkpoint itself
    from mla_deploy.validate import ValidateOptions, validate_artifact

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
    from mla_deploy.validate import ValidateOptions, validate_artifact

    _, out = _export(tmp_path, "v2-moe-qlora", "static")
    manifest = load_manifest(out)
    assert {g.file for g in manifest.graphs.values()} == {"model.onnx"}  # prefill and decode: one graph
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "model.onnx"]  # tiny: weights inline
    assert manifest.weights.kind == "hf" and [f["file"] for f in manifest.weights.files] == ["model.safetensors"]
    assert validate_artifact(out, steps=2, threads=1, options=ValidateOptions(write_reports=False)).passed
    shard = tmp_path / "ckpt" / "model.safetensors"
    state = load_file(str(shard))
    name = next(k for k in state if k.endswith("kv_b_proj.weight"))
    state[name] = state[name] * 1.01  # same names, shapes and size: only values differ
    save_file(state, str(shard), metadata={"format": "pt"})
    with pytest.raises(ArtifactError, match="changed since the export"):
        validate_artifact(out, steps=2, threads=1, options=ValidateOptions(write_reports=False))


#: DeepSeek-V2 MoE whose head count equals its expert count and whose latent width (kv_lora_rank) equals its expert
#: width (moe_intermediate_size): the absorbed attention's per-head product ``[4, tokens, 32]`` looks like an
#: expert's output, which a check guessing from shapes refused
HEADS_AS_EXPERTS = dict(num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, kv_lora_rank=32,
                        moe_intermediate_size=32, hidden_size=64, q_lora_rank=48, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, vocab_size=512, layers=2, first_k_dense_replace=1,
                        num_experts_per_tok=2, n_shared_experts=1)


def test_heads_equal_to_experts_exports_runs_and_validates(tmp_path):
    """`export`, `run` and `validate` through the real CLI on that checkpoint: `run`'s greedy tokens are
    transformers' own, and validation passes."""
    hf = hf_model(2, std=0.15, **HEADS_AS_EXPERTS)
    c = hf.config
    assert c.num_attention_heads == c.n_routed_experts and c.kv_lora_rank == c.moe_intermediate_size
    hf.save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "onnx"
    ok(cli("export", "--hf", tmp_path / "ckpt", "--out", out))
    prompt = [5, 17, 99, 3, 42, 7]
    record = json.loads(ok(cli("run", out, "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", 12,
                               "--json", "--threads", 1)))
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
    assert record["sequences"][0]["tokens"] == want
    validated = ok(cli("validate", out, "--steps", 4, "--threads", 1, "--out", tmp_path / "report"))
    assert "validation passed" in validated and (tmp_path / "report" / "report.json").is_file()


@pytest.mark.parametrize("target", ["artifact", "genai"])
def test_every_target_refuses_a_dense_moe_in_one_line(tmp_path, target, monkeypatch):
    """The same graph checks in every target of the export pipeline: a checkpoint's experts planted dense (every
    expert computed for every token, for this test only) are refused by `export` in one line, nothing written;
    genai included."""
    from mla_deploy.model import layers

    hf_model(2, std=0.15).save_pretrained(tmp_path / "ckpt")
    monkeypatch.setattr(layers.Experts, "forward", lambda self, x, w, idx: layers.dense_experts_reference(
        x, w, idx, self.gate_up_proj, self.down_proj))
    out = tmp_path / "out"
    done = cli("export", "--hf", tmp_path / "ckpt", "--out", out, "--target", target)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert lines[0].startswith("mla-deploy: error: decode graph model.onnx computes every expert for every token: ")
    assert "mlp.experts.gate_up_proj with every token of" in lines[0]
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
