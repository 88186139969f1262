"""`mla-deploy export` and `mla-deploy run` as a user runs them: real processes, real files."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from artifacts import tiny_artifact
from mla_deploy.artifact import load_manifest


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "mla_deploy", *args], capture_output=True, text=True, cwd=cwd,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}, timeout=600)


def _one_line_error(result):
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mla-deploy: error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.mark.slow
def test_export_then_run_the_tiny_preset(tmp_path):
    out = tmp_path / "tiny"
    done = cli("export", "--preset", "tiny", "--cache-mode", "concat", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "exported tiny" in done.stdout and "decode" in done.stdout
    assert load_manifest(out).layout.mode == "concat"
    ran = cli("run", str(out), "--prompt-ids", "1,2,3", "--prompt-ids", "4,5", "--max-new-tokens", "8")
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[0].startswith("sequence 0: ") and len(lines[0].split(": ")[1].split(",")) == 8
    assert lines[1].startswith("sequence 1: ")
    assert "provider CPUExecutionProvider" in lines[2] and "tokens/s" in lines[2]
    again = cli("export", "--preset", "tiny", "--out", str(out), "--layers", "1")
    assert "already holds a different model" in _one_line_error(again)


def test_run_errors_are_one_line():
    artifact = str(tiny_artifact("static"))
    assert "capacity" in _one_line_error(cli("run", artifact, "--prompt-ids", "1,2,3", "--max-new-tokens", "200"))
    assert "vocabulary" in _one_line_error(cli("run", artifact, "--prompt-ids", "1,2,999"))
    assert "comma-separated" in _one_line_error(cli("run", artifact, "--prompt-ids", "1,x"))
    assert "no artifact directory" in _one_line_error(cli("run", artifact + "-missing", "--prompt-ids", "1"))


def test_export_dump_recipe_and_bad_option(tmp_path):
    dumped = cli("export", "--preset", "tiny", "--out", str(tmp_path / "x"), "--dump-recipe", "--precision", "bf16")
    assert dumped.returncode == 0 and json.loads(dumped.stdout)["export"]["precision"] == "bf16"
    assert not (tmp_path / "x").exists()
    assert "exactly one" in _one_line_error(cli("export", "--out", str(tmp_path / "y")))
    too_many = cli("export", "--preset", "tiny", "--out", str(tmp_path / "z"), "--layers", "999")
    assert "layers must be an integer in 1..2" in _one_line_error(too_many) and not (tmp_path / "z").exists()
