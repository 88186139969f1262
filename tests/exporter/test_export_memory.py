"""A checkpoint export streams its weights: its peak memory does not grow with the model's layers.

Two random checkpoints of the same shapes, 1 and 6 decoder layers, are exported by the real CLI in fresh
processes; the peak resident memory of each (the kernel's count for the child, mapped checkpoint pages included)
is compared with the weights it wrote. Holding the model (as exports before the streaming one did: 4.4x the
weights) would add several times the extra layers' weights; streaming adds a small fraction (the traced graph).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from mla_deploy import load_recipe
from mla_deploy.artifact import load_manifest
from mla_deploy.random_checkpoint import write_random_checkpoint


def _config(layers: int):
    base = load_recipe("deepseek-v2-lite").model  # layer 0 dense, then MoE layers
    return base.replace(hidden_size=512, intermediate_size=1024, moe_intermediate_size=512, n_routed_experts=16,
                        num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, num_attention_heads=4,
                        kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                        vocab_size=16384, num_hidden_layers=6).first_layers(layers)


def _export_peak(checkpoint, out, *options) -> int:
    """Peak RSS in bytes of `mla-deploy export --hf checkpoint --out out [options]` run in its own process."""
    proc = subprocess.Popen([sys.executable, "-m", "mla_deploy", "export", "--hf", str(checkpoint), "--out", str(out),
                             *options],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    _, status, usage = os.wait4(proc.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, proc.stderr.read().decode()[-2000:]
    return usage.ru_maxrss * 1024


@pytest.mark.slow
def test_export_peak_memory_does_not_grow_with_layers(tmp_path):
    peaks, weights = {}, {}
    for layers in (1, 6):
        write_random_checkpoint(_config(layers), tmp_path / f"ckpt{layers}", dtype="fp32")
        peaks[layers] = _export_peak(tmp_path / f"ckpt{layers}", tmp_path / f"out{layers}")
        manifest = load_manifest(tmp_path / f"out{layers}")
        weights[layers] = manifest.weights_data["bytes"]  # streamed into the one shared weights file
    extra_weights = weights[6] - weights[1]
    assert extra_weights > 200e6  # five more layers, mostly experts: the growth a non-streaming export would show
    assert peaks[6] - peaks[1] < 0.35 * extra_weights, (peaks, weights)


@pytest.mark.slow
def test_quantized_export_peak_memory_does_not_grow_with_layers(tmp_path):
    """Quantizing streams too: each tensor is quantized as it is written (column chunks of the float copy), so the
    peak grows by a small fraction of the five extra layers' checkpoint tensors, which an export holding the model
    before quantizing it would add whole."""
    peaks, source, written = {}, {}, {}
    for layers in (1, 6):
        write_random_checkpoint(_config(layers), tmp_path / f"ckpt{layers}", dtype="fp32")
        peaks[layers] = _export_peak(tmp_path / f"ckpt{layers}", tmp_path / f"out{layers}", "--weights", "int4")
        source[layers] = sum(f.stat().st_size for f in (tmp_path / f"ckpt{layers}").glob("*.safetensors"))
        manifest = load_manifest(tmp_path / f"out{layers}")
        assert manifest.quantization.weights == "int4"
        written[layers] = sum(f.stat().st_size for f in (tmp_path / f"out{layers}").iterdir())
    extra_source = source[6] - source[1]
    assert extra_source > 200e6
    assert written[6] - written[1] < 0.2 * extra_source  # int4 + fp32 scales per 32: 5/32 of fp32, plus float parts
    assert peaks[6] - peaks[1] < 0.35 * extra_source, (peaks, source)


@pytest.mark.parametrize("version, weights", [(2, "float"), (3, "int4")])
def test_a_fused_export_reads_each_routed_expert_alone(tmp_path, version, weights):
    """The fused experts' stacked weights are made expert by expert from the checkpoint (a V3 layer's
    ``gate_up_proj`` is 15 GB in bf16, twice that once interleaved): no stacked experts' tensor is read whole, and
    what is written equals the whole view laid out at once (float ``MoE``: the interleaved fp32 weight; ``QMoE``:
    :meth:`~mla_deploy.quant.formats.WeightFormat.lay_out` of it)."""
    import numpy as np
    import onnx
    import torch
    from hf_oracle import hf_model
    from onnx import numpy_helper

    from mla_deploy.checkpoint import CheckpointTensors
    from mla_deploy.config import from_hf_config
    from mla_deploy.exporter import export_recipe
    from mla_deploy.quant.formats import QMOE
    from mla_deploy.quant.scheme import WeightQuantization
    from mla_deploy.recipe import Recipe

    hf_model(version).save_pretrained(tmp_path / "ckpt")
    read_whole = []

    class Recording(CheckpointTensors):
        def get(self, key):
            read_whole.append(key)
            return super().get(key)

    source, reference = Recording(tmp_path / "ckpt"), CheckpointTensors(tmp_path / "ckpt")
    recipe = Recipe(name="tiny-v2", model=from_hf_config(tmp_path / "ckpt"), source=str(tmp_path / "ckpt"))
    quantized = {"weights": weights, "block_size": 32} if weights != "float" else {}
    recipe = recipe.replace(export=dataclasses.replace(recipe.export, experts="fused", **quantized))
    manifest = export_recipe(recipe, tmp_path / "art", weights=source.weights_source(), source=source)
    stacked = [k for k in source.keys() if ".mlp.experts." in k]
    assert stacked and set(read_whole) & set(stacked) == set()
    model = onnx.load(tmp_path / "art" / manifest.graph("decode").file)
    data = {i.name: i for i in model.graph.initializer}
    nodes = [n for n in model.graph.node if n.op_type in ("MoE", "QMoE")]
    assert len(nodes) == manifest.config.num_hidden_layers - manifest.config.first_k_dense_replace
    e, i, d = manifest.config.n_routed_experts, manifest.config.moe_intermediate_size, manifest.config.hidden_size
    scheme = WeightQuantization("int4", 32)
    for node in nodes:
        layer = node.name.split("layers.")[1].split(".")[0] if "layers." in node.name else None
        prefix = next(k for k in stacked if k.endswith("gate_up_proj") and (layer is None or f"layers.{layer}." in k))
        gate_up = reference.get(prefix).float()
        want = {"fc1": gate_up.reshape(e, 2, i, d).permute(0, 2, 1, 3).reshape(e, 2 * i, d),
                "fc2": reference.get(prefix.replace("gate_up_proj", "down_proj")).float()}
        slots = {"fc1": (2, 3), "fc2": (5, 6)} if node.op_type == "QMoE" else {"fc1": (2,), "fc2": (4,)}
        for name, view in want.items():
            got = [numpy_helper.to_array(data[node.input[s]], base_dir=str(tmp_path / "art")) for s in slots[name]]
            expected = QMOE.lay_out(view, scheme) if node.op_type == "QMoE" else (view,)
            for g, w in zip(got, expected):
                np.testing.assert_array_equal(g, w.numpy().astype(g.dtype))
    assert {n.op_type for n in nodes} == {"QMoE" if weights == "int4" else "MoE"}
