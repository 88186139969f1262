"""Fixtures of the validation tests: tiny fp32 exports (made once per session) and copies to damage."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


def _export(cache_mode: str, root: Path) -> Path:
    """The tiny preset exported in ``cache_mode``: the shared test export when ``tests/artifacts.py`` has one."""
    try:
        from artifacts import tiny_artifact
    except ImportError:
        tiny_artifact = None
    if tiny_artifact is not None:
        return tiny_artifact(cache_mode, "fp32")
    import dataclasses

    from mla_deploy import load_recipe
    from mla_deploy.exporter import export_recipe

    recipe = load_recipe("tiny")
    recipe = recipe.replace(export=dataclasses.replace(recipe.export, cache_mode=cache_mode))
    out = root / f"tiny-{cache_mode}"
    export_recipe(recipe, out)
    return out


@pytest.fixture(scope="session")
def tiny_static(tmp_path_factory) -> Path:
    """The tiny preset exported with the static cache (never modified by a test: copy it first)."""
    return _export("static", tmp_path_factory.mktemp("validate-exports"))


@pytest.fixture(scope="session")
def tiny_concat(tmp_path_factory) -> Path:
    """The tiny preset exported with the concat cache (never modified by a test)."""
    return _export("concat", tmp_path_factory.mktemp("validate-exports"))


@pytest.fixture
def artifact_copy(tiny_static, tmp_path) -> Path:
    """A private copy of the static export, free to damage."""
    dst = tmp_path / "artifact"
    shutil.copytree(tiny_static, dst, ignore=shutil.ignore_patterns("validation"))
    return dst
