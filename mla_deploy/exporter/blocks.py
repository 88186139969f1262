"""Export the single attention blocks the comparisons use: textbook MHA (its K/V cache as I/O) and the
Perceiver-style latent cross-attention (no cache). Sized from an :class:`~mla_deploy.config.MLAConfig`.

* ``mha``: ``hidden_states [batch_size, sequence_length, D]``, ``position_ids [batch_size, sequence_length]``,
  ``past_key``/``past_value [batch_size, H, past_sequence_length, v_head_dim]`` ->
  ``output [batch_size, sequence_length, D]``, ``present_key``/``present_value [batch_size, H, total_sequence_length, v_head_dim]``.
* ``latent-cross-attention``: ``inputs [batch_size, sequence_length, D]`` -> ``latents [batch_size, n_latents, D]``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..artifact import MANIFEST, REFERENCE_WEIGHTS, atomic_dir
from ..config import MLAConfig
from ..errors import ExportError
from ..io_spec import BATCH, PAST, SEQ, TOTAL, TensorSpec
from ..model.baselines import LatentCrossAttention, MultiHeadAttention
from ..model.decoder import init_random_
from .export import versions
from .graphs import LatentCrossAttentionGraph, MHAGraph
from .onnx_export import trace_to_onnx

BLOCKS = ("mha", "latent-cross-attention")


def build_block(kind: str, config: MLAConfig, n_latents: int = 16, std: float = 0.02, seed: int = 0):
    """The block module of ``kind`` with random weights, sized like ``config``'s attention."""
    if kind == "mha":
        block = MultiHeadAttention(config.hidden_size, config.num_attention_heads, config.v_head_dim, config.rope_theta)
    elif kind == "latent-cross-attention":
        heads = config.num_attention_heads
        block = LatentCrossAttention(config.hidden_size, heads, n_latents, config.hidden_size)
    else:
        raise ExportError(f"unknown block {kind!r}; choose one of {', '.join(BLOCKS)}")
    return init_random_(block, std=std, seed=seed).eval()


def block_io(kind: str, config: MLAConfig, n_latents: int = 16) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The block's inputs and outputs (fp32)."""
    d, h, dv = config.hidden_size, config.num_attention_heads, config.v_head_dim
    if kind == "mha":
        return ([TensorSpec("hidden_states", "float32", (BATCH, SEQ, d)), TensorSpec("position_ids", "int64", (BATCH, SEQ)),
                 TensorSpec("past_key", "float32", (BATCH, h, PAST, dv)), TensorSpec("past_value", "float32", (BATCH, h, PAST, dv))],
                [TensorSpec("output", "float32", (BATCH, SEQ, d)), TensorSpec("present_key", "float32", (BATCH, h, TOTAL, dv)),
                 TensorSpec("present_value", "float32", (BATCH, h, TOTAL, dv))])
    return ([TensorSpec("inputs", "float32", (BATCH, SEQ, d))], [TensorSpec("latents", "float32", (BATCH, n_latents, d))])


def export_block(kind: str, config: MLAConfig, out: str | Path, n_latents: int = 16, seed: int = 0,
                 overwrite: bool = False) -> dict:
    """Export the ``kind`` block to ``out/<kind>.onnx`` with its reference weights and a manifest (a plain dict, format
    ``mla-deploy-block``), written with :func:`~mla_deploy.artifact.atomic_dir`."""
    from torch.export import Dim

    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out} is not empty; choose another --out or pass --overwrite")
    block = build_block(kind, config, n_latents, seed=seed)
    inputs, outputs = block_io(kind, config, n_latents)
    batch, seq = Dim(BATCH, min=1, max=4096), Dim(SEQ, min=1, max=1 << 20)
    if kind == "mha":
        past = Dim(PAST, min=0, max=1 << 20)
        h, dv = config.num_attention_heads, config.v_head_dim
        args = (torch.randn(2, 3, config.hidden_size), torch.arange(5, 8).expand(2, 3).contiguous(),
                torch.zeros(2, h, 5, dv), torch.zeros(2, h, 5, dv))
        shapes = ({0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch, 2: past}, {0: batch, 2: past})
        wrapper = MHAGraph(block)
    else:
        args = (torch.randn(2, 3, config.hidden_size),)
        shapes = ({0: batch, 1: seq},)
        wrapper = LatentCrossAttentionGraph(block)
    with atomic_dir(out) as tmp:
        with torch.no_grad():
            trace_to_onnx(wrapper.eval(), args, tmp / f"{kind}.onnx", inputs, outputs, shapes, 18)
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in block.state_dict().items()}, str(tmp / REFERENCE_WEIGHTS))
        manifest = {"format": "mla-deploy-block", "block": kind, "model": config.to_dict(), "n_latents": n_latents,
                    "seed": seed, "file": f"{kind}.onnx", "inputs": [t.to_dict() for t in inputs],
                    "outputs": [t.to_dict() for t in outputs], "versions": versions()}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
