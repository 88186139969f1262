"""The TensorRT engine's pure parts (binding addresses, profile bounds, prompt padding) and the plugin loader."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from mla_deploy.errors import CacheCapacityError, InputError, RuntimeMissingError, ShapeError
from mla_deploy.generate.request import pad_prompts
from mla_deploy.trt.engine import ALIGNMENT, binding_address, check_in_profile
from mla_deploy.trt.plugin_loader import load_plugin_module, plugins_dir


def _aligned(nbytes: int) -> torch.Tensor:
    base = torch.empty(nbytes + 2 * ALIGNMENT, dtype=torch.uint8)
    offset = (-base.data_ptr()) % ALIGNMENT
    return base[offset: offset + nbytes]


def test_empty_tensors_bind_the_dummy_buffer():
    dummy = _aligned(ALIGNMENT)
    empty = torch.empty((2, 0, 576), dtype=torch.bfloat16)
    assert empty.data_ptr() == 0  # what TensorRT would refuse
    assert binding_address(empty, dummy) == dummy.data_ptr() != 0
    view = _aligned(4096).view(torch.float32).view(2, 512)[:, :0]  # a zero-row view of a real buffer
    assert binding_address(view, dummy) == dummy.data_ptr()


def test_aligned_tensors_bind_themselves_misaligned_ones_are_refused():
    dummy = _aligned(ALIGNMENT)
    buffer = _aligned(4 * 1024).view(torch.float32)
    assert binding_address(buffer, dummy) == buffer.data_ptr()
    with pytest.raises(ShapeError, match="256-byte aligned"):
        binding_address(buffer[1:], dummy)  # 4 bytes past an aligned address
    rows = buffer.view(4, 256)
    assert binding_address(rows[1:], dummy) == rows[1].data_ptr()  # 1 KiB rows keep the alignment
    with pytest.raises(ShapeError, match="contiguous"):
        binding_address(rows[:, :128], dummy)


def test_check_in_profile():
    profile = [(1, 1, 24), (2, 32, 24), (4, 64, 24)]
    check_in_profile("decode", "past_latent.0", (3, 64, 24), profile)
    with pytest.raises(CacheCapacityError, match=r"axis 1 = 65 is outside the engine's profile \[1, 64\]"):
        check_in_profile("decode", "past_latent.0", (3, 65, 24), profile)
    with pytest.raises(ShapeError, match="axis 0 = 5"):
        check_in_profile("decode", "past_latent.0", (5, 8, 24), profile)
    with pytest.raises(ShapeError, match="rank 2"):
        check_in_profile("decode", "past_latent.0", (5, 8), profile)
    with pytest.raises(ShapeError, match="input_ids"):
        check_in_profile("prefill", "input_ids", (1, 40), [(1, 1), (2, 8), (4, 32)])


def test_pad_prompts():
    ids, valid, lengths = pad_prompts([[5, 6, 7], [9]], vocab_size=128)
    assert ids.tolist() == [[5, 6, 7], [9, 0, 0]] and ids.dtype == np.int64
    assert valid.tolist() == [[1, 1, 1], [1, 0, 0]] and lengths.tolist() == [3, 1]
    with pytest.raises(InputError, match="at least one token"):
        pad_prompts([[1], []], 128)
    with pytest.raises(InputError, match="token id 128"):
        pad_prompts([[1, 128]], 128)


def test_plugin_loader_imports_the_reference_without_plugins_on_sys_path():
    reference = load_plugin_module("reference")
    assert reference.__name__ == "mla_deploy_plugins.mla_decode.reference"
    assert (plugins_dir() / "mla_decode" / "reference.py").samefile(reference.__file__)
    assert load_plugin_module("reference") is reference


def test_plugin_loader_errors(tmp_path):
    with pytest.raises(RuntimeMissingError, match="plugin sources"):
        load_plugin_module("reference", folder=tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed")
def test_registering_the_plugin_without_tensorrt_names_it():
    from mla_deploy.trt.plugin_loader import register_mla_decode_plugin

    with pytest.raises(RuntimeMissingError, match="trt_plugin.py needs tensorrt"):
        register_mla_decode_plugin()


def test_plugin_loader_refuses_a_second_folder(tmp_path):
    load_plugin_module("reference")
    (tmp_path / "mla_decode").mkdir()
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "mla_decode" / "__init__.py").write_text("")
    with pytest.raises(RuntimeMissingError, match="already loaded"):
        load_plugin_module("reference", folder=tmp_path)
