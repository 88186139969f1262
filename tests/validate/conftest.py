"""Fixtures of the validation tests: tiny exports (made once per session) and copies to damage."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

#: the static cache capacity of the quantized V3 test exports
STATIC_CAPACITY = 64


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


@pytest.fixture(scope="session")
def trained_checkpoints(tmp_path_factory):
    """``get(version)``: the folder of a tiny DeepSeek-V{version} MoE checkpoint trained briefly on a learnable task
    (:func:`hf_oracle.trained_model`) and written by transformers' ``save_pretrained`` (trained once per session)."""
    root, made = tmp_path_factory.mktemp("trained-checkpoints"), {}

    def get(version: int) -> Path:
        if version not in made:
            from hf_oracle import trained_model

            made[version] = root / f"deepseek-v{version}"
            trained_model(version).save_pretrained(made[version])
        return made[version]

    return get


@pytest.fixture(scope="session")
def quantized_artifacts(trained_checkpoints, tmp_path_factory):
    """``get(version, weights, quant_format="matmulnbits")``: the trained checkpoint of ``version`` exported with
    ``weights`` (int8/int4, blocks of 32) in ``quant_format``, made once per session (never modified by a test: copy it first). V2 has the concat cache, V3 a static
    cache of :data:`STATIC_CAPACITY` rows (too few for 64 decode steps after the 7-token prompt)."""
    root, made = tmp_path_factory.mktemp("quantized-exports"), {}

    def get(version: int, weights: str, quant_format: str = "matmulnbits") -> Path:
        key = version, weights, quant_format
        if key not in made:
            from quantized_helpers import export_checkpoint

            cache = {"cache_mode": "static", "max_cache_length": STATIC_CAPACITY} if version == 3 else {}
            made[key] = export_checkpoint(trained_checkpoints(version), root / f"v{version}-{weights}-{quant_format}",
                                          weights, quant_format=quant_format, **cache)
        return made[key]

    return get


@pytest.fixture(scope="session")
def quantized_validations(quantized_artifacts, tmp_path_factory):
    """``get(version, weights)``: ``(artifact, ValidationResult)`` of :func:`quantized_artifacts`'s export validated
    once per session, its reports and run results in ``result.out_dir`` (outside the artifact)."""
    root, made = tmp_path_factory.mktemp("quantized-validations"), {}

    def get(version: int, weights: str):
        if (version, weights) not in made:
            from mla_deploy.validate import validate_artifact

            artifact = quantized_artifacts(version, weights)
            made[version, weights] = artifact, validate_artifact(artifact, root / f"v{version}-{weights}")
        return made[version, weights]

    return get
