"""Atomic file helpers: every file or folder mla-deploy writes appears whole or not at all.

* :func:`atomic_dir`: build a folder under a hidden temporary name beside the target, then swap it into place.
* :func:`atomic_write_text` / :func:`atomic_write_bytes` / :func:`atomic_file`: write a file under a hidden
  temporary name in the same folder, then ``os.replace`` it over the target.
* :func:`sha256_file`: the hex sha256 of a file, read in 1 MiB chunks.

Temporary names are ``.<name>.tmp-<pid>`` (a folder) and ``.<name>.tmp-<pid><suffix>`` (a file), so a
leftover is recognisable and never mistaken for a result.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from pathlib import Path
from typing import Iterator


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def temp_name(target: str | Path) -> Path:
    """The hidden temporary sibling of ``target`` used while it is being written."""
    target = Path(target)
    return target.parent / f".{target.name}.tmp-{os.getpid()}{target.suffix if target.suffix else ''}"


def replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished folder ``tmp`` to ``out``, replacing an existing ``out`` only after ``tmp`` is in place."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        if old is not None:
            old.rename(out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(out: str | Path) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``out``; on success it replaces ``out``, on any failure it is removed.

    Example::

        with atomic_dir("build/tiny") as tmp:
            (tmp / "manifest.json").write_text(...)
    """
    out = Path(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is renamed over ``path``, on failure removed."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically; returns ``path``."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; returns ``path``."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)
