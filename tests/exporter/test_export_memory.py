"""A checkpoint export streams its weights: its peak memory does not grow with the model's layers.

Two random checkpoints of the same shapes, 1 and 6 decoder layers, are exported by the real CLI in fresh
processes; the peak resident memory of each (the kernel's count for the child, mapped checkpoint pages included)
is compared with the weights it wrote. Holding the model (as exports before the streaming one did: 4.4x the
weights) would add several times the extra layers' weights; streaming adds a small fraction (the traced graph).
"""

from __future__ import annotations

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
