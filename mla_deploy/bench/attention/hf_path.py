"""The naive path users get today: transformers' own ``DeepseekV2Attention`` / ``DeepseekV3Attention`` layers
with a ``DynamicCache``, eager PyTorch, ``attn_implementation`` ``eager`` or ``sdpa``.

transformers caches the latent (``keys`` = normed c_kv ``[B, 1, T, r]``, ``values`` = roped k_pe
``[B, 1, T, dr]``) but re-expands per-head K and V from the whole cache through ``kv_b_proj`` every step.
The cache is filled directly with the point's latent rows (no prefill, which would exhaust memory at long
context); after each timed step ``crop(-1)`` drops the new row again, so every call is the same step.
The layers get this project's weights (same parameter names), so their output is comparable.
"""

from __future__ import annotations

import numpy as np
import torch

from ...config import MLAConfig, to_hf_config
from ...errors import RuntimeMissingError
from .inputs import PointInputs
from ...model import build_stack


def hf_config(c: MLAConfig, layers: int, impl: str):
    """A transformers ``DeepseekV2Config`` / ``DeepseekV3Config`` of ``c`` with ``layers`` layers
    (:func:`~mla_deploy.config.to_hf_config`), attention implementation ``impl``."""
    import transformers

    cfg = transformers.AutoConfig.for_model(**to_hf_config(c, num_hidden_layers=layers))
    cfg._attn_implementation = impl
    return cfg


class HFPath:
    """The ``hf-*`` paths. Args: config, layers, seed: the weights (this project's, loaded into transformers'
    modules); impl: ``eager`` or ``sdpa``."""

    def __init__(self, config: MLAConfig, layers: int, seed: int, impl: str):
        try:
            import transformers  # noqa: F401
        except ImportError as exc:
            raise RuntimeMissingError("transformers is not installed") from exc
        if config.model_type == "deepseek_v3":
            from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf
            attn_cls, rope_cls = hf.DeepseekV3Attention, hf.DeepseekV3RotaryEmbedding
        else:
            from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf
            attn_cls, rope_cls = hf.DeepseekV2Attention, hf.DeepseekV2RotaryEmbedding
        self.config = config
        cfg = hf_config(config, layers, impl)
        ours = build_stack(config, layers, "CC", seed=seed)
        self.layers = []
        for i, layer in enumerate(ours.layers):
            attn = attn_cls(cfg, layer_idx=i)
            attn.load_state_dict(layer.self_attn.state_dict(), strict=True)
            self.layers.append(attn.eval())
        self.rotary = rope_cls(cfg).eval()
        self.v3 = config.model_type == "deepseek_v3"
        self._out = None

    @torch.inference_mode()
    def setup(self, inputs: PointInputs) -> None:
        from transformers import DynamicCache

        c = self.config
        self.x, self.pos, self.context = inputs.hidden, inputs.positions, inputs.context
        self.cache = DynamicCache()
        perm = None
        if self.v3:  # V3's transformers code keeps k_pe de-interleaved: [rotated evens | rotated odds]
            perm = torch.cat((torch.arange(0, c.qk_rope_head_dim, 2), torch.arange(1, c.qk_rope_head_dim, 2)))
        for i, rows in enumerate(inputs.latent):
            keys = rows[..., :c.kv_lora_rank].unsqueeze(1)
            values = rows[..., c.kv_lora_rank:]
            values = (values[..., perm] if perm is not None else values).unsqueeze(1)
            self.cache.update(keys, values, i)

    @torch.inference_mode()
    def step(self) -> None:
        x = self.x
        position_embeddings = self.rotary(x, self.pos)
        for attn in self.layers:
            h, _ = attn(hidden_states=x, position_embeddings=position_embeddings, attention_mask=None,
                        past_key_values=self.cache)
            x = x + h
        self.cache.crop(-1)  # back to T rows: the next call is the same step
        self._out = x

    def output(self) -> np.ndarray:
        return self._out.numpy().copy()

    def checks(self) -> dict:
        return {"cache_rows_after_step": int(self.cache.get_seq_length())}

    def teardown(self) -> None:
        self.cache = self.x = self._out = None
