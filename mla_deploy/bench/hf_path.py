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

from ..config import MLAConfig
from ..errors import RuntimeMissingError
from .inputs import PointInputs
from .stack import build_stack


def transformers_version() -> str | None:
    """The installed transformers version, or None."""
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


def hf_config(c: MLAConfig, layers: int, impl: str):
    """A transformers ``DeepseekV2Config`` / ``DeepseekV3Config`` with ``c``'s attention dimensions."""
    import transformers

    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:
        y = c.rope_scaling
        rope = {"rope_type": "yarn", "rope_theta": c.rope_theta, "factor": y.factor,
                "original_max_position_embeddings": y.original_max_position_embeddings,
                "beta_fast": y.beta_fast, "beta_slow": y.beta_slow, "mscale": y.mscale,
                "mscale_all_dim": y.mscale_all_dim}
        if y.attention_factor is not None:
            rope["attention_factor"] = y.attention_factor
    common = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                  num_hidden_layers=layers, num_attention_heads=c.num_attention_heads,
                  num_key_value_heads=c.num_attention_heads, q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
                  qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim,
                  v_head_dim=c.v_head_dim, max_position_embeddings=c.max_position_embeddings,
                  rms_norm_eps=c.rms_norm_eps, attention_bias=False, rope_parameters=rope)
    if c.model_type == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(**common, rope_interleave=True, num_nextn_predict_layers=0)
    else:
        cfg = transformers.DeepseekV2Config(**common)
    cfg._attn_implementation = impl
    return cfg


class HFRunner:
    """Args: config, layers, seed: the weights (this project's, loaded into transformers' modules); impl:
    ``eager`` or ``sdpa``."""

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
            attn.load_state_dict(layer.state_dict(), strict=True)
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
