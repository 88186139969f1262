"""Recipes: the declarative TOML files under ``export/``, one per model preset.

A recipe's ``[model]`` table holds an :class:`~mla_deploy.config.MLAConfig` (with a nested
``[model.rope_scaling]`` table for YaRN). Every key is checked: an unknown section or field
is a :class:`~mla_deploy.errors.ConfigError`, never silently ignored.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import MLAConfig
from .errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SECTIONS = ("model",)


@dataclass(frozen=True)
class Recipe:
    """A resolved recipe.

    Attributes:
        name: the preset name (the file's stem).
        model: the model's dimensions.
        source: the file the recipe was read from.
    """

    name: str
    model: MLAConfig
    source: str


def presets_dir() -> Path:
    """The folder holding the built-in recipes (``export/`` of the source tree, packaged as ``mla_deploy._presets``)."""
    try:
        from importlib.resources import files

        packaged = Path(str(files("mla_deploy._presets")))
        if packaged.is_dir() and any(packaged.glob("*.toml")):
            return packaged
    except (ModuleNotFoundError, TypeError):
        pass
    return Path(__file__).resolve().parent.parent / "export"


def preset_names() -> list[str]:
    """Names of the built-in presets, sorted."""
    return sorted(p.stem for p in presets_dir().glob("*.toml"))


def load_recipe(name_or_path: str | Path) -> Recipe:
    """Load a built-in preset by name, or a recipe file by path.

    Raises:
        ConfigError: unknown preset, unreadable TOML, unknown section or field, bad value.
    """
    path = Path(name_or_path)
    if not (path.suffix == ".toml" or path.exists()):
        path = presets_dir() / f"{name_or_path}.toml"
        if not path.is_file():
            raise ConfigError(f"unknown preset {str(name_or_path)!r}; known presets: {', '.join(preset_names())}")
    if not path.is_file():
        raise ConfigError(f"no recipe file at {path}")
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: not a readable TOML recipe ({exc})") from None
    return recipe_from_dict(data, source=str(path), default_name=path.stem)


def recipe_from_dict(data: dict[str, Any], source: str, default_name: str) -> Recipe:
    """Build a :class:`Recipe` from parsed TOML."""
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"{source}: unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    if "model" not in data:
        raise ConfigError(f"{source}: no [model] section")
    model = dict(data["model"])
    model.setdefault("name", default_name)
    config = MLAConfig.from_dict(model, source=f"{source} [model]")
    return Recipe(name=config.name, model=config, source=source)
