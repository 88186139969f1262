"""Every sample runs as the README says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SAMPLES = Path(__file__).resolve().parent.parent / "samples"


def _run(script: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.slow
def test_export_and_run_sample(tmp_path):
    out = _run(SAMPLES / "01_export_and_run" / "example.py", str(tmp_path / "tiny"))
    assert "PyTorch agrees on every token" in out


def test_absorb_sample():
    out = _run(SAMPLES / "02_absorb_a_checkpoint" / "example.py")
    difference = float(out.split("max |logits difference|:")[1].split()[0])
    assert difference < 1e-4 and "24 numbers per token" in out


def test_random_checkpoint_sample(tmp_path):
    out = _run(SAMPLES / "03_random_checkpoint" / "make_checkpoint.py", str(tmp_path / "ckpt"), "--preset", "tiny",
               "--layers", "1", "--dtype", "fp32")
    assert "wrote" in out and (tmp_path / "ckpt" / "model.safetensors.index.json").is_file()
    from mla_deploy.checkpoint import load_checkpoint

    assert load_checkpoint(tmp_path / "ckpt").config.num_hidden_layers == 1
    refused = subprocess.run([sys.executable, str(SAMPLES / "03_random_checkpoint" / "make_checkpoint.py"),
                              str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=600)
    assert refused.returncode == 1 and "not an empty folder" in refused.stderr


def test_transformers_checkpoint_sample(tmp_path):
    """Any MLA type at its transformers class's defaults, cut to N layers, written by the class itself (tiny widths
    through --set): GLM-4.7-Flash's keeps its dense first layer, and mla-deploy reads what it wrote."""
    pytest.importorskip("transformers")
    script = SAMPLES / "03_random_checkpoint" / "transformers_checkpoint.py"
    tiny = ["--set", "hidden_size=64", "--set", "intermediate_size=96", "--set", "moe_intermediate_size=32",
            "--set", "num_attention_heads=4", "--set", "num_key_value_heads=4", "--set", "q_lora_rank=32",
            "--set", "kv_lora_rank=32", "--set", "qk_nope_head_dim=16", "--set", "qk_rope_head_dim=8",
            "--set", "v_head_dim=16", "--set", "n_routed_experts=8", "--set", "num_experts_per_tok=2",
            "--set", "vocab_size=256"]
    out = _run(script, str(tmp_path / "glm"), "--type", "glm4_moe_lite", "--layers", "2", *tiny)
    assert "wrote" in out and "glm4_moe_lite" in out
    from mla_deploy.checkpoint import load_checkpoint

    config = load_checkpoint(tmp_path / "glm").config
    assert (config.num_hidden_layers, config.hidden_size) == (2, 64)
    assert [config.is_moe_layer(i) for i in range(2)] == [False, True]
    for args, message in (((str(tmp_path / "glm"), "--type", "glm4_moe_lite"), "not an empty folder"),
                          ((str(tmp_path / "x"), "--type", "glm4_moe_lite", "--layers", "99"), "has 47"),
                          ((str(tmp_path / "y"), "--type", "glm4_moe_lite", "--set", "nope=1"), "no such key")):
        refused = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600)
        assert refused.returncode == 1 and message in refused.stderr and "Traceback" not in refused.stderr
        assert not Path(args[0]).exists() or args[0] == str(tmp_path / "glm")
