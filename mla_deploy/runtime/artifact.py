"""Read an artifact directory's ``manifest.json`` and check that the files it names are there, whole."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..config import MLAConfig
from ..errors import ArtifactError, ConfigError

MANIFEST = "manifest.json"
FORMAT = "mla-deploy-artifact"


def load_manifest(artifact: str | Path) -> dict[str, Any]:
    """The manifest of ``artifact`` after checking its format and its graph files' presence and sizes.

    Raises:
        ArtifactError: no such directory, no or unreadable manifest, a graph file missing or truncated.
    """
    root = Path(artifact)
    if not root.is_dir():
        raise ArtifactError(f"no artifact directory at {root}")
    path = root / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{root} holds no {MANIFEST}; export into it first (mla-deploy export ... --out {root})")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{path} is not readable JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not an mla-deploy manifest")
    for key in ("model", "graphs", "precision", "cache"):
        if key not in manifest:
            raise ArtifactError(f"{path} lacks the field {key!r}")
    for role, graph in manifest["graphs"].items():
        file = root / graph["file"]
        if not file.is_file():
            raise ArtifactError(f"{role} graph {file} is missing")
        size = file.stat().st_size
        if "bytes" in graph and size != graph["bytes"]:
            raise ArtifactError(f"{role} graph {file} has {size} bytes, the manifest says {graph['bytes']} "
                                f"(truncated or replaced)")
        if graph.get("external_data") and not (root / graph["external_data"]).is_file():
            raise ArtifactError(f"{role} graph's weights {root / graph['external_data']} are missing")
    return manifest


def manifest_config(manifest: dict[str, Any]) -> MLAConfig:
    """The model config recorded in a manifest."""
    try:
        return MLAConfig.from_dict(manifest["model"], source="manifest.json [model]")
    except ConfigError as exc:
        raise ArtifactError(str(exc)) from None
