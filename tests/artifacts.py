"""Exported tiny artifacts shared by the export, runtime and CLI tests: each exported once per test run.

An export of the tiny preset costs about 30 s of CPU (tracing two graphs), so each variant is made once and shared:
within a process through a cache, and across the processes of a parallel run (pytest-xdist's workers) through the
folder named by :data:`ROOT_ENV`, which tests/conftest.py creates before the workers start and removes at the end;
the first process to need a variant exports it under a lock while the others wait for it. The artifacts are never
modified by a test (copy one first).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import fcntl
import functools
import os
import shutil
import tempfile
from pathlib import Path

from mla_deploy import load_recipe

#: the environment variable naming the folder of the shared exports (set by tests/conftest.py)
ROOT_ENV = "MLA_DEPLOY_TEST_ARTIFACTS"


@functools.lru_cache(maxsize=None)
def shared_root() -> Path:
    """The folder of the exports shared by this run's processes (a private one, removed at exit, when no run
    made one: a test module imported alone)."""
    if os.environ.get(ROOT_ENV):
        return Path(os.environ[ROOT_ENV])
    root = Path(tempfile.mkdtemp(prefix="mla-deploy-tests-"))
    atexit.register(shutil.rmtree, root, True)
    return root


@contextlib.contextmanager
def exclusive(name: str):
    """Hold the run-wide lock ``name`` (an exclusive ``flock`` on a file of :func:`shared_root`)."""
    with open(shared_root() / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def made_once(name: str, make) -> Path:
    """``shared_root() / name``, made by ``make(path)`` by the first process of the run that asks for it."""
    out = shared_root() / name
    done = shared_root() / f".{name}.done"
    with exclusive(name):
        if not done.exists():
            if out.exists():  # a process that was killed while making it
                shutil.rmtree(out)
            make(out)
            done.touch()
    return out


def tiny_recipe(cache_mode: str = "static", precision: str = "fp32", **export):
    """The tiny preset's recipe with some [export] settings replaced."""
    recipe = load_recipe("tiny")
    return recipe.replace(export=dataclasses.replace(recipe.export, cache_mode=cache_mode, precision=precision, **export))


def tiny_artifact(cache_mode: str = "static", precision: str = "fp32", **export) -> Path:
    """The path of an export of the tiny preset (made once per run however the arguments are spelled; ``export``:
    other [export] settings, given as keywords with simple values)."""
    return _tiny_export(cache_mode, precision, tuple(sorted(export.items())))


@functools.lru_cache(maxsize=None)
def _tiny_export(cache_mode: str, precision: str, export: tuple) -> Path:
    from mla_deploy.exporter import export_recipe

    name = "-".join(["tiny", cache_mode, precision, *(f"{k}={v}" for k, v in export)])
    return made_once(name, lambda out: export_recipe(tiny_recipe(cache_mode, precision, **dict(export)), out))


def reference_model(artifact: Path):
    """The original-form (CC) fp32 PyTorch model an artifact was exported from."""
    from mla_deploy.artifact import load_manifest
    from mla_deploy.validate.reference import load_reference_model

    return load_reference_model(artifact, load_manifest(artifact))


def text_artifact(cache_mode: str = "static", capacity: int = 256) -> Path:
    """An export (``mla-deploy export --hf``) of a transformers-written tiny DeepSeek-V2 checkpoint saved with its
    tokenizer (tests/hf_oracle.py's ``text_checkpoint``), made once per run per cache mode and capacity (the
    serving tests are written for 256 tokens: a prompt of 400 words is past it; the model has 512 positions)."""
    name = f"text-v2-{cache_mode}" + ("" if capacity == 256 else f"-{capacity}")
    return made_once(name, functools.partial(_export_text, cache_mode=cache_mode, capacity=capacity))


def _export_text(out: Path, cache_mode: str, capacity: int) -> None:
    from cli_run import cli, ok
    from hf_oracle import text_checkpoint

    checkpoint = out.parent / f"{out.name}-checkpoint"
    text_checkpoint(checkpoint, 2, "post_processor")
    ok(cli("export", "--hf", checkpoint, "--out", out, "--cache-mode", cache_mode, "--max-cache-length",
           str(capacity)))
