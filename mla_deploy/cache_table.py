"""Cache size per token per layer for the three ways of caching attention state.

* ``MHA``: textbook multi-head attention with the same heads: ``2 * H * v_head_dim`` (K and V per head).
* ``CD``: MLA with the decompressed per-head cache: ``H * (qk_nope + qk_rope + v_head_dim)``.
* ``latent``: MLA's cache: ``kv_lora_rank + qk_rope_head_dim`` (``c_kv`` and the shared ``k_pe``).
* ``index``: with DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5), the lightning indexer's keys each layer caches
  beside the latent row: ``index_head_dim``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import LongRopeScaling, MLAConfig

BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class CacheRow:
    """One way of caching: elements per token per layer and the ratio to the latent cache."""

    kind: str
    formula: str
    elements: int
    ratio_to_latent: float

    def bytes(self, dtype: str) -> int:
        """Bytes per token per layer in ``dtype`` (``fp32`` or ``bf16``)."""
        return self.elements * BYTES[dtype]


def cache_rows(config: MLAConfig) -> list[CacheRow]:
    """The MHA, CD and latent rows for ``config``."""
    c = config
    h = c.num_attention_heads
    latent = c.kv_lora_rank + c.qk_rope_head_dim
    mha = 2 * h * c.v_head_dim
    cd = h * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
    return [
        CacheRow("MHA", f"2*H*v_head_dim = 2*{h}*{c.v_head_dim}", mha, mha / latent),
        CacheRow("CD", f"H*(qk_nope+qk_rope+v) = {h}*({c.qk_nope_head_dim}+{c.qk_rope_head_dim}+{c.v_head_dim})",
                 cd, cd / latent),
        CacheRow("latent", f"kv_lora_rank+qk_rope = {c.kv_lora_rank}+{c.qk_rope_head_dim}", latent, 1.0),
    ] + ([CacheRow("index", f"index_head_dim = {c.index_head_dim} (sparse attention's indexer keys, beside the latent)",
                   c.index_head_dim, c.index_head_dim / latent)] if c.is_sparse else [])


def format_inspect(config: MLAConfig, kind: str = "preset") -> str:
    """A human-readable summary of ``config``: dimensions, derived constants and the cache table.

    Args:
        kind: what ``config`` came from, for the title: ``preset``, ``recipe`` or ``checkpoint``.
    """
    c = config
    lines = [f"{kind} {c.name} ({c.model_type})", ""]
    dims = [
        ("hidden_size", c.hidden_size),
        ("num_hidden_layers", c.num_hidden_layers if c.attention_per_layer == 1 else
         f"{c.num_hidden_layers} MLA sub-layers ({c.decoder_layers} layers x {c.attention_per_layer}), "
         "each with its latent cache"),
        ("num_attention_heads", c.num_attention_heads), ("q_lora_rank", c.q_lora_rank or "none (q_proj)"),
        ("kv_lora_rank", c.kv_lora_rank), ("qk_nope_head_dim", c.qk_nope_head_dim),
        ("qk_rope_head_dim", c.qk_rope_head_dim), ("v_head_dim", c.v_head_dim),
        ("vocab_size", c.vocab_size), ("intermediate_size", c.intermediate_size),
        ("rope_theta", c.rope_theta), ("rms_norm_eps", c.rms_norm_eps),
    ]
    if isinstance(c.rope_scaling, LongRopeScaling):
        y = c.rope_scaling
        dims.append(("rope_scaling", f"static longrope short_factor={'/'.join(f'{v:g}' for v in y.short_factor)} "
                                     f"original_max_position_embeddings={y.original_max_position_embeddings}"))
    elif c.rope_scaling is not None:
        y = c.rope_scaling
        dims.append(("rope_scaling", f"yarn factor={y.factor:g} original_max_position_embeddings="
                                     f"{y.original_max_position_embeddings} beta_fast={y.beta_fast:g} "
                                     f"beta_slow={y.beta_slow:g} mscale={y.mscale:g} mscale_all_dim={y.mscale_all_dim:g}"))
    if (c.scale_emb, c.scale_depth, c.dim_model_base) != (None, None, None):
        dims.append(("scales", f"embeddings x{c.scale_emb if c.scale_emb is not None else 1:g}, residual branches "
                               f"x{c.residual_scale:.6g}, logits /{c.logits_scaling:g}"))
    if c.is_moe:
        dims.append(("moe", _moe(c)))
    if c.is_sparse:
        dims.append(("sparse attention", f"each query attends to the index_topk={c.index_topk} tokens its indexer "
                                         f"scores highest ({c.index_n_heads} heads of {c.index_head_dim})"))
    dims += [("qk_head_dim", c.qk_head_dim), ("absorbed query / latent row width", c.latent_dim),
             ("softmax_scale", f"{c.softmax_scale:.8f}")]
    width = max(len(k) for k, _ in dims)
    lines += [f"  {k:<{width}}  {v}" for k, v in dims]
    lines += ["", "cache per token per layer:",
              f"  {'cache':<7} {'elements':>9} {'fp32 B':>9} {'bf16 B':>9} {'x latent':>9}  formula"]
    for row in cache_rows(c):
        lines.append(f"  {row.kind:<7} {row.elements:>9} {row.bytes('fp32'):>9} {row.bytes('bf16'):>9} "
                     f"{row.ratio_to_latent:>9.2f}  {row.formula}")
    return "\n".join(lines + [""] + _totals(c))


def _moe(c: MLAConfig) -> str:
    """The MoE line of :func:`format_inspect`."""
    if c.model_type == "longcat_flash":
        return (f"shortcut MoE in every layer: {c.n_routed_experts} routed experts of {c.moe_intermediate_size} + "
                f"{c.zero_expert_num} zero (identity) experts, top-{c.num_experts_per_tok}, softmax (bias for the "
                f"choice) x{c.routed_scaling_factor:g}")
    return (f"{c.n_routed_experts} routed + {c.n_shared_experts} shared experts of {c.moe_intermediate_size}, "
            f"top-{c.num_experts_per_tok}, {c.topk_method}/{c.scoring_func}, "
            + (f"first {c.first_k_dense_replace} layer(s) dense" if c.mlp_layer_types is None else
               "dense layer(s) " + ", ".join(str(i) for i, t in enumerate(c.mlp_layer_types) if t == "dense"))
            + (", post_mlp_layernorm" if c.post_mlp_layernorm else ""))


def _totals(config: MLAConfig) -> list[str]:
    """The whole model's cache per token and per longest sequence: the latent, and with sparse attention the latent
    plus the index keys."""
    c, per_tok, out = config, 0, []
    for row in cache_rows(c)[2:]:
        per_tok += row.bytes("bf16") * c.num_hidden_layers
        kind = "latent" if row.kind == "latent" else "latent + index"
        layers = f"{c.num_hidden_layers} layers" if c.attention_per_layer == 1 else \
            f"{c.num_hidden_layers} MLA sub-layers"
        out.append(f"{kind} cache, all {layers}: {per_tok / 1024:.1f} KiB/token (bf16); "
                   f"{per_tok * c.max_position_embeddings / 2**30:.2f} GiB for one sequence of "
                   f"{c.max_position_embeddings} tokens")
    return out
