"""Where an export may write: the policy for an existing ``--out`` (no torch, so the CLI checks it before the
heavy imports, and the exporter checks it again).

* :func:`check_export_target`: refuse an ``out`` that is a file, not a folder, a non-empty folder without an
  artifact, an artifact of a different model (unless overwriting), or a folder whose user file the export would
  replace; return the names there that are not the artifact's, which the export keeps.
* :func:`probe_writable`: make and remove the export's temporary folder, so that an ``out`` that cannot be
  written (a read-only place, a parent that is a file, ``/proc``) is refused before any work.

An ``out`` that is a symbolic link is the folder it points to (:func:`~mla_deploy.artifact.files.followed`), as
the export itself writes there.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from ..errors import ExportError
from .files import followed
from .manifest import MANIFEST, read_fingerprint
from .tokenizer_files import TOKENIZER_FILES

#: the names an export may write into its folder (a checkpoint's tokenizer files included); whatever else is there
#: is kept
ARTIFACT_FILES = (MANIFEST, "weights.data", "model.onnx", "prefill.onnx", "decode.onnx", *TOKENIZER_FILES)


def check_export_target(out: str | Path, fingerprint: str | None = None, overwrite: bool = False) -> list[str]:
    """Check that ``out`` can take an export of the model ``fingerprint`` (None: not known yet, not compared).

    Returns:
        the names of the entries of ``out`` that are not files of the artifact there (kept by the export).
    Raises:
        ExportError: naming the problem.
    """
    given = Path(out)
    if not given.exists():
        if given.is_symlink():
            raise ExportError(f"{given} is a broken symbolic link")
        return []
    out = followed(given)
    if not out.is_dir():
        raise ExportError(f"{out} exists and is not a directory")
    try:
        names = sorted(entry.name for entry in out.iterdir())
    except OSError as exc:
        raise ExportError(f"cannot read {out}: {exc.strerror or exc}") from None
    if not (out / MANIFEST).is_file():
        if names:
            raise ExportError(f"{out} is not empty and holds no mla-deploy artifact; choose another --out")
        return []
    old = read_fingerprint(out)
    if fingerprint is not None and old != fingerprint and not overwrite:
        raise ExportError(f"{out} already holds a different model (fingerprint {old}, this one {fingerprint}); "
                          f"choose another --out or pass --overwrite")
    owned = artifact_files(out)
    keep = [name for name in names if name not in owned]
    clash = [name for name in keep if name in ARTIFACT_FILES]
    if clash:
        raise ExportError(f"{out / clash[0]} is not a file of the artifact there and the export would replace it; "
                          f"move it away first")
    return keep


def artifact_files(out: str | Path) -> set[str]:
    """The names of the files the artifact in ``out`` consists of, as its manifest records them.

    Raises:
        ExportError: the manifest is not readable.
    """
    path = Path(out) / MANIFEST
    try:
        data = json.loads(path.read_text())
        files = {MANIFEST, *(g["file"] for g in data.get("graphs", {}).values())}
        if data.get("weights_data"):
            files.add(data["weights_data"]["file"])
        files.update(f["file"] for f in (data.get("tokenizer") or {}).get("files", []))
        return {Path(f).name for f in files}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ExportError(f"{path} is not readable; remove {out} or choose another --out") from None


def probe_writable(out: str | Path) -> None:
    """Make and remove ``out``'s temporary folder (and the parents it needs).

    Raises:
        ExportError: ``cannot write OUT: <reason>``.
    """
    given, out = Path(out), followed(out)
    missing = [p for p in out.parents if not p.exists()]
    probe = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        probe.mkdir(parents=True)
        probe.rmdir()
    except OSError as exc:
        raise ExportError(f"cannot write {given}: {exc.strerror or exc}") from None
    finally:
        for parent in missing:
            with contextlib.suppress(OSError):
                parent.rmdir()
