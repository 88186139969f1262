"""pyproject.toml lists every package (the list is written by hand because the presets live in export/)."""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_is_listed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "mla_deploy").rglob("__init__.py")}
    assert found - listed == set(), "add these to [tool.setuptools] packages"
    assert "mla_deploy._presets" in listed


def test_every_preset_is_a_toml_in_export():
    from mla_deploy import preset_names

    assert preset_names() == sorted(p.stem for p in (ROOT / "export").glob("*.toml"))
    assert {"tiny", "deepseek-v2-lite", "deepseek-v2", "deepseek-v3", "kimi-k2", "glm-4.7-flash", "minicpm3-4b",
            "mistral-small-4", "deepseek-v3.2", "glm-5"} <= set(preset_names())
