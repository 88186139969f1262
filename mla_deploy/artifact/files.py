"""Atomic file helpers: every file or folder mla-deploy writes appears whole or not at all.

* :func:`atomic_dir`: build a folder under a hidden temporary name beside the target, then swap it into place.
* :func:`atomic_write_text` / :func:`atomic_write_bytes` / :func:`atomic_file`: write a file under a hidden
  temporary name in the same folder, then ``os.replace`` it over the target.
* :func:`sha256_file`: the hex sha256 of a file, read in 1 MiB chunks; :func:`sampled_sha256`: of its size and
  256 of its 4 KiB pages, read past the page cache.
* :func:`followed`: where a path a user gave really is, its symbolic links followed: what a move or a delete acts
  on, so that ``--out LINK`` writes where the link points and never replaces the link or moves the files beside it.
* :func:`require_regular_file`: refuse, before any ``open``, a path that is a named pipe, a device or a socket
  (opening a FIFO blocks until a writer comes, deaf to Ctrl-C; a device reads forever).

Temporary names are ``.<name>.tmp-<pid>`` (a folder) and ``.<name>.tmp-<pid><suffix>`` (a file), so a
leftover is recognisable and never mistaken for a result. A leftover of a process that no longer runs (killed
with SIGKILL, a power cut) is removed by the next write of the same target (:func:`remove_stale`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Iterable, Iterator

from ..errors import InputError


def followed(path: str | Path) -> Path:
    """``path`` with every symbolic link in it followed (``os.path.realpath``; a path that does not exist yet is
    followed as far as it exists). Temporaries are made beside, and the swap happens at, this path: a link the user
    gave keeps pointing where it did, at the new result."""
    return Path(os.path.realpath(path))


#: what a file that is not a regular one is, by the ``stat`` test that recognises it
_FILE_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))


def require_regular_file(path: str | Path, error: type[Exception] = InputError) -> Path:
    """``path``, checked with ``stat`` (no ``open``) to be a regular file where it exists (links followed).

    Call it before opening a file a user named: ``open`` on a FIFO waits for a writer with signals deferred, and
    a character device such as ``/dev/zero`` never ends. A path that does not exist passes (the ``open`` that
    follows says so).

    Raises:
        ``error`` (an :class:`~mla_deploy.errors.MLADeployError` class): ``PATH is a named pipe (FIFO), not a file``.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return Path(path)
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
        raise error(f"{path} is {kind}, not a file")
    return Path(path)


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


#: pages :func:`sampled_sha256` reads, evenly spaced from the first to the last
SAMPLED_PAGES = 256
_PAGE = 4096


def sampled_sha256(path: str | Path, pages: int = SAMPLED_PAGES) -> str:
    """Hex sha256 of a file's size and of ``pages`` of its 4 KiB pages, evenly spaced from the first to the last
    (the whole file where it has no more): a check of a multi-GiB weights file that costs milliseconds where a full
    digest costs seconds. It finds a file rewritten, replaced or corrupted over any stretch of 1/``pages`` of its
    size, not one edited byte between the samples. The pages are read with ``O_DIRECT`` where the file system takes
    it, so that they do not enter the page cache in 4 KiB pages: a weights file later read into 2 MiB pages
    (``mla_deploy.ort.huge_pages``) keeps them."""
    size = os.path.getsize(path)
    count = -(-size // _PAGE)
    picks = sorted({(count - 1) * i // max(pages - 1, 1) for i in range(min(pages, count))}) if count else []
    try:
        read = _read_pages(path, picks, direct=True)
    except OSError:  # a file system without O_DIRECT (tmpfs refuses the open or the read)
        read = _read_pages(path, picks, direct=False)
    digest = hashlib.sha256(str(size).encode())
    for page in read:
        digest.update(page)
    return digest.hexdigest()


def _read_pages(path: str | Path, picks: list[int], direct: bool) -> list[bytes]:
    """The 4 KiB pages ``picks`` of ``path`` (the last one as long as the file), with ``O_DIRECT`` where
    ``direct``, into a page-aligned buffer as it wants."""
    import mmap

    buffer = mmap.mmap(-1, _PAGE)
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0))
    try:
        return [bytes(buffer[:os.preadv(fd, [buffer], page * _PAGE)]) for page in picks]
    finally:
        os.close(fd)
        buffer.close()


def temp_name(target: str | Path) -> Path:
    """The hidden temporary sibling of ``target`` used while it is being written."""
    target = Path(target)
    return target.parent / f".{target.name}.tmp-{os.getpid()}{target.suffix if target.suffix else ''}"


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def remove_stale(target: str | Path) -> list[Path]:
    """Remove the temporaries of ``target`` (``.<name>.tmp-<pid>...``, ``.<name>.old-<pid>``) left by processes
    that no longer run on this machine; returns what was removed."""
    target = Path(target)
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(?:tmp|old)-(\d+)")
    removed = []
    try:
        entries = list(target.parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = pattern.match(entry.name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                entry.unlink()
        if not os.path.lexists(entry):
            removed.append(entry)
    return removed


def replace_dir(tmp: Path, out: Path, keep: Iterable[str] = ()) -> None:
    """Move the finished folder ``tmp`` to ``out``, replacing an existing ``out`` only after ``tmp`` is in place.

    Args:
        keep: names of entries of the existing ``out`` that ``tmp`` does not hold and that must survive: they are
            moved into ``tmp`` before the swap (and moved back if the swap fails).
    """
    old, moved = None, []
    try:
        if out.exists():
            for name in keep:
                if os.path.lexists(out / name) and not os.path.lexists(tmp / name):
                    os.rename(out / name, tmp / name)
                    moved.append(name)
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
        tmp.rename(out)
    except BaseException:
        if old is not None and old.exists() and not out.exists():
            old.rename(out)
        for name in moved:
            os.rename(tmp / name, out / name)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(out: str | Path, keep: Iterable[str] = ()) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``out``; on success it replaces ``out``, on any failure (a signal
    the CLI turns into an exception included) it is removed. Temporaries of dead processes are removed first.

    Args:
        keep: entries of an existing ``out`` to keep in the new one (see :func:`replace_dir`).

    Example::

        with atomic_dir("build/tiny") as tmp:
            (tmp / "manifest.json").write_text(...)
    """
    out = followed(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    remove_stale(out)
    missing = [p for p in out.parents if not p.exists()]  # created here, removed again on failure
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        replace_dir(tmp, out, keep)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for parent in missing:
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is renamed over ``path``, on failure removed."""
    path = followed(path)
    tmp = temp_name(path)
    remove_stale(path)
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
