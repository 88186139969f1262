"""Helpers of the validation tests that damage an artifact copy."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def rerecord(artifact: Path, role: str) -> None:
    """Make the manifest's bytes and sha256 of ``role``'s graph match the file again (an export that is
    internally consistent, but wrong)."""
    manifest_path = artifact / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    data = (artifact / manifest["graphs"][role]["file"]).read_bytes()
    manifest["graphs"][role]["bytes"] = len(data)
    manifest["graphs"][role]["sha256"] = hashlib.sha256(data).hexdigest()
    manifest_path.write_text(json.dumps(manifest, indent=2))


def scale_initializer(artifact: Path, role: str, name: str, factor: float) -> None:
    """Multiply one weight of a graph by ``factor`` and save the graph."""
    import onnx
    from onnx import numpy_helper

    path = artifact / f"{role}.onnx"
    model = onnx.load(str(path))
    for init in model.graph.initializer:
        if init.name == name:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * factor, name))
            break
    else:
        raise AssertionError(f"no initializer {name} in {path}")
    onnx.save(model, str(path))
