"""Shared test setup: the helper modules beside this file (hf_oracle, helpers, artifacts) are importable from every
test folder, and the folder of the exports shared by a run's processes (tests/artifacts.py) is made before the test
processes start (pytest-xdist's workers inherit its name) and removed at the end."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from artifacts import ROOT_ENV  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--serve-load-seconds", type=float, default=6.0,
                     help="how long the serving load test keeps its 64 clients streaming (the issue's run: 60)")


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the main process (a worker inherits the variable)
        config._shared_artifacts = tempfile.mkdtemp(prefix="mla-deploy-tests-")
        os.environ[ROOT_ENV] = config._shared_artifacts


def pytest_unconfigure(config):
    root = getattr(config, "_shared_artifacts", None)
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)
        os.environ.pop(ROOT_ENV, None)
