"""Import the plugin sources of ``plugins/mla_decode`` (beside the ``mla_deploy`` package in a source checkout).

They are imported as the package ``mla_deploy_plugins.mla_decode`` from their folder, so the top-level name
``plugins`` never has to be on ``sys.path``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from ..errors import RuntimeMissingError

PACKAGE = "mla_deploy_plugins"


def plugins_dir() -> Path:
    """``<source checkout>/plugins``."""
    return Path(__file__).resolve().parents[2] / "plugins"


def _package(name: str, folder: Path) -> ModuleType:
    init = folder / "__init__.py"
    if not init.is_file():
        raise RuntimeMissingError(f"the plugin sources {folder} are missing (they ship with the source checkout of "
                                  f"mla-deploy, not with the wheel)")
    loaded = sys.modules.get(name)
    if loaded is not None:
        if Path(loaded.__path__[0]).resolve() != folder.resolve():
            raise RuntimeMissingError(f"{name} is already loaded from {loaded.__path__[0]}, not {folder}")
        return loaded
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_plugin_module(submodule: str, folder: Path | None = None) -> ModuleType:
    """Import ``plugins/mla_decode/<submodule>.py`` (``reference``, ``triton_kernel``, ``trt_plugin``, ``bench``).

    Args:
        submodule: the module's name.
        folder: the ``plugins`` folder (default: :func:`plugins_dir`).
    Raises:
        RuntimeMissingError: the sources are not there, or the module needs a package that is missing
            (``triton`` for the kernel, ``tensorrt`` for the plugin registration).
    """
    root = Path(folder) if folder is not None else plugins_dir()
    _package(PACKAGE, root)
    _package(f"{PACKAGE}.mla_decode", root / "mla_decode")
    try:
        return importlib.import_module(f"{PACKAGE}.mla_decode.{submodule}")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in ("triton", "tensorrt"):
            raise RuntimeMissingError(f"plugins/mla_decode/{submodule}.py needs {exc.name.split('.')[0]}, which is "
                                      f"not installed") from exc
        raise


def register_mla_decode_plugin() -> str:
    """Register ``mla_deploy::MlaDecode`` with TensorRT's plugin registry (idempotent); returns the plugin id."""
    return load_plugin_module("trt_plugin").PLUGIN_ID
