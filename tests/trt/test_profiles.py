"""Optimisation profiles from the recipe's [build] ranges and the manifest, for both cache modes (pure Python)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from mla_deploy.artifact import Manifest
from mla_deploy.errors import ArtifactError, ConfigError
from mla_deploy.recipe import BuildSettings
from mla_deploy.trt.profiles import axis_ranges, engine_profiles, input_shapes, polygraphy_profile, profiles_to_json

# tiny.toml: batch [1, 2, 4], prompt_length [1, 8, 32], past_length [1, 32, 64]; max_cache_length 64; C = 24


def test_static_profiles(manifest_factory):
    profiles = engine_profiles(manifest_factory("static", capacity=64))
    assert list(profiles) == ["prefill", "decode"]
    prefill, decode = profiles["prefill"], profiles["decode"]
    assert list(prefill) == ["input_ids", "position_ids", "logits_index", "write_indices", "past_latent.0",
                             "past_latent.1"]
    assert prefill["input_ids"] == ((1, 1), (2, 8), (4, 32))
    assert prefill["position_ids"] == prefill["input_ids"]
    assert prefill["logits_index"] == ((1, 1), (2, 1), (4, 32))  # generation asks for 1 row, validation for all
    assert decode["logits_index"] == ((1, 1), (2, 1), (4, 1))
    assert prefill["write_indices"] == ((1,), (2,), (4,))
    assert prefill["past_latent.0"] == ((1, 1, 64, 24), (2, 1, 64, 24), (4, 1, 64, 24))  # capacity fixed
    assert decode["input_ids"] == ((1, 1), (2, 1), (4, 1))  # one new token
    assert decode["past_latent.1"] == prefill["past_latent.1"]


def test_concat_profiles(manifest_factory):
    profiles = engine_profiles(manifest_factory("concat"))
    prefill, decode = profiles["prefill"], profiles["decode"]
    assert list(prefill) == ["input_ids", "position_ids", "logits_index", "attention_mask", "past_latent.0",
                             "past_latent.1"]
    assert prefill["past_latent.0"] == ((1, 0, 24), (2, 0, 24), (4, 64, 24))  # empty past, or up to the max
    assert prefill["attention_mask"] == ((1, 1), (2, 8), (4, 96))  # past + prompt
    assert decode["past_latent.0"] == ((1, 1, 24), (2, 32, 24), (4, 64, 24))
    assert decode["attention_mask"] == ((1, 2), (2, 33), (4, 65))  # past + 1
    assert decode["input_ids"] == ((1, 1), (2, 1), (4, 1))


def test_explicit_build_settings_override_the_manifest(manifest_factory):
    build = BuildSettings(batch=(1, 8, 64), prompt_length=(1, 128, 1024), past_length=(1, 2048, 32768))
    decode = engine_profiles(manifest_factory("concat"), build)["decode"]
    assert decode["past_latent.0"] == ((1, 1, 24), (8, 2048, 24), (64, 32768, 24))


def test_manifest_build_section_round_trips_through_json(manifest_factory):
    written = manifest_factory("static")
    manifest = Manifest.from_dict(json.loads(json.dumps(written.to_dict())))  # lists, as read from manifest.json
    build = manifest.build_settings()
    assert build.batch == (1, 2, 4) and build.past_length == (1, 32, 64)
    assert dataclasses.replace(written, recipe={}).build_settings() == BuildSettings()
    with pytest.raises(ArtifactError, match="build"):
        dataclasses.replace(written, recipe={"build": {"batches": [1, 1, 1]}}).build_settings()


def test_axis_ranges_errors():
    build = BuildSettings(prompt_length=(1, 16, 128))
    with pytest.raises(ConfigError, match="exceeds the static cache capacity 64"):
        axis_ranges("prefill", build, "static", 64)
    with pytest.raises(ConfigError, match="max_cache_length"):
        axis_ranges("decode", build, "static", None)
    with pytest.raises(ConfigError, match="unknown graph role"):
        axis_ranges("encode", build, "concat", None)


def test_input_shapes_fixed_and_unknown_axes():
    ranges = {"batch_size": (1, 2, 3)}
    assert input_shapes(["batch_size", 1, 576], ranges) == ((1, 1, 576), (2, 1, 576), (3, 1, 576))
    with pytest.raises(ArtifactError, match="'beam'"):
        input_shapes(["beam", 4], ranges, "x")


def test_json_and_polygraphy_forms(manifest_factory):
    profiles = engine_profiles(manifest_factory("static"))
    data = profiles_to_json(profiles)
    assert data["decode"]["input_ids"] == {"min": [1, 1], "opt": [2, 1], "max": [4, 1]}
    profile = polygraphy_profile(profiles["decode"])  # polygraphy.backend.trt imports without TensorRT
    assert list(profile.keys()) == list(profiles["decode"])
    shapes = profile["past_latent.0"]
    assert (tuple(shapes.min), tuple(shapes.opt), tuple(shapes.max)) == profiles["decode"]["past_latent.0"]
