"""Exported tiny artifacts shared by the export, runtime and CLI tests (exported once per test process)."""

from __future__ import annotations

import atexit
import dataclasses
import functools
import shutil
import tempfile
from pathlib import Path

from mla_deploy import load_recipe

_ROOT = Path(tempfile.mkdtemp(prefix="mla-deploy-tests-"))
atexit.register(shutil.rmtree, _ROOT, True)


def tiny_recipe(cache_mode: str = "static", precision: str = "fp32", **export):
    """The tiny preset's recipe with some [export] settings replaced."""
    recipe = load_recipe("tiny")
    return recipe.replace(export=dataclasses.replace(recipe.export, cache_mode=cache_mode, precision=precision, **export))


def tiny_artifact(cache_mode: str = "static", precision: str = "fp32") -> Path:
    """The path of an export of the tiny preset (made on first use, once however the arguments are spelled)."""
    return _tiny_export(cache_mode, precision)


@functools.lru_cache(maxsize=None)
def _tiny_export(cache_mode: str, precision: str) -> Path:
    from mla_deploy.exporter import export_recipe

    out = _ROOT / f"tiny-{cache_mode}-{precision}"
    export_recipe(tiny_recipe(cache_mode, precision), out)
    return out


def reference_model(artifact: Path):
    """The original-form (CC) fp32 PyTorch model an artifact was exported from."""
    from mla_deploy.artifact import load_manifest
    from mla_deploy.validate.reference import load_reference_model

    return load_reference_model(artifact, load_manifest(artifact))
