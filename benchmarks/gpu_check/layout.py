"""Where the GPU check keeps its files: one owner for every path the sub-commands share.

Here (the development machine): ``.whl/downloads/`` holds the wheels as PyPI serves them, ``.whl/gpu-check/part-K/``
the folders the ``run`` tool carries, one per call. There (the GPU machine): ``build/gpu-check/`` (the work folder,
kept between calls while the machine stays warm) holds the installed packages (``site/``), the exports, the logs
and one record per step. Both ``.whl/`` and ``build/`` are ignored by git, so neither travels unless carried.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "gpu-verification.md"
WHL = REPO / ".whl"
DOWNLOADS = WHL / "downloads"
PACK = WHL / "gpu-check"
MANIFEST = "manifest.json"
MiB = 2**20
#: the most one call may carry, the working tree included (the ``run`` tool's limit)
CALL_LIMIT = 64 * MiB
#: the largest part folder: the rest of a call's 64 MiB is left to the working tree
PART_LIMIT = 56 * MiB


def part_dir(index: int, pack: Path = PACK) -> Path:
    """The folder of part ``index`` (a path the ``run`` tool's ``carry`` names)."""
    return pack / f"part-{index}"


@dataclass(frozen=True)
class Work:
    """The work folder of ``run`` and ``install`` (default ``build/gpu-check``)."""

    root: Path

    @property
    def site(self) -> Path:
        """``pip install --target`` folder of the carried wheels."""
        return self.root / "site"

    @property
    def wheels(self) -> Path:
        return self.root / "wheels"

    @property
    def records(self) -> Path:
        return self.root / "records"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def artifacts(self) -> Path:
        return self.root / "artifacts"

    @property
    def env_file(self) -> Path:
        """Environment variables the later steps need (written by the CUDA-provider probe)."""
        return self.root / "env.json"

    @property
    def install_file(self) -> Path:
        return self.root / "install.json"

    @property
    def mode_file(self) -> Path:
        return self.root / "mode.json"


DEFAULT_WORK = Work(REPO / "build" / "gpu-check")
