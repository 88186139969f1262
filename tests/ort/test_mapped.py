"""Mapped weights faulted in when an engine opens (:mod:`mla_deploy.ort.mapped`): a file mapping this process made
is resident in its page tables after :func:`populate` and not before; a CPU engine's weights are resident once
``OrtEngine`` has opened it, and ``info()`` says so; only readable mappings of files under the folder count."""

from __future__ import annotations

import mmap
import re
import sys
from pathlib import Path

import pytest

from artifacts import tiny_recipe
from cli_run import cli, ok
from mla_deploy.ort import mapped
from mla_deploy.ort.engine import OrtEngine

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps and madvise: Linux")


def resident(folder: Path, suffix: str = "") -> tuple[int, int]:
    """``(size, rss)`` in bytes of this process's mappings of files under ``folder`` (ending in ``suffix``), as
    ``/proc/self/smaps`` gives them."""
    prefix, size, rss, current = str(folder.resolve()) + "/", 0, 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            parts = line.split(maxsplit=5)
            current = len(parts) == 6 and parts[5].startswith(prefix) and parts[5].endswith(suffix)
        elif current and line.startswith(("Size:", "Rss:")):
            kib = int(line.split()[1]) * 1024
            size, rss = (size + kib, rss) if line.startswith("Size:") else (size, rss + kib)
    return size, rss


@linux_only
def test_populate_faults_in_a_mapping_that_nothing_has_read(tmp_path):
    path = tmp_path / "weights.data"
    path.write_bytes(bytes(range(256)) * (16 << 12))  # 16 MiB
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ) as view:
        assert resident(tmp_path) == (16 << 20, 0)
        done = mapped.populate(tmp_path)
        assert resident(tmp_path) == (16 << 20, 16 << 20)
        assert (done.mapped_bytes, done.populated_bytes, done.reason) == (16 << 20, 16 << 20, None)
        assert done.describe().startswith("16.0 MiB of 16.0 MiB of mapped files faulted in in ")
        assert view[5] == 5
    assert mapped.populate(tmp_path) == mapped.Populated(0, 0, 0.0)  # unmapped: nothing to do


@linux_only
def test_an_engine_opens_with_its_weights_resident(tmp_path):
    from mla_deploy.exporter import export_recipe

    export_recipe(tiny_recipe("static", weights="int4"), tmp_path / "a")
    ok(cli("build", tmp_path / "a", "--target", "cpu"))
    engine = OrtEngine(tmp_path / "a", threads=1)
    size, rss = resident(tmp_path / "a" / "cpu", ".data")
    assert size > 0 and rss == size
    assert "of mapped files faulted in" in engine.info()["mapped_weights"]


def test_only_readable_mappings_of_files_under_the_folder_count(tmp_path):
    folder = tmp_path / "art"
    maps = "\n".join([
        f"1000-3000 r--p 00000000 08:01 1 {folder}/cpu/decode.data",
        f"3000-4000 ---p 00000000 08:01 1 {folder}/cpu/decode.data",
        f"5000-6000 r--p 00000000 08:01 2 {folder}-old/cpu/decode.data",
        f"7000-8000 r-xp 00000000 08:01 3 {folder}/cpu/cpu_ops.so",
        "9000-a000 rw-p 00000000 00:00 0 ",
        "b000-c000 rw-p 00000000 00:00 0 [heap]",
    ])
    assert mapped.mappings(folder, maps) == [(0x1000, 0x3000), (0x7000, 0x8000)]
