"""The atomic file helpers and the export target policy: temporaries of dead processes removed, kept entries
survive a swap (and a failed one), an output folder's user files are never replaced."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mla_deploy.artifact.files import atomic_dir, atomic_file, remove_stale
from mla_deploy.artifact.target import check_export_target, probe_writable
from mla_deploy.errors import ExportError


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_remove_stale_removes_only_dead_processes_temporaries(tmp_path):
    target = tmp_path / "art"
    dead, alive = _dead_pid(), subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        for name in (f".art.tmp-{dead}", f".art.old-{dead}", f".art.tmp-{alive.pid}", f".other.tmp-{dead}"):
            (tmp_path / name).mkdir()
            (tmp_path / name / "x").write_text("x")
        (tmp_path / f".art.json.tmp-{dead}.json").write_text("{}")  # another target's file: not ours
        removed = remove_stale(target)
    finally:
        alive.kill()
        alive.wait()
    assert sorted(p.name for p in removed) == sorted([f".art.tmp-{dead}", f".art.old-{dead}"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f".art.tmp-{alive.pid}", f".other.tmp-{dead}", f".art.json.tmp-{dead}.json"])


def test_atomic_dir_keeps_named_entries_across_the_swap(tmp_path):
    out = tmp_path / "art"
    out.mkdir()
    (out / "old.onnx").write_text("old graph")
    (out / "validation").mkdir()
    (out / "validation" / "report.md").write_text("report")
    with atomic_dir(out, keep=["validation"]) as tmp:
        (tmp / "new.onnx").write_text("new graph")
    assert sorted(p.name for p in out.iterdir()) == ["new.onnx", "validation"]
    assert (out / "validation" / "report.md").read_text() == "report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_a_failed_swap_puts_the_kept_entries_back(tmp_path):
    out = tmp_path / "art"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "old.onnx").write_text("old graph")
    with pytest.raises(RuntimeError, match="late failure"):
        with atomic_dir(out, keep=["notes.txt"]) as tmp:
            (tmp / "new.onnx").write_text("new graph")
            raise RuntimeError("late failure")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "old.onnx"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_a_failed_atomic_dir_removes_the_parents_it_made(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_dir(tmp_path / "a" / "b" / "art"):
            raise RuntimeError("failure")
    assert not any(tmp_path.iterdir())


def test_a_failed_atomic_file_leaves_the_old_file(tmp_path):
    path = tmp_path / "run_results.json"
    path.write_text("old")
    with pytest.raises(OSError):
        with atomic_file(path) as tmp:
            tmp.write_text("half")
            raise OSError(28, "No space left on device")
    assert [p.name for p in tmp_path.iterdir()] == ["run_results.json"] and path.read_text() == "old"


def test_export_target_policy(tmp_path):
    art = tmp_path / "art"
    art.mkdir()
    manifest = {"fingerprint": "abc", "graphs": {"prefill": {"file": "prefill.onnx"}, "decode": {"file": "decode.onnx"}},
                "weights_data": {"file": "weights.data"}}
    (art / "manifest.json").write_text(json.dumps(manifest))
    for name in ("prefill.onnx", "decode.onnx", "weights.data", "notes.txt"):
        (art / name).write_text(name)
    (art / "trt").mkdir()
    assert check_export_target(art, "abc") == ["notes.txt", "trt"]
    assert check_export_target(art, "other", overwrite=True) == ["notes.txt", "trt"]
    with pytest.raises(ExportError, match="different model"):
        check_export_target(art, "other")
    (art / "model.onnx").write_text("the user's")
    with pytest.raises(ExportError, match="model.onnx is not a file of the artifact"):
        check_export_target(art, "abc")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="not a directory"):
        check_export_target(tmp_path / "file")
    with pytest.raises(ExportError, match="Not a directory"):
        probe_writable(tmp_path / "file" / "sub")
    probe_writable(tmp_path / "new" / "art")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "file"]
