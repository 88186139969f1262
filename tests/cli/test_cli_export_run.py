"""`mla-deploy export` and `mla-deploy run` as a user runs them: real processes, real files (the one-line errors
through the command group in the test's process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from artifacts import tiny_artifact
from cli_run import cli, cli_process
from mla_deploy.artifact import load_manifest


def _one_line_error(result):
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mla-deploy: error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.mark.slow
def test_export_then_run_the_tiny_preset(tmp_path):
    out = tmp_path / "tiny"
    done = cli_process("export", "--preset", "tiny", "--cache-mode", "concat", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "exported tiny" in done.stdout and "decode" in done.stdout
    assert load_manifest(out).layout.mode == "concat"
    ran = cli_process("run", str(out), "--prompt-ids", "1,2,3", "--prompt-ids", "4,5", "--max-new-tokens", "8")
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[0].startswith("sequence 0: ") and len(lines[0].split(": ")[1].split(",")) == 8
    assert lines[1].startswith("sequence 1: ")
    assert "provider CPUExecutionProvider" in lines[2] and "tokens/s" in lines[2]
    again = cli_process("export", "--preset", "tiny", "--out", str(out), "--layers", "1")
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


def test_ctrl_c_during_run_keeps_the_ids_so_far_then_one_error_line(tmp_path):
    """SIGINT in the middle of a long generation (the tiny preset with room for 60000 new tokens in a static cache):
    the ids streamed so far stay on stdout and their line is ended; then one error line and exit 130. The ids are
    the greedy generation's own, up to where it stopped."""
    import dataclasses
    import re

    from artifacts import tiny_recipe
    from mla_deploy.ort.engine import OrtEngine
    from mla_deploy.exporter import export_recipe

    recipe, new = tiny_recipe("static", "fp32", max_cache_length=1 << 16), 60000
    recipe = recipe.replace(model=dataclasses.replace(recipe.model, max_position_embeddings=1 << 16))
    export_recipe(recipe, tmp_path / "long")
    stdout, stderr, status = _interrupt_when_streaming(["run", str(tmp_path / "long"), "--prompt-ids", "1,2,3",
                                                        "--max-new-tokens", str(new)], commas=3)
    assert status == 130, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mla-deploy: error: interrupted (SIGINT)"), stderr
    match = re.fullmatch(r"sequence 0: (\d+(?:,\d+)*)\n", stdout)
    assert match, stdout[-300:]
    ids = [int(i) for i in match.group(1).split(",")]
    assert 3 < len(ids) < new  # stopped in the middle
    stream = OrtEngine(tmp_path / "long", threads=1).stream([[1, 2, 3]], new)  # the same request, in process
    assert ids == [step.tokens[0] for step, _ in zip(stream, range(len(ids)))]


def _interrupt_when_streaming(args: list[str], commas: int, timeout: float = 300) -> tuple[str, str, int]:
    """Run ``mla-deploy ARGS``, send SIGINT once its stdout holds ``commas`` commas; (stdout, stderr, status)."""
    import os
    import select
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "mla_deploy", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # not ignored
    seen, deadline = b"", time.monotonic() + timeout
    try:
        while seen.count(b",") < commas:
            assert proc.poll() is None and time.monotonic() < deadline, (seen, proc.stderr.read())
            if select.select([proc.stdout], [], [], 1.0)[0]:
                seen += os.read(proc.stdout.fileno(), 1 << 16)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return (seen + out).decode(), err.decode(), proc.returncode

