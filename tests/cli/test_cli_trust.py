"""The command line against hostile files and values (issue 50), each through a real `python -m mla_deploy`
process: an ``--out`` that is a symbolic link to the user's folder, checkpoint files that are named pipes or
devices, sizes past int64 or past the machine's memory, a standard output that is closed, a failed ``bench model``,
and an export option that a comparison block would ignore. Each is one line and a non-zero exit (or, for the
link, the export written where the link points), with no traceback and no user file touched."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from test_cli_errors import ENV, cli, error_line


def test_out_that_is_a_link_to_the_users_folder_is_written_there_and_the_link_kept(tmp_path):
    real = tmp_path / "mine"
    real.mkdir()
    (real / "notes.txt").write_text("the user's own file")
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    done = cli("export", "--preset", "tiny", "--block", "mha", "--out", "link", "--overwrite", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert sorted(p.name for p in real.iterdir()) == ["manifest.json", "mha.onnx", "notes.txt", "reference.safetensors"]
    assert (real / "notes.txt").read_text() == "the user's own file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "mine"]  # no .link.old-PID, no temporary


@pytest.mark.parametrize("where", ["config.json", "model.safetensors", "the --hf path", "the --recipe path"])
def test_a_checkpoint_file_that_is_a_fifo_or_a_device_is_refused_before_it_is_opened(tmp_path, where):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    if where == "the --hf path":
        args = ["--hf", "/dev/zero"]
        words = ["/dev/zero", "character device"]
    elif where == "the --recipe path":
        os.mkfifo(tmp_path / "recipe.toml")
        args, words = ["--recipe", str(tmp_path / "recipe.toml")], ["recipe.toml", "named pipe"]
    else:
        (folder / "config.json").write_text("{}")
        (folder / where).unlink(missing_ok=True)
        os.mkfifo(folder / where)
        args, words = ["--hf", str(folder)], [where, "named pipe"]
    # before the check, opening the FIFO waited for a writer forever, deaf to SIGINT and SIGTERM
    error_line(cli("export", *args, "--out", str(tmp_path / "out"), cwd=tmp_path, timeout=120), 1, *words)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, words", [
    (["export", "--preset", "tiny", "--max-cache-length", str(2 ** 40), "--out", "o"], ["--max-cache-length", "TiB"]),
    (["export", "--preset", "tiny", "--max-cache-length", str(10 ** 23), "--out", "o"], ["--max-cache-length", "<="]),
    (["bench", "model", "--preset", "tiny", "--context", str(10 ** 30), "--out", "o"], ["--context", "<="]),
    (["run", "ART", "--prompt-ids", "1,2", "--max-new-tokens", str(2 ** 64)], ["--max-new-tokens", "<="]),
    (["serve", "TEXT", "--port", "0", "--max-batch", str(2 ** 30)], ["--max-batch", "TiB of memory"]),
    (["serve", "TEXT", "--port", "0", "--max-cache-length", str(2 ** 70)], ["--max-cache-length", "<="]),
])
def test_sizes_past_int64_or_the_machines_memory_are_one_line(tmp_path, args, words):
    from artifacts import text_artifact, tiny_artifact

    paths = {"ART": str(tiny_artifact("static")), "TEXT": str(text_artifact("static")) if "TEXT" in args else ""}
    error_line(cli(*[paths.get(a, a) for a in args], cwd=tmp_path), 1, *words)
    assert not (tmp_path / "o").exists()


def test_a_closed_standard_output_is_no_traceback(tmp_path):
    for args in (["inspect", "--preset", "tiny"], ["presets"]):
        reader_gone = subprocess.Popen([sys.executable, "-m", "mla_deploy", *args], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, env=ENV, cwd=tmp_path)
        reader_gone.stdout.close()  # `| head -0`: the reader left before anything was written
        stderr = reader_gone.stderr.read().decode()
        assert reader_gone.wait(120) in (0, 1) and stderr == "", stderr
        closed = subprocess.run([sys.executable, "-m", "mla_deploy", *args], stderr=subprocess.PIPE, text=True,
                                env=ENV, cwd=tmp_path, preexec_fn=lambda: os.close(1), timeout=120)  # `>&-`
        assert closed.returncode == 0 and closed.stderr == "", closed.stderr


def test_a_failed_bench_model_leaves_no_empty_out(tmp_path):
    pytest.importorskip("transformers")
    from hf_oracle import text_checkpoint

    checkpoint = tmp_path / "ckpt"
    text_checkpoint(checkpoint, 2, "post_processor")
    weights = next(checkpoint.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:4000])  # a truncated download
    error_line(cli("bench", "model", "--hf", str(checkpoint), "--out", "results/run1", "--no-transformers",
                   "--context", "0", "--prompt-length", "8", cwd=tmp_path), 1, "safetensors")
    assert not (tmp_path / "results").exists()


def test_a_comparison_block_refuses_the_export_settings_it_would_ignore(tmp_path):
    error_line(cli("export", "--preset", "tiny", "--block", "mha", "--weights", "int4", "--out", "o", cwd=tmp_path),
               1, "--block mha", "--weights")
    assert not (tmp_path / "o").exists()


def test_require_regular_file_names_what_the_path_is(tmp_path):
    """The public check that checkpoint.py and config.py are to call before they open a user's file."""
    from mla_deploy.artifact.files import require_regular_file
    from mla_deploy.errors import CheckpointError

    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(CheckpointError, match="named pipe"):
        require_regular_file(tmp_path / "pipe", CheckpointError)
    with pytest.raises(CheckpointError, match="folder"):
        require_regular_file(tmp_path, CheckpointError)
    (tmp_path / "file").write_text("x")
    assert require_regular_file(tmp_path / "file") == tmp_path / "file"
    assert require_regular_file(tmp_path / "absent") == tmp_path / "absent"
