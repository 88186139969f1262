"""This project's PyTorch model as users run it: the attention stack in CD form or absorbed (A_CC) form, eager,
with the default :class:`~mla_deploy.model.cache.ConcatCache` (``torch.cat`` of the past and the new row)."""

from __future__ import annotations

import numpy as np
import torch

from ...model.cache import ConcatCache
from .inputs import PointInputs
from ...model import build_stack


class TorchPath:
    """The ``torch-*`` paths. Args: config, layers, seed: the weights; form: ``CD`` or ``A_CC``."""

    def __init__(self, config, layers: int, seed: int, form: str):
        self.form = form
        self.stack = build_stack(config, layers, form, seed=seed)
        self.cache = ConcatCache()
        self._out = None

    @torch.inference_mode()
    def setup(self, inputs: PointInputs) -> None:
        self.x, self.pos = inputs.hidden, inputs.positions
        if self.form != "CD":
            self.past = list(inputs.latent)
            return
        c = self.stack.config
        self.past = []
        for layer, rows in zip(self.stack.layers, inputs.latent):
            c_kv, k_pe = rows.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
            # [B, H, T, dn], [B, H, T, dv]: the per-head cache the CD form keeps
            k_nope, v = layer.self_attn.expand(c_kv)
            k = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, c.num_attention_heads, -1, -1)), dim=-1)
            self.past.append((k, v.contiguous()))
            del k_nope, v

    @torch.inference_mode()
    def step(self) -> None:
        out, presents = self.stack(self.x, self.pos, self.past, self.cache)
        del presents
        self._out = out

    def output(self) -> np.ndarray:
        return self._out.numpy().copy()

    def checks(self) -> dict:
        return {}

    def teardown(self) -> None:
        self.past = self.x = self._out = None
