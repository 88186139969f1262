"""The tokenizer files an artifact carries from its checkpoint, and their record in ``manifest.json``.

A checkpoint export copies the checkpoint's tokenizer files (:data:`TOKENIZER_FILES`, those present) into the
artifact's root, beside the graphs, so the artifact folder is also a tokenizer folder transformers can read.
The manifest records each copied file's name, size and sha256 (:class:`TokenizerFiles`); an artifact without
them (a preset export, or a checkpoint without ``tokenizer.json``) runs with token ids only.

Reading the files (tokenizer, chat template, end-of-sequence ids) is :mod:`mla_deploy.generate.tokenizer`'s job.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ArtifactError
from .files import sha256_file

#: the files copied from a checkpoint when present; ``tokenizer.json`` is required for the rest to be copied
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
REQUIRED = "tokenizer.json"


@dataclass(frozen=True)
class TokenizerFiles:
    """The tokenizer files of an artifact: ``({"file", "bytes", "sha256"}, ...)``, ``tokenizer.json`` first."""

    files: tuple

    @property
    def names(self) -> list[str]:
        return [f["file"] for f in self.files]

    def to_dict(self) -> dict[str, Any]:
        return {"files": [dict(f) for f in self.files]}

    @classmethod
    def from_dict(cls, data: Any, source: str) -> "TokenizerFiles":
        """Parse the manifest's ``tokenizer`` record. Raises: ArtifactError when it is malformed."""
        files = data.get("files") if isinstance(data, dict) else None
        ok = isinstance(files, list) and all(
            isinstance(f, dict) and f.get("file") in TOKENIZER_FILES and isinstance(f.get("bytes"), int)
            and isinstance(f.get("sha256"), str) for f in files)
        if not ok or REQUIRED not in [f["file"] for f in files]:
            raise ArtifactError(f"{source}: [tokenizer] must list {REQUIRED} and the other tokenizer files, each "
                                f"with its bytes and sha256")
        return cls(tuple(dict(f) for f in files))

    def check(self, root: Path, verify_hashes: bool) -> None:
        """Each file is present with its recorded size (and sha256). Raises: ArtifactError naming the file."""
        for record in self.files:
            path = root / record["file"]
            if not path.is_file():
                raise ArtifactError(f"the tokenizer file {path} is missing")
            if path.stat().st_size != record["bytes"]:
                raise ArtifactError(f"the tokenizer file {path} has {path.stat().st_size} bytes, the manifest says "
                                    f"{record['bytes']} (truncated or replaced)")
            if verify_hashes and sha256_file(path) != record["sha256"]:
                raise ArtifactError(f"the tokenizer file {path} does not match the sha256 in manifest.json (modified)")


def copy_tokenizer_files(checkpoint: str | Path, folder: str | Path) -> TokenizerFiles | None:
    """Copy the tokenizer files of ``checkpoint`` present there into ``folder``.

    Returns:
        their record, or None when the checkpoint has no ``tokenizer.json`` (nothing is copied).
    """
    checkpoint, folder = Path(checkpoint), Path(folder)
    if checkpoint.is_file():
        checkpoint = checkpoint.parent
    if not (checkpoint / REQUIRED).is_file():
        return None
    records = []
    for name in TOKENIZER_FILES:
        src = checkpoint / name
        if src.is_file():
            shutil.copyfile(src, folder / name)
            copy = folder / name
            records.append({"file": name, "bytes": copy.stat().st_size, "sha256": sha256_file(copy)})
    return TokenizerFiles(tuple(records))
