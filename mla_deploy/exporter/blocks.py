"""Export the single attention blocks the comparisons use: textbook MHA (its K/V cache as I/O) and the
Perceiver-style latent cross-attention (no cache). Sized from an :class:`~mla_deploy.config.MLAConfig`.

* ``mha``: ``hidden_states [batch_size, sequence_length, D]``, ``position_ids [batch_size, sequence_length]``,
  ``past_key``/``past_value [batch_size, H, past_sequence_length, v_head_dim]`` ->
  ``output [batch_size, sequence_length, D]``, ``present_key``/``present_value [batch_size, H, total_sequence_length, v_head_dim]``.
* ``latent-cross-attention``: ``inputs [batch_size, sequence_length, D]`` -> ``latents [batch_size, n_latents, D]``.

Written by the one export pipeline (:func:`~.export.run_export`) as the :class:`BlockTarget`: traced on the meta
device, the weights streamed from the block in memory (inline in the graph; ``weights.data`` past ``[export]``'s
default threshold), the folder written atomically; re-exporting with ``overwrite`` keeps the user's other files.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..artifact import MANIFEST, REFERENCE_WEIGHTS
from ..config import MLAConfig
from ..errors import ExportError
from ..io_spec import BATCH, PAST, SEQ, TOTAL, TensorSpec
from ..model.baselines import LatentCrossAttention, MultiHeadAttention
from ..model.decoder import init_random_
from ..quant import FLOAT
from ..recipe import ExportSettings
from .export import Exported, GraphPlan, run_export, versions
from .graphs import LatentCrossAttentionGraph, MHAGraph
from .weights import WEIGHTS_FILE, ModuleTensors

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
    ``mla-deploy-block``), through the one export pipeline (:func:`~.export.run_export`).

    Raises:
        ExportError: an unknown ``kind``, ``out`` is not empty (and not ``overwrite``), or the export fails.
    """
    target = BlockTarget(kind, config, build_block(kind, config, n_latents, seed=seed), n_latents, seed)
    return run_export(target, out, ModuleTensors(target.wrapper()), overwrite)


@dataclass(frozen=True)
class BlockTarget:
    """A comparison block: one fp32 graph, its weights inline, ``reference.safetensors`` and a small manifest.

    Attributes:
        kind: ``mha`` or ``latent-cross-attention``.
        config: the model whose attention the block is sized like.
        block: the block with its weights (:func:`build_block`).
        n_latents, seed: as :func:`build_block` made it (recorded).
    """

    kind: str
    config: MLAConfig
    block: torch.nn.Module
    n_latents: int
    seed: int
    quantization = FLOAT
    per_head_weights = False
    external_data_threshold = ExportSettings.external_data_threshold

    def wrapper(self) -> torch.nn.Module:
        """The graph module around :attr:`block` (parameters named ``block.*``)."""
        return (MHAGraph if self.kind == "mha" else LatentCrossAttentionGraph)(self.block).eval()

    def files(self) -> tuple[str, ...]:
        return MANIFEST, f"{self.kind}.onnx", REFERENCE_WEIGHTS, WEIGHTS_FILE

    def prepare(self, out: Path, overwrite: bool) -> list[str]:
        names = sorted(entry.name for entry in out.iterdir()) if out.is_dir() else []
        if out.exists() and not out.is_dir():
            raise ExportError(f"{out} exists and is not a directory")
        if names and not overwrite:
            raise ExportError(f"{out} is not empty; choose another --out or pass --overwrite")
        return [name for name in names if name not in self.files()]

    def graphs(self) -> list[GraphPlan]:
        from torch.export import Dim

        inputs, outputs = block_io(self.kind, self.config, self.n_latents)
        batch, seq = Dim(BATCH, min=1, max=4096), Dim(SEQ, min=1, max=1 << 20)
        if self.kind == "mha":
            past = Dim(PAST, min=0, max=1 << 20)
            h, dv = self.config.num_attention_heads, self.config.v_head_dim
            args = (torch.zeros(2, 3, self.config.hidden_size), torch.arange(5, 8).expand(2, 3).contiguous(),
                    torch.zeros(2, h, 5, dv), torch.zeros(2, h, 5, dv))
            shapes = ({0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch, 2: past}, {0: batch, 2: past})
        else:
            args = (torch.zeros(2, 3, self.config.hidden_size),)
            shapes = ({0: batch, 1: seq},)
        module = copy.deepcopy(self.wrapper()).to("meta")
        return [GraphPlan(f"{self.kind}.onnx", f"the {self.kind} block", module, tuple(a.to("meta") for a in args),
                          shapes, inputs, outputs, 18)]

    def finish(self, tmp: Path, exported: Exported) -> dict:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in self.block.state_dict().items()}, str(tmp / REFERENCE_WEIGHTS))
        inputs, outputs = block_io(self.kind, self.config, self.n_latents)
        manifest = {"format": "mla-deploy-block", "block": self.kind, "model": self.config.to_dict(),
                    "n_latents": self.n_latents, "seed": self.seed, "file": f"{self.kind}.onnx",
                    "inputs": [t.to_dict() for t in inputs], "outputs": [t.to_dict() for t in outputs],
                    "weights_data": exported.weights_data, "versions": versions()}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        return manifest
