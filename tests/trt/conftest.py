"""Fixtures of the TensorRT tests: manifests shaped exactly as the exporter writes them (no export needed)."""

from __future__ import annotations

import pytest

from mla_deploy import load_recipe
from mla_deploy.io_spec import cache_layout, decoder_io


def make_manifest(cache_mode: str = "static", precision: str = "fp32", capacity: int = 64, attention: str = "standard",
                  layers: int | None = None) -> dict:
    """The fields of ``manifest.json`` that profiles, build plans and runners read, for the tiny preset."""
    recipe = load_recipe("tiny")
    config = recipe.model if layers is None else recipe.model.replace(num_hidden_layers=layers)
    inputs, outputs = decoder_io(config, cache_mode, precision)
    graphs = {role: {"file": f"{role}.onnx", "form": form, "attention": attention if role == "decode" else "standard",
                     "inputs": [t.to_dict() for t in inputs], "outputs": [t.to_dict() for t in outputs]}
              for role, form in (("prefill", "CC"), ("decode", "A_CC"))}
    return {"format": "mla-deploy-artifact", "fingerprint": "0123456789abcdef", "model": config.to_dict(),
            "precision": precision, "cache": cache_layout(config, cache_mode), "graphs": graphs,
            "max_cache_length": capacity if cache_mode == "static" else None, "recipe": recipe.to_dict()}


@pytest.fixture
def manifest_factory():
    return make_manifest
