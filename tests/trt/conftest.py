"""Fixtures of the TensorRT tests: manifests shaped exactly as the exporter writes them (no export needed)."""

from __future__ import annotations

import pytest

from mla_deploy import load_recipe
from mla_deploy.artifact import GraphEntry, Manifest, WeightsSource
from mla_deploy.cache_layout import get_layout


def make_manifest(cache_mode: str = "static", precision: str = "fp32", capacity: int = 64, attention: str = "standard",
                  layers: int | None = None) -> Manifest:
    """The :class:`Manifest` fields that profiles, build plans and runners read, for the tiny preset."""
    recipe = load_recipe("tiny")
    config = recipe.model if layers is None else recipe.model.replace(num_hidden_layers=layers)
    layout = get_layout(cache_mode)
    inputs, outputs = layout.io(config, precision)
    graphs = {role: GraphEntry(role=role, file=f"{role}.onnx", form=form, inputs=tuple(inputs), outputs=tuple(outputs),
                               attention=attention if role == "decode" else "standard")
              for role, form in (("prefill", "CC"), ("decode", "A_CC"))}
    return Manifest(name=recipe.name, fingerprint="0123456789abcdef", model=config, weights=WeightsSource(),
                    precision=precision, opset=24, cache=layout.describe(config),
                    max_cache_length=layout.manifest_capacity(capacity), graphs=graphs, recipe=recipe.to_dict())


@pytest.fixture
def manifest_factory():
    return make_manifest
