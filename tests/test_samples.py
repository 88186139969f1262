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
