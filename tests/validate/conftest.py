"""Fixtures of the validation tests: tiny exports (made once per session) and copies to damage."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


def _export(cache_mode: str, root: Path, precision: str = "fp32") -> Path:
    """The tiny preset exported in ``cache_mode`` and ``precision``: the shared test export when
    ``tests/artifacts.py`` has one."""
    try:
        from artifacts import tiny_artifact
    except ImportError:
        tiny_artifact = None
    if tiny_artifact is not None:
        return tiny_artifact(cache_mode, precision)
    import dataclasses

    from mla_deploy import load_recipe
    from mla_deploy.exporter import export_recipe

    recipe = load_recipe("tiny")
    recipe = recipe.replace(export=dataclasses.replace(recipe.export, cache_mode=cache_mode, precision=precision))
    out = root / f"tiny-{cache_mode}-{precision}"
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


@pytest.fixture(scope="session")
def tiny_static_fp16(tmp_path_factory) -> Path:
    """The tiny preset exported in fp16 with the static cache (never modified by a test)."""
    return _export("static", tmp_path_factory.mktemp("validate-exports"), "fp16")


@pytest.fixture
def artifact_copy(tiny_static, tmp_path) -> Path:
    """A private copy of the static export, free to damage."""
    dst = tmp_path / "artifact"
    shutil.copytree(tiny_static, dst, ignore=shutil.ignore_patterns("validation"))
    return dst
