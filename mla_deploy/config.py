"""Model dimensions: one frozen dataclass with DeepSeek's own field names.

``MLAConfig`` describes a DeepSeek-V2/V3 style decoder: the Multi-Head Latent Attention
dimensions, the optional YaRN rope scaling, the MLP/MoE sizes. It is built from a preset
(``export/<name>.toml``, section ``[model]``) or from a Hugging Face ``config.json``.
Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .errors import ConfigError

ROUTING_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")
MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "longcat_flash")
MLP_LAYER_TYPES = ("dense", "sparse")


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN attention-temperature correction ``0.1 * mscale * ln(scale) + 1`` (1 when scale <= 1)."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling, as in DeepSeek's ``rope_scaling`` block.

    Attributes:
        factor: context extension factor ``s`` (40 for DeepSeek-V2/V3).
        original_max_position_embeddings: the pre-extension context (4096).
        beta_fast: high-frequency boundary of the ramp, in rotations (32; Kimi K2: 1).
        beta_slow: low-frequency boundary of the ramp, in rotations (1); at most beta_fast.
        mscale: mscale used for the cos/sin amplitude (``attention_factor``).
        mscale_all_dim: mscale used for the softmax scale; 0 disables the scale correction.
        attention_factor: explicit cos/sin amplitude; None derives it as transformers does.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ConfigError(f"rope_scaling.factor must be >= 1, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ConfigError("rope_scaling.original_max_position_embeddings must be positive")
        # equal betas (Kimi K2's 1 and 1) make the ramp one dimension wide, as in transformers, which refuses only
        # beta_fast < beta_slow
        if not self.beta_fast >= self.beta_slow > 0:
            raise ConfigError(
                f"rope_scaling needs beta_fast >= beta_slow > 0, got {self.beta_fast} and {self.beta_slow}"
            )

    @property
    def cos_sin_scale(self) -> float:
        """Amplitude applied to cos and sin, as transformers derives it.

        ``attention_factor`` when given; else ``mscale(s, mscale) / mscale(s, mscale_all_dim)`` when both are
        non-zero (1.0 for the published DeepSeek configs); else ``mscale(s)``.
        """
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim)
        return yarn_get_mscale(self.factor)

    @property
    def softmax_mscale(self) -> float:
        """Multiplier of the softmax scale: ``mscale(s, mscale_all_dim)**2`` (1 when mscale_all_dim is 0)."""
        if not self.mscale_all_dim:
            return 1.0
        return yarn_get_mscale(self.factor, self.mscale_all_dim) ** 2


@dataclass(frozen=True)
class LongRopeScaling:
    """LongRoPE as MiniCPM3 uses it: static, every position below ``original_max_position_embeddings``.

    The rope frequencies are ``1 / (short_factor[i] * theta^(2i/d))``; ``long_factor`` is what transformers switches
    to past ``original_max_position_embeddings``, which an MLAConfig never reaches (``max_position_embeddings`` is
    checked not to exceed it), so it is kept only to write the config back.

    Attributes:
        short_factor: one divisor per rope pair (``qk_rope_head_dim / 2`` of them).
        long_factor: the divisors past the original context (unused, see above).
        original_max_position_embeddings: the pre-training context.
        factor: the context extension; None: ``max_position_embeddings / original_max_position_embeddings``.
        attention_factor: cos/sin amplitude; None: derived from the factor as transformers does.
    """

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    factor: float | None = None
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        for name in ("short_factor", "long_factor"):
            values = getattr(self, name)
            if not isinstance(values, (list, tuple)) or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values):
                raise ConfigError(f"rope_scaling.{name} must be a list of positive numbers, got {str(values)[:80]}")
            object.__setattr__(self, name, tuple(float(v) for v in values))  # a list from JSON; frozen: once here
        if self.original_max_position_embeddings <= 0:
            raise ConfigError("rope_scaling.original_max_position_embeddings must be positive")

    def cos_sin_scale_for(self, max_position_embeddings: int) -> float:
        """Amplitude of cos and sin: ``attention_factor``, else ``sqrt(1 + ln(factor) / ln(original))`` (1 when the
        factor is at most 1), as transformers derives it."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        factor = self.factor if self.factor is not None else \
            max_position_embeddings / self.original_max_position_embeddings
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(self.original_max_position_embeddings))

    @property
    def softmax_mscale(self) -> float:
        """LongRoPE leaves the softmax scale alone."""
        return 1.0


@dataclass(frozen=True)
class MLAConfig:
    """Dimensions of a DeepSeek-style MLA decoder (field names as in DeepSeek's config.json).

    Attributes:
        name: a label (the preset name, or the checkpoint's folder name).
        model_type: ``deepseek_v2`` or ``deepseek_v3``, which selects the MoE routing; or ``longcat_flash``
            (LongCat-Flash): each decoder layer holds two MLA sub-layers and two dense MLPs, and a shortcut MoE
            whose output joins the residual after the second MLP; routed by softmax plus
            ``e_score_correction_bias`` (for the choice only), not renormalised, over the routed experts and
            ``zero_expert_num`` zero (identity) experts.
        vocab_size: number of token ids.
        hidden_size: model width D.
        intermediate_size: width of the dense SwiGLU MLP.
        num_hidden_layers: number of MLA attention layers, each with its own latent cache: the decoder layers,
            or for ``longcat_flash`` twice them (transformers' own ``num_hidden_layers = 2 * num_layers``; see
            :attr:`decoder_layers`).
        num_attention_heads: number of query heads H.
        q_lora_rank: rank of the query compression, or None for a plain ``q_proj``.
        kv_lora_rank: width r of the cached latent ``c_kv`` (512 in DeepSeek).
        qk_nope_head_dim: per-head query/key width without rope (128).
        qk_rope_head_dim: width of the decoupled rope key ``k_pe``, shared by all heads (64).
        v_head_dim: per-head value width (128).
        rope_theta: rope base.
        rope_scaling: YaRN or (static) LongRoPE parameters, or None for plain rope.
        rms_norm_eps: epsilon of every RMSNorm.
        max_position_embeddings: the longest context the model was configured for.
        moe_intermediate_size: width of one routed (and shared) expert.
        n_routed_experts: number of routed experts; None for a dense model.
        n_shared_experts: number of always-on shared experts (their MLP is this many experts wide).
        num_experts_per_tok: experts chosen per token (top-k).
        first_k_dense_replace: the first k layers use the dense MLP.
        n_group: expert groups for group-limited routing.
        topk_group: groups kept per token.
        topk_method: ``greedy``, ``group_limited_greedy`` (V2) or ``noaux_tc`` (V3: groups ranked by their best two
            experts; with softmax scores and no correction bias, Mistral 4).
        scoring_func: ``softmax`` (V2, Mistral 4) or ``sigmoid`` (V3, with ``e_score_correction_bias``).
        routed_scaling_factor: multiplier of the routed experts' weights.
        norm_topk_prob: ``noaux_tc`` only: normalise the chosen weights to sum to one.
        tie_word_embeddings: lm_head shares the embedding matrix.
        mlp_layer_types: per layer ``dense`` or ``sparse`` (MoE), when the schedule is not the first
            ``first_k_dense_replace`` layers dense and the rest MoE (GLM-4.7-Flash's and A.X-K1's key; DeepSeek's
            ``moe_layer_freq`` is read into it); None: ``first_k_dense_replace`` decides.
        post_mlp_layernorm: an RMSNorm on the MoE block's output (experts plus shared experts), MoE layers only
            (A.X-K1).
        scale_emb: MiniCPM3's multiplier of the embeddings (None: 1).
        scale_depth: MiniCPM3's residual scale: each layer adds its attention and MLP outputs times
            ``scale_depth / sqrt(num_hidden_layers)`` (:attr:`residual_scale`; None: 1).
        dim_model_base: MiniCPM3's logit divisor: the final norm's output is divided by
            ``hidden_size / dim_model_base`` before lm_head (:attr:`logits_scaling`; None: 1).
        llama_4_scaling_beta: Mistral 4's position-dependent query scale ``1 + beta * ln(1 + floor(p / n))`` at
            position ``p``, ``n`` the YaRN ``original_max_position_embeddings`` (1 below ``n``); None: none.
        index_topk: DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): each query attends only to the
            ``index_topk`` cached tokens its layer's lightning indexer scores highest (every token while the context
            is at most ``index_topk``); None: dense MLA. Needs ``q_lora_rank`` (the indexer reads the compressed
            query).
        index_head_dim: the indexer's key width: what each layer caches per token beside the latent row (its first
            ``qk_rope_head_dim`` channels rotated).
        index_n_heads: the indexer's query heads.
        zero_expert_num: ``longcat_flash``: zero (identity) experts routed beside the ``n_routed_experts`` real
            ones; a token routed to one adds its weight times itself.
        latent_norm_eps: epsilon of ``q_a_layernorm`` and ``kv_a_layernorm`` (transformers builds
            them with 1e-6 in every MLA type, whatever ``rms_norm_eps`` is); None: ``rms_norm_eps``.
    """

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    model_type: str = "deepseek_v3"
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | LongRopeScaling | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    # mixture of experts (None: every layer is dense)
    moe_intermediate_size: int | None = None
    n_routed_experts: int | None = None
    n_shared_experts: int = 0
    num_experts_per_tok: int = 1
    first_k_dense_replace: int = 0
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    tie_word_embeddings: bool = False
    mlp_layer_types: tuple[str, ...] | None = None
    post_mlp_layernorm: bool = False
    scale_emb: float | None = None
    scale_depth: float | None = None
    dim_model_base: int | None = None
    llama_4_scaling_beta: float | None = None
    index_topk: int | None = None
    index_head_dim: int | None = None
    index_n_heads: int | None = None
    zero_expert_num: int = 0
    latent_norm_eps: float | None = None

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                  "v_head_dim", "max_position_embeddings"):
            value = getattr(self, f)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{self.name}: {f} must be a positive integer, got {value!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            raise ConfigError(f"{self.name}: q_lora_rank must be a positive integer or absent, got {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"{self.name}: qk_rope_head_dim must be even (rope rotates pairs), got {self.qk_rope_head_dim}")
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(f"{self.name}: model_type must be one of {MODEL_TYPES}, got {self.model_type!r}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ConfigError(f"{self.name}: rms_norm_eps and rope_theta must be positive")
        if self.n_routed_experts is not None:
            self._check_moe()
        if self.mlp_layer_types is not None:
            self._check_schedule()
        for f in ("scale_emb", "scale_depth", "dim_model_base", "llama_4_scaling_beta"):
            value = getattr(self, f)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ConfigError(f"{self.name}: {f} must be a positive number or absent, got {value!r}")
        if self.llama_4_scaling_beta is not None and not isinstance(self.rope_scaling, YarnScaling):
            raise ConfigError(f"{self.name}: llama_4_scaling_beta scales queries by their position over YaRN's "
                              "original_max_position_embeddings, and the rope has no YaRN scaling")
        if self.index_topk is not None or self.index_head_dim is not None or self.index_n_heads is not None:
            self._check_sparse()
        if self.model_type == "longcat_flash" or self.zero_expert_num:
            self._check_longcat()
        if self.latent_norm_eps is not None and (isinstance(self.latent_norm_eps, bool) or
                                                 not isinstance(self.latent_norm_eps, (int, float)) or
                                                 self.latent_norm_eps <= 0):
            raise ConfigError(f"{self.name}: latent_norm_eps must be a positive number or absent, "
                              f"got {self.latent_norm_eps!r}")
        if isinstance(self.rope_scaling, LongRopeScaling):
            long = self.rope_scaling
            if len(long.short_factor) != self.qk_rope_head_dim // 2:
                raise ConfigError(f"{self.name}: rope_scaling.short_factor has {len(long.short_factor)} values, the "
                                  f"rope has {self.qk_rope_head_dim // 2} pairs (qk_rope_head_dim / 2)")
            if self.max_position_embeddings > long.original_max_position_embeddings:
                raise ConfigError(f"{self.name}: longrope past original_max_position_embeddings "
                                  f"({long.original_max_position_embeddings} < max_position_embeddings "
                                  f"{self.max_position_embeddings}) switches to long_factor with the sequence length; "
                                  "only static longrope is supported")

    def _check_longcat(self) -> None:
        """LongCat-Flash's topology: pairs of MLA sub-layers, a MoE in every decoder layer, softmax routing over the
        routed and the zero experts."""
        z = self.zero_expert_num
        if not isinstance(z, int) or isinstance(z, bool) or z < 0:
            raise ConfigError(f"{self.name}: zero_expert_num must be a non-negative integer, got {z!r}")
        if self.model_type != "longcat_flash":
            raise ConfigError(f"{self.name}: zero (identity) experts are a longcat_flash mechanism, model_type is "
                              f"{self.model_type!r}")
        if self.num_hidden_layers % 2:
            raise ConfigError(f"{self.name}: longcat_flash has two MLA sub-layers per decoder layer, so "
                              f"num_hidden_layers must be even, got {self.num_hidden_layers}")
        if self.n_routed_experts is None:
            raise ConfigError(f"{self.name}: longcat_flash has a MoE in every decoder layer; n_routed_experts is absent")
        want = dict(topk_method="greedy", scoring_func="softmax", n_group=1, topk_group=1, norm_topk_prob=False,
                    n_shared_experts=0, first_k_dense_replace=0, mlp_layer_types=None, post_mlp_layernorm=False)
        differ = [f"{k}={getattr(self, k)!r}" for k, v in want.items() if getattr(self, k) != v]
        if differ:
            raise ConfigError(f"{self.name}: longcat_flash routes by softmax (bias for the choice), ungrouped, "
                              f"unnormalised, without shared experts or dense layers; got {', '.join(differ)}")
        if self.q_lora_rank is None or self.is_sparse:
            raise ConfigError(f"{self.name}: longcat_flash's attention compresses the query (q_lora_rank) and is dense")

    def _check_sparse(self) -> None:
        for f in ("index_topk", "index_head_dim", "index_n_heads"):
            value = getattr(self, f)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{self.name}: {f} must be a positive integer (DeepSeek Sparse Attention), "
                                  f"got {value!r}")
        if self.q_lora_rank is None:
            raise ConfigError(f"{self.name}: DeepSeek Sparse Attention's indexer reads the compressed query, and "
                              "q_lora_rank is absent")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ConfigError(f"{self.name}: index_head_dim ({self.index_head_dim}) is narrower than the rope slice "
                              f"it rotates (qk_rope_head_dim {self.qk_rope_head_dim})")

    def _check_schedule(self) -> None:
        types = self._check_schedule_of(self.mlp_layer_types, self.num_hidden_layers, self.name)
        object.__setattr__(self, "mlp_layer_types", types)  # a list from JSON/TOML; frozen: set once here
        if "sparse" in types and self.n_routed_experts is None:
            raise ConfigError(f"{self.name}: mlp_layer_types has MoE ('sparse') layers but no n_routed_experts")

    def _check_moe(self) -> None:
        n = self.n_routed_experts
        if not isinstance(n, int) or n <= 0:
            raise ConfigError(f"{self.name}: n_routed_experts must be a positive integer or absent, got {n!r}")
        if not self.moe_intermediate_size or self.moe_intermediate_size <= 0:
            raise ConfigError(f"{self.name}: a MoE model needs a positive moe_intermediate_size")
        if not 1 <= self.num_experts_per_tok <= n:  # with zero experts: the k choices run as k real experts
            raise ConfigError(f"{self.name}: num_experts_per_tok must be in 1..{n}, got {self.num_experts_per_tok}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ConfigError(f"{self.name}: first_k_dense_replace must be in 0..num_hidden_layers")
        if self.n_group <= 0 or n % self.n_group:
            raise ConfigError(f"{self.name}: n_routed_experts ({n}) must be a multiple of n_group ({self.n_group})")
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(f"{self.name}: topk_group must be in 1..n_group ({self.n_group}), got {self.topk_group}")
        if self.topk_method not in ROUTING_METHODS:
            raise ConfigError(f"{self.name}: topk_method must be one of {ROUTING_METHODS}, got {self.topk_method!r}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ConfigError(f"{self.name}: scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        if self.scoring_func == "sigmoid" and self.topk_method != "noaux_tc":
            raise ConfigError(f"{self.name}: scoring_func 'sigmoid' goes with topk_method 'noaux_tc' (V3); "
                              f"got {self.topk_method!r}")
        if self.n_shared_experts < 0:
            raise ConfigError(f"{self.name}: n_shared_experts must be >= 0")
        per_group = n // self.n_group
        if self.topk_method == "noaux_tc" and per_group < 2:
            raise ConfigError(f"{self.name}: noaux_tc scores each group by its best two experts, so each of the "
                              f"n_group ({self.n_group}) groups needs at least 2 of the {n} experts")
        if self.topk_method != "greedy" and self.topk_group * per_group < self.num_experts_per_tok:
            raise ConfigError(f"{self.name}: the topk_group ({self.topk_group}) groups kept hold {self.topk_group * per_group} "
                              f"experts, fewer than num_experts_per_tok ({self.num_experts_per_tok})")

    @staticmethod
    def _check_schedule_of(types: Any, layers: int, label: str) -> tuple[str, ...]:
        """``types`` as a valid ``mlp_layer_types`` of ``layers`` layers (a tuple). Raises ConfigError."""
        if not isinstance(types, (list, tuple)) or not all(isinstance(t, str) for t in types):
            raise ConfigError(f"{label}: mlp_layer_types must be a list of {' or '.join(MLP_LAYER_TYPES)}, "
                              f"got {str(types)[:80]}")
        bad = sorted({t for t in types if t not in MLP_LAYER_TYPES})
        if bad:
            raise ConfigError(f"{label}: mlp_layer_types holds {', '.join(map(repr, bad))}; each layer is "
                              f"{' or '.join(map(repr, MLP_LAYER_TYPES))}")
        if len(types) != layers:
            raise ConfigError(f"{label}: mlp_layer_types names {len(types)} layers, num_hidden_layers is {layers}")
        return tuple(types)

    # derived dimensions -------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width: ``qk_nope_head_dim + qk_rope_head_dim`` (192)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached row: ``kv_lora_rank + qk_rope_head_dim`` (576): c_kv first, then k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim**-0.5``, times ``mscale(factor, mscale_all_dim)**2`` under YaRN."""
        scale = self.qk_head_dim ** -0.5
        if self.rope_scaling is not None:
            scale *= self.rope_scaling.softmax_mscale
        return scale

    @property
    def is_sparse(self) -> bool:
        """DeepSeek Sparse Attention: every layer has a lightning indexer and caches its keys (``index_head_dim``
        per token) beside the latent row."""
        return self.index_topk is not None

    @property
    def residual_scale(self) -> float:
        """Multiplier of each residual branch: ``scale_depth / sqrt(num_hidden_layers)`` (1 without scale_depth)."""
        return 1.0 if self.scale_depth is None else self.scale_depth / math.sqrt(self.num_hidden_layers)

    @property
    def logits_scaling(self) -> float:
        """Divisor of the final norm's output before lm_head: ``hidden_size / dim_model_base`` (1 without it)."""
        return 1.0 if self.dim_model_base is None else self.hidden_size / self.dim_model_base

    @property
    def rope_amplitude(self) -> float:
        """Amplitude of the rope's cos and sin (1 for plain rope)."""
        if self.rope_scaling is None:
            return 1.0
        if isinstance(self.rope_scaling, LongRopeScaling):
            return self.rope_scaling.cos_sin_scale_for(self.max_position_embeddings)
        return self.rope_scaling.cos_sin_scale

    @property
    def attention_per_layer(self) -> int:
        """MLA sub-layers (each with its latent cache) per decoder layer: 2 for ``longcat_flash``, else 1."""
        return 2 if self.model_type == "longcat_flash" else 1

    @property
    def decoder_layers(self) -> int:
        """Decoder layers: ``num_hidden_layers`` over :attr:`attention_per_layer` (LongCat's ``num_layers``)."""
        return self.num_hidden_layers // self.attention_per_layer

    @property
    def is_moe(self) -> bool:
        """True when some layers use routed experts."""
        return self.n_routed_experts is not None

    def is_moe_layer(self, index: int) -> bool:
        """True when decoder layer ``index`` uses the MoE block rather than the dense MLP (``mlp_layer_types`` if
        given, else every layer from ``first_k_dense_replace`` on; every LongCat layer has its shortcut MoE)."""
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types[index] == "sparse"
        return self.is_moe and index >= self.first_k_dense_replace

    def replace(self, **changes: Any) -> "MLAConfig":
        """A copy with ``changes`` applied (validated again)."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(f"unknown config field(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)

    def first_layers(self, layers: int) -> "MLAConfig":
        """The model cut to its first ``layers`` decoder layers (dense layers stay dense).

        Raises:
            ConfigError: ``layers`` outside ``1 .. num_hidden_layers``.
        """
        if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= self.num_hidden_layers:
            raise ConfigError(f"layers must be an integer in 1..{self.num_hidden_layers} (the model's "
                              f"num_hidden_layers), got {layers!r}")
        types = None if self.mlp_layer_types is None else self.mlp_layer_types[:layers]
        # the residual scale is the whole model's: scale_depth / sqrt(L) with L the full depth
        depth = None if self.scale_depth is None else self.scale_depth * math.sqrt(layers / self.num_hidden_layers)
        return self.replace(num_hidden_layers=layers, first_k_dense_replace=min(self.first_k_dense_replace, layers),
                            mlp_layer_types=types, scale_depth=depth)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON/TOML friendly); ``rope_scaling`` becomes a nested dict or is dropped."""
        out = dataclasses.asdict(self)
        if out["rope_scaling"] is None:
            del out["rope_scaling"]
        else:
            kind = "longrope" if isinstance(self.rope_scaling, LongRopeScaling) else "yarn"
            out["rope_scaling"] = {"type": kind, **{k: list(v) if isinstance(v, tuple) else v
                                                    for k, v in out["rope_scaling"].items() if v is not None}}
        if out["q_lora_rank"] is None:
            del out["q_lora_rank"]
        if out["moe_intermediate_size"] is None:
            del out["moe_intermediate_size"]
        if out["n_routed_experts"] is None:
            del out["n_routed_experts"]
        if out["mlp_layer_types"] is None:
            del out["mlp_layer_types"]
        else:
            out["mlp_layer_types"] = list(out["mlp_layer_types"])
        if not out["post_mlp_layernorm"]:
            del out["post_mlp_layernorm"]
        if not out["zero_expert_num"]:
            del out["zero_expert_num"]
        for key in ("scale_emb", "scale_depth", "dim_model_base", "llama_4_scaling_beta", "index_topk",
                    "index_head_dim", "index_n_heads", "latent_norm_eps"):
            if out[key] is None:
                del out[key]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "config") -> "MLAConfig":
        """Build from a dict that uses exactly this class's field names; unknown keys are an error.

        Args:
            data: field values; ``rope_scaling`` may be a dict with ``type = "yarn"``.
            source: where the dict came from, for error messages.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: must be a table of fields, got {type(data).__name__}")
        data = dict(data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown field(s) {', '.join(unknown)}")
        if "rope_scaling" in data and data["rope_scaling"] is not None:
            data["rope_scaling"] = _yarn_from_mapping(data["rope_scaling"], source)
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.name not in data]
        if missing:
            raise ConfigError(f"{source}: missing field(s) {', '.join(missing)}")
        try:
            return cls(**data)
        except TypeError as exc:  # pragma: no cover - guarded above
            raise ConfigError(f"{source}: {exc}") from None


def _yarn_from_mapping(raw: Any, source: str) -> YarnScaling | LongRopeScaling | None:
    if isinstance(raw, (YarnScaling, LongRopeScaling)):
        return raw
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source}: rope_scaling must be a table, got {raw!r}")
    raw = dict(raw)
    kinds = {k for k in (raw.pop("type", None), raw.pop("rope_type", None)) if k is not None}
    if len(kinds) > 1:  # transformers 5 writes both spellings when it converts a legacy rope_scaling
        raise ConfigError(f"{source}: rope_scaling type and rope_type disagree ({', '.join(sorted(kinds))})")
    kind = kinds.pop() if kinds else None
    raw.pop("rope_theta", None)
    if kind in (None, "default"):
        if any(k in raw for k in ("factor", "original_max_position_embeddings")):
            raise ConfigError(f"{source}: rope_scaling has YaRN fields but no type = \"yarn\"")
        return None
    if kind == "longrope":
        return _longrope_from_mapping(raw, source)
    if kind not in ("yarn", "deepseek_yarn"):
        raise ConfigError(f"{source}: rope scaling type {kind!r} is not supported (only 'yarn', static 'longrope' "
                          "and none)")
    allowed = {f.name for f in dataclasses.fields(YarnScaling)}
    if raw.pop("truncate", True) is not True:
        raise ConfigError(f"{source}: rope_scaling truncate=false is not supported")
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ConfigError(f"{source}: unknown rope_scaling field(s) {', '.join(unknown)}")
    for needed in ("factor", "original_max_position_embeddings"):
        if needed not in raw:
            raise ConfigError(f"{source}: rope_scaling of type yarn needs {needed}")
    try:
        values = {k: (int(v) if k == "original_max_position_embeddings" else float(v)) for k, v in raw.items()}
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: rope_scaling values must be numbers, got "
                          f"{', '.join(f'{k}={v!r}' for k, v in raw.items())}") from None
    return YarnScaling(**values)


def _longrope_from_mapping(raw: dict[str, Any], source: str) -> LongRopeScaling:
    allowed = {f.name for f in dataclasses.fields(LongRopeScaling)}
    if raw.get("partial_rotary_factor") == 1:  # the whole rope slice rotates, as in every MLA model
        del raw["partial_rotary_factor"]
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ConfigError(f"{source}: unknown rope_scaling field(s) {', '.join(unknown)}")
    for needed in ("short_factor", "long_factor", "original_max_position_embeddings"):
        if needed not in raw:
            raise ConfigError(f"{source}: rope_scaling of type longrope needs {needed}")
    for key in ("original_max_position_embeddings", "factor", "attention_factor"):
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"{source}: rope_scaling.{key} must be a number, got {json.dumps(value)[:80]}")
    if raw.get("original_max_position_embeddings") != int(raw["original_max_position_embeddings"]):
        raise ConfigError(f"{source}: rope_scaling.original_max_position_embeddings must be an integer")
    raw["original_max_position_embeddings"] = int(raw["original_max_position_embeddings"])
    return LongRopeScaling(**raw)


# Hugging Face config.json --------------------------------------------------------------
# Keys that configure the model's semantics and are read into MLAConfig.
_HF_DIRECT = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rms_norm_eps",
    "max_position_embeddings", "moe_intermediate_size", "n_routed_experts", "n_shared_experts",
    "num_experts_per_tok", "first_k_dense_replace", "n_group", "topk_group", "topk_method",
    "scoring_func", "routed_scaling_factor", "norm_topk_prob", "tie_word_embeddings",
)
# The JSON type each read key must have (a number where a number is meant): a wrong one is a ConfigError.
_HF_JSON_TYPES: dict[str, tuple[type, ...]] = {
    **{k: (int,) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                           "qk_rope_head_dim", "v_head_dim", "max_position_embeddings", "moe_intermediate_size",
                           "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "first_k_dense_replace",
                           "n_group", "topk_group", "moe_layer_freq", "num_nextn_predict_layers",
                           "num_mtp_layers", "num_key_value_heads", "head_dim", "index_topk", "index_head_dim",
                           "index_n_heads")},
    **{k: (int, float) for k in ("rms_norm_eps", "routed_scaling_factor", "rope_theta", "scale_emb", "scale_depth")},
    "dim_model_base": (int,),
    **{k: (str,) for k in ("topk_method", "scoring_func", "model_type")},
    **{k: (bool,) for k in ("norm_topk_prob", "tie_word_embeddings", "rope_interleave")},
    **{k: (dict,) for k in ("rope_scaling", "rope_parameters", "quantization_config", "text_config")},
    "mlp_layer_types": (list,),
    "indexer_types": (list,),
}
# Keys whose value we check, because a value other than the expected one changes the math.
_HF_EXPECTED = {
    "hidden_act": ("silu",),
    "attention_bias": (False, None),
    "mlp_bias": (False, None),
    "attention_dropout": (0, 0.0, None),
}
# Keys that carry no semantics for the forward pass (metadata, generation, training, parallelism).
_HF_IGNORED = {
    "architectures", "auto_map", "model_type", "transformers_version", "torch_dtype", "dtype", "bos_token_id",
    "eos_token_id", "pad_token_id", "use_cache", "initializer_range", "pretraining_tp", "ep_size",
    "num_key_value_heads", "num_nextn_predict_layers", "num_mtp_layers", "aux_loss_alpha",
    "seq_aux", "quantization_config", "head_dim", "qk_head_dim", "rope_theta", "rope_scaling",
    "rope_parameters", "output_router_logits", "router_aux_loss_coef", "id2label", "label2id",
    "_name_or_path", "name_or_path", "return_dict", "output_hidden_states", "output_attentions",
    "torchscript", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention",
    "tie_encoder_decoder", "problem_type", "tokenizer_class", "task_specific_params", "finetuning_task",
    "prefix", "sep_token_id", "decoder_start_token_id", "use_bfloat16", "tf_legacy_loss", "pruned_heads",
    "cross_attention_hidden_size", "layer_types", "max_window_layers",
    "sliding_window", "use_sliding_window", "bos_token", "eos_token", "rope_type", "index_topk",
    "q_head_dim", "embedding_initializer_range", "rope_interleave", "moe_layer_freq", "mlp_layer_types",
    "index_head_dim", "index_n_heads", "indexer_types", "index_topk_freq", "index_skip_topk_offset",
    "index_topk_pattern",
}
# Other spellings of DeepSeek's keys, as the types' config classes map them (``attribute_map``).
_HF_ALIASES = {"num_experts": "n_routed_experts", "num_local_experts": "n_routed_experts",
               "num_shared_experts": "n_shared_experts"}


@dataclass(frozen=True)
class HFModelType:
    """How mla-deploy reads one transformers ``model_type`` whose attention is MLA.

    Attributes:
        family: ``deepseek_v2`` or ``deepseek_v3``: whose routing defaults and rope the type shares
            (:attr:`MLAConfig.model_type`).
        defaults: DeepSeek-named fields the type's config class defaults differently, used when config.json
            leaves them out.
        mtp_layers: multi-token-prediction layers its checkpoints carry after the decoder when config.json names
            none (GLM-4.7-Flash writes one, its config class has no key for it).
        post_mlp_layernorm: its MoE layers end in an RMSNorm (A.X-K1), stored at layer level on disk.
        text_prefix: the prefix of the text model's tensors on disk, for a multimodal wrapper ("" otherwise).
        skipped_prefixes: a wrapper's tensors that are not the text model (the vision tower, its projector).
        renames: ``(old, new)`` name prefixes (after ``text_prefix``) of another spelling on disk.
        half_rotated_rope: its rope rotates the pairs ``(i, i + d/2)`` whatever the config says (MiniCPM3).
        extra_keys: config keys of MLAConfig fields that only this type means (MiniCPM3's scalars); another type's
            config.json holding them is warned about and they are ignored, as transformers ignores them.
        head_dim: what config.json's ``head_dim`` is: ``rope`` (qk_rope_head_dim, as transformers writes DeepSeek's),
            ``qk`` (qk_nope_head_dim + qk_rope_head_dim: Mistral 4, whose rope then rotates the
            ``partial_rotary_factor`` of it), or ``any`` (Sarvam's own configs wrote kv_lora_rank + rope).
        query_scale: its rope block may hold ``llama_4_scaling_beta`` (Mistral 4's position-dependent query scale).
        zero_if_missing: name endings of tensors its releases may lack, which transformers then makes zero.
        index_rope_interleave: DeepSeek Sparse Attention's indexer rotates its rope channels in interleaved pairs
            (GLM-5) rather than half-rotated (DeepSeek-V3.2, whose rows the loader permutes); None: no indexer.
        aliases: the type's own spellings of DeepSeek's keys (LongCat's ``ffn_hidden_size``, ``moe_topk``, ...).
        mtp_prefix: the prefix of its multi-token-prediction tensors on disk (LongCat's ``model.mtp.``), skipped.
    """

    family: str
    defaults: Mapping[str, Any] = field(default_factory=dict)
    mtp_layers: int = 0
    post_mlp_layernorm: bool = False
    text_prefix: str = ""
    skipped_prefixes: tuple[str, ...] = ()
    renames: tuple[tuple[str, str], ...] = ()
    half_rotated_rope: bool = False
    extra_keys: tuple[str, ...] = ()
    head_dim: str = "rope"
    query_scale: bool = False
    zero_if_missing: tuple[str, ...] = ()
    index_rope_interleave: bool | None = None
    aliases: Mapping[str, str] = field(default_factory=dict)
    mtp_prefix: str = ""


_SPARSE_KEYS = ("index_topk", "index_head_dim", "index_n_heads")

#: the transformers model types read as a DeepSeek-V2/V3 decoder (``kimi_k25`` is a wrapper around ``text_config``)
#: the epsilon of ``q_a_layernorm`` and ``kv_a_layernorm`` in every MLA type transformers builds (its RMSNorm's
#: default, as in DeepSeek's own model.py), whatever ``rms_norm_eps`` a config gives the other norms
LATENT_NORM_EPS = 1e-6
HF_MODEL_TYPES: dict[str, HFModelType] = {
    "deepseek_v2": HFModelType("deepseek_v2"),
    "deepseek_v3": HFModelType("deepseek_v3"),
    "kimi_k2": HFModelType("deepseek_v3"),  # Kimi K2's text config: DeepSeek-V3 under another name
    "sarvam_mla": HFModelType("deepseek_v3", head_dim="any"),  # sarvam-105b: DeepseekV3ForCausalLM up to its config
    "glm4_moe_lite": HFModelType("deepseek_v3", {"rms_norm_eps": 1e-5, "first_k_dense_replace": 1},
                                 mtp_layers=1),  # GLM-4.7-Flash
    "youtu": HFModelType("deepseek_v3", {"tie_word_embeddings": True}),  # Youtu-LLM: dense, tied
    # A.X-K1; its releases route without a score correction bias, which transformers initialises to zero
    "axk1": HFModelType("deepseek_v3", {"first_k_dense_replace": 1}, post_mlp_layernorm=True,
                        zero_if_missing=("mlp.gate.e_score_correction_bias",)),
    "kimi_k25": HFModelType("deepseek_v3", {"tie_word_embeddings": True}, text_prefix="language_model.",
                            skipped_prefixes=("vision_tower.", "mm_projector.", "model.vision_tower.",
                                              "model.mm_projector."),
                            # transformers 5.24 saves the text layers as model.blocks (its vision rename reversed)
                            renames=(("model.blocks.", "model.layers."),)),  # Kimi K2.5 / K2.6
    "minicpm3": HFModelType("deepseek_v2", {"tie_word_embeddings": True, "rms_norm_eps": 1e-5, "scale_emb": 12,
                                            "scale_depth": 1.4, "dim_model_base": 256},
                            half_rotated_rope=True, extra_keys=("scale_emb", "scale_depth", "dim_model_base")),
    # Mistral Small 4: softmax routing over groups ranked by their best two experts, renormalised, no correction
    # bias; the Llama-4 query scale; head_dim = nope + rope; experts stored fused (our own layout)
    "mistral4": HFModelType("deepseek_v3", {"scoring_func": "softmax", "topk_method": "noaux_tc",
                                            "norm_topk_prob": True, "routed_scaling_factor": 1.0, "n_group": 1,
                                            "topk_group": 1, "first_k_dense_replace": 0},
                            head_dim="qk", query_scale=True),
    # DeepSeek-V3.2: DeepSeek-V3 with a lightning indexer per layer (half-rotated rope on its keys), one MTP layer
    "deepseek_v32": HFModelType("deepseek_v3", {"index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64,
                                                "first_k_dense_replace": 3},
                                mtp_layers=1, extra_keys=_SPARSE_KEYS, index_rope_interleave=False),
    # GLM-5: DeepSeek-V3.2's sparse attention with an interleaved indexer rope, one MTP layer
    "glm_moe_dsa": HFModelType("deepseek_v3", {"index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
                                               "first_k_dense_replace": 3, "rms_norm_eps": 1e-5, "n_group": 1,
                                               "topk_group": 1},
                               mtp_layers=1, extra_keys=_SPARSE_KEYS, index_rope_interleave=True),
    # LongCat-Flash: two MLA sub-layers per layer, a shortcut MoE with zero experts (config.json: num_layers, read by
    # _longcat_layers); the defaults are LongcatFlashConfig's
    "longcat_flash": HFModelType("longcat_flash", {"rms_norm_eps": 1e-5, "n_routed_experts": 512,
                                                   "zero_expert_num": 256, "num_experts_per_tok": 12,
                                                   "moe_intermediate_size": 2048, "routed_scaling_factor": 6.0},
                                 head_dim="any", extra_keys=("zero_expert_num",), mtp_prefix="model.mtp.",
                                 aliases={"ffn_hidden_size": "intermediate_size",
                                          "expert_ffn_hidden_size": "moe_intermediate_size",
                                          "moe_topk": "num_experts_per_tok"}),
}
#: MLA model types of transformers that mla-deploy refuses, with the mechanism it lacks
HF_REFUSED_TYPES: dict[str, str] = {
    "kimi_linear": "linear-attention layers (KDA) are not supported",
    "bailing_hybrid": "linear-attention layers (KDA) and the gated MLA output (g_proj) are not supported",
    "glm5_next": "linear-attention layers (KDA), hyper-connections and k-pooled sparse attention are not supported",
    "mistral_large4": "DeepSeek Sparse Attention, cross-layer latent sharing (kv_source_layers), NoPE layers and "
                      "the final logit softcap are not supported",
    "hy_v4": "DeepSeek Sparse Attention with attention sinks, the attention output gate and hyper-connections "
             "are not supported",
    "hy_v4_vl": "DeepSeek Sparse Attention with attention sinks, the attention output gate, hyper-connections "
                "and m-rope are not supported",
    "axk2": "DeepSeek Sparse Attention, the query and output gates and gated RMSNorms are not supported",
    "dots3_note": "per-layer-type MLA dimensions, sliding-window MLA layers and DeepSeek Sparse Attention are not "
                  "supported",
    "deepseek_v4": "its attention is not MLA with a latent cache (one 512-wide KV head, compressed and sliding "
                   "attention)",
}


@dataclass(frozen=True)
class HFLayout:
    """How a checkpoint's tensors on disk relate to the model's: what :func:`read_hf_config` tells the loader.

    Attributes:
        model_type: the checkpoint's own ``model_type`` (``glm4_moe_lite``, ``kimi_k25``, ...).
        text_prefix: stripped from every tensor name (a wrapper's ``language_model.``); names without it are the
            wrapper's own and must be in ``skipped_prefixes``.
        skipped_prefixes: tensors of the wrapper that are not the text model.
        renames: ``(old, new)`` name prefixes, after ``text_prefix``: another spelling of our names on disk.
        mtp_layers: multi-token-prediction layers after the decoder (``model.layers.{L}..{L+n-1}``), skipped.
        rope_interleave: False when the rope rows of the query and ``kv_a_proj_with_mqa`` are in the half-rotated
            order (pairs ``(i, i + d/2)``), which the loader permutes into DeepSeek's interleaved pairs.
        weight_block_size: the float8 block of ``quantization_config`` (DeepSeek-V3's 128 x 128).
        zero_if_missing: name endings of tensors that may be absent, read as zeros (A.X-K1's routing bias).
        index_rope_interleave: False when the sparse-attention indexer's rope rows are half-rotated (DeepSeek-V3.2),
            which the loader permutes into interleaved pairs.
    """

    model_type: str = "deepseek_v3"
    text_prefix: str = ""
    skipped_prefixes: tuple[str, ...] = ()
    renames: tuple[tuple[str, str], ...] = ()
    mtp_layers: int = 0
    rope_interleave: bool = True
    weight_block_size: tuple[int, int] = (128, 128)
    zero_if_missing: tuple[str, ...] = ()
    index_rope_interleave: bool = True
    mtp_prefix: str = ""


def from_hf_config(source: str | Path | Mapping[str, Any], name: str | None = None) -> MLAConfig:
    """Read a Hugging Face ``config.json`` of an MLA model (a path, a folder holding one, or a dict).

    The types of :data:`HF_MODEL_TYPES` are read (DeepSeek-V2/V3 and the models that are DeepSeek-V3 up to their
    config); those of :data:`HF_REFUSED_TYPES` are refused naming the mechanism mla-deploy lacks. Both the older
    ``rope_theta`` + ``rope_scaling`` spelling and transformers 5's ``rope_parameters`` are read. A setting that
    changes the math in a way this package does not implement (``hidden_act`` other than silu, attention bias) is
    an error; metadata keys are ignored.

    Raises:
        ConfigError: unreadable file, missing field, unsupported setting, inconsistent value.
    """
    return read_hf_config(source, name)[0]


def read_hf_config(source: str | Path | Mapping[str, Any], name: str | None = None) -> tuple[MLAConfig, HFLayout]:
    """:func:`from_hf_config`'s config, and the :class:`HFLayout` of the checkpoint's tensors."""
    if isinstance(source, Mapping):
        raw, label = dict(source), name or "config.json"
    else:
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"no Hugging Face config at {path}")
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError) as exc:  # ValueError: JSON's or UTF-8's
            raise ConfigError(f"{path}: not a readable JSON config ({type(exc).__name__}: {str(exc)[:200]})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: not a Hugging Face config (a JSON object), got {type(raw).__name__}")
        label = str(path)
        name = name or path.parent.name
    model_type = _hf_model_type(raw, label)
    kind = HF_MODEL_TYPES[model_type]
    block = _hf_block_size(raw, label)
    if kind.text_prefix:  # a multimodal wrapper: the text model's config is its text_config
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{label}: a {model_type} config holds its text model's config in text_config, "
                              f"{'which is missing' if text is None else f'not a JSON object but {text!r}'}")
        inner = _hf_model_type(text, f"{label} text_config")
        if inner not in ("deepseek_v3", "kimi_k2"):
            raise ConfigError(f"{label}: the text model of {model_type} is DeepSeek-V3 (deepseek_v3 or kimi_k2), "
                              f"got text_config.model_type {inner!r}")
        # transformers ties the wrapper's lm_head as the wrapper's own config says (default True)
        text = {**text, "tie_word_embeddings": raw.get("tie_word_embeddings", kind.defaults["tie_word_embeddings"])}
        _check_json_types(text, f"{label} text_config")
        if "quantization_config" not in raw:  # the float8 block may be the text model's own
            block = _hf_block_size(text, f"{label} text_config")
        raw, label = text, f"{label} text_config"
    config = _config_from_hf(raw, label, model_type, kind, name)
    mtp = raw.get("num_nextn_predict_layers")
    mtp = raw.get("num_mtp_layers") if mtp is None else mtp
    layout = HFLayout(model_type=model_type, text_prefix=kind.text_prefix, skipped_prefixes=kind.skipped_prefixes,
                      renames=kind.renames,
                      mtp_layers=kind.mtp_layers if mtp is None else mtp,
                      rope_interleave=raw.get("rope_interleave") is not False and not kind.half_rotated_rope,
                      weight_block_size=block, zero_if_missing=kind.zero_if_missing,
                      index_rope_interleave=kind.index_rope_interleave is not False, mtp_prefix=kind.mtp_prefix)
    return config, layout


def _hf_model_type(raw: Mapping[str, Any], label: str) -> str:
    """The accepted ``model_type`` of ``raw`` (deepseek_v3 if absent), after checking its keys' JSON types."""
    _check_json_types(raw, label)
    model_type = raw.get("model_type", "deepseek_v3")
    if model_type in HF_REFUSED_TYPES:
        raise ConfigError(f"{label}: {model_type}: {HF_REFUSED_TYPES[model_type]}")
    if model_type not in HF_MODEL_TYPES:
        raise ConfigError(f"{label}: model_type {model_type!r} is not an MLA model mla-deploy reads (it reads "
                          f"{', '.join(HF_MODEL_TYPES)})")
    return model_type


def _check_json_types(raw: Mapping[str, Any], label: str) -> None:
    """Each key mla-deploy reads has its JSON type (``null`` allowed): one ConfigError naming the first that has not."""
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "a JSON object",
             list: "a list"}
    for key, types in _HF_JSON_TYPES.items():
        value = raw.get(key)
        if value is None:
            continue
        wrong = isinstance(value, bool) and bool not in types or not isinstance(value, types)
        if wrong:
            raise ConfigError(f"{label}: {key} must be {names[types[-1]]}, got {json.dumps(value)[:80]}")


def _hf_block_size(raw: Mapping[str, Any], label: str) -> tuple[int, int]:
    """``quantization_config.weight_block_size`` (128 x 128 when absent)."""
    qc = raw.get("quantization_config") or {}
    block = qc.get("weight_block_size")
    if block is None:
        return (128, 128)
    if not isinstance(block, list) or len(block) != 2 or not all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        raise ConfigError(f"{label}: quantization_config.weight_block_size must be two positive integers, "
                          f"got {json.dumps(block)[:80]}")
    return int(block[0]), int(block[1])


def _config_from_hf(raw: dict[str, Any], label: str, model_type: str, kind: HFModelType, name: str | None) -> MLAConfig:
    """The :class:`MLAConfig` of a text model's config ``raw`` of ``model_type``."""
    raw = _unaliased(raw, label, kind.aliases)
    if kind.family == "longcat_flash":
        raw = _longcat_raw(raw, label)
    _check_hf_math(raw, label, model_type, kind)
    read = (*_HF_DIRECT, *kind.extra_keys)
    unknown = sorted(k for k in raw if k not in read and k not in _HF_EXPECTED and k not in _HF_IGNORED)
    fields: dict[str, Any] = {k: v for k, v in kind.defaults.items() if raw.get(k) is None}
    fields.update({k: raw[k] for k in read if k in raw and raw[k] is not None})
    if fields.get("q_lora_rank") == 0:  # DeepSeek's own configs write 0 for "no query compression"
        del fields["q_lora_rank"]
    rope_theta, rope_scaling, beta = _hf_rope(raw, label, kind)
    fields.update(model_type=kind.family, rope_theta=rope_theta, rope_scaling=rope_scaling, name=name or label,
                  llama_4_scaling_beta=beta)
    if kind.family == "deepseek_v3" and "n_routed_experts" in fields:
        fields.setdefault("scoring_func", "sigmoid")
        fields.setdefault("topk_method", "noaux_tc")
    if fields.get("n_routed_experts") is None:
        if "sparse" in (raw.get("mlp_layer_types") or ()):
            raise ConfigError(f"{label}: mlp_layer_types has MoE ('sparse') layers but no n_routed_experts")
        for k in ("moe_intermediate_size", "n_shared_experts", "num_experts_per_tok", "first_k_dense_replace",
                  "n_group", "topk_group", "topk_method", "scoring_func", "routed_scaling_factor",
                  "norm_topk_prob"):
            fields.pop(k, None)
    else:
        fields.update(_hf_schedule(raw, fields, label))
        fields["post_mlp_layernorm"] = kind.post_mlp_layernorm
    if fields.get("latent_norm_eps") is None and fields.get("rms_norm_eps", LATENT_NORM_EPS) != LATENT_NORM_EPS:
        fields["latent_norm_eps"] = LATENT_NORM_EPS  # None keeps a config equal to one that never names it
    config = MLAConfig.from_dict(fields, source=label)
    if unknown:
        import warnings

        warnings.warn(f"{label}: ignored unknown config.json key(s): {', '.join(unknown)}", stacklevel=3)
    return config


def _unaliased(raw: Mapping[str, Any], label: str, extra: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``raw`` with the other spellings of DeepSeek's keys (:data:`_HF_ALIASES`, and the type's own ``extra``)
    renamed; two that disagree are an error."""
    raw = dict(raw)
    for alias, key in {**_HF_ALIASES, **(extra or {})}.items():
        if alias in raw:
            value = raw.pop(alias)
            if raw.get(key) is not None and raw[key] != value:
                raise ConfigError(f"{label}: {alias} ({value}) and {key} ({raw[key]}) disagree")
            raw[key] = value
    return raw


def _longcat_raw(raw: dict[str, Any], label: str) -> dict[str, Any]:
    """A LongCat-Flash config.json in DeepSeek's terms: ``num_hidden_layers`` = 2 x ``num_layers`` (MLA sub-layers),
    checked against a written ``num_hidden_layers``; the settings transformers' class does not compute refused."""
    raw = dict(raw)
    layers, sublayers = raw.pop("num_layers", None), raw.get("num_hidden_layers")
    for key, value in (("num_layers", layers), ("num_hidden_layers", sublayers)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ConfigError(f"{label}: {key} must be a positive integer, got {json.dumps(value)[:80]}")
    if layers is not None and sublayers is not None and sublayers != 2 * layers:
        raise ConfigError(f"{label}: contradictory layer counts: num_hidden_layers ({sublayers}) must be 2 x "
                          f"num_layers ({layers}), two MLA sub-layers per longcat_flash layer")
    if layers is None and sublayers is None:
        layers = 28  # LongcatFlashConfig's default
    if sublayers is not None and sublayers % 2:
        raise ConfigError(f"{label}: num_hidden_layers ({sublayers}) of longcat_flash must be even (two MLA "
                          "sub-layers per layer)")
    raw["num_hidden_layers"] = sublayers if sublayers is not None else 2 * layers
    if raw.get("router_bias"):  # transformers builds the bias but its router never adds it
        raise ConfigError(f"{label}: longcat_flash router_bias=true is not supported (transformers ignores the bias)")
    raw.pop("router_bias", None)
    for key in ("mla_scale_q_lora", "mla_scale_kv_lora"):  # LongCat's own flags; transformers always scales
        if raw.pop(key, True) is not True:
            raise ConfigError(f"{label}: {key}=false is not supported (transformers always applies the latent scale)")
    if raw.pop("zero_expert_type", "identity") != "identity":
        raise ConfigError(f"{label}: only identity zero experts are supported (zero_expert_type)")
    qk = raw.pop("qk_head_dim", None)
    nope, rope = raw.get("qk_nope_head_dim"), raw.get("qk_rope_head_dim")
    if qk is not None and isinstance(nope, int) and isinstance(rope, int) and qk != nope + rope:
        raise ConfigError(f"{label}: qk_head_dim ({qk}) differs from qk_nope_head_dim + qk_rope_head_dim "
                          f"({nope + rope})")
    if raw.get("rope_parameters") is None and raw.get("rope_scaling") is None and raw.get("rope_theta") is None:
        raw["rope_theta"] = 10000000.0  # LongcatFlashConfig's default_theta
    for key in ("n_shared_experts", "first_k_dense_replace", "mlp_layer_types", "moe_layer_freq", "topk_method",
                "scoring_func", "n_group", "topk_group", "norm_topk_prob"):
        if raw.get(key) is not None:  # not part of LongCat's routing: transformers would ignore it silently
            raise ConfigError(f"{label}: longcat_flash does not use {key} (got {json.dumps(raw[key])[:40]})")
    raw.update(topk_method="greedy", scoring_func="softmax", n_shared_experts=0, first_k_dense_replace=0)
    return raw


def _check_hf_math(raw: Mapping[str, Any], label: str, model_type: str, kind: HFModelType) -> None:
    """The settings that change the math the way mla-deploy does not implement, or contradict MLA, are refused."""
    for key, allowed in _HF_EXPECTED.items():
        if key in raw and raw[key] not in allowed:
            raise ConfigError(f"{label}: {key}={raw[key]!r} is not supported (expected {allowed[0]!r})")
    if raw.get("rope_interleave") is False and kind.family != "deepseek_v3":
        raise ConfigError(f"{label}: rope_interleave=false is not supported for {model_type}")
    heads = raw.get("num_attention_heads")
    kv_heads = raw.get("num_key_value_heads")
    if kv_heads is not None and heads is not None and kv_heads != heads:
        raise ConfigError(f"{label}: num_key_value_heads ({kv_heads}) must equal num_attention_heads ({heads}) for MLA")
    if kind.index_rope_interleave is not None:
        _check_indexer_types(raw, label, model_type)
    head_dim = raw.get("head_dim")
    rope_dim, nope_dim = raw.get("qk_rope_head_dim"), raw.get("qk_nope_head_dim")
    if head_dim is not None and rope_dim is not None and kind.head_dim != "any":
        # transformers writes head_dim = qk_rope_head_dim (the rope width), Mistral 4 nope + rope
        want, what = ((rope_dim, "qk_rope_head_dim") if kind.head_dim == "rope" else
                      ((nope_dim or 0) + rope_dim, "qk_nope_head_dim + qk_rope_head_dim"))
        if head_dim != want:
            raise ConfigError(f"{label}: head_dim ({head_dim}) differs from {what} ({want})")


def _check_indexer_types(raw: Mapping[str, Any], label: str, model_type: str) -> None:
    """GLM-5's ``indexer_types`` (or the ``index_topk_freq`` / ``index_skip_topk_offset`` / ``index_topk_pattern``
    transformers derives them from): a ``shared`` layer reuses an earlier layer's top-k, which is refused."""
    types = raw.get("indexer_types")
    if types is None and raw.get("index_topk_pattern") is not None:
        pattern = raw["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    if types is None and raw.get("index_topk_freq") not in (None, 1):
        freq, offset = raw["index_topk_freq"], raw.get("index_skip_topk_offset", 2)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (freq, offset)):
            raise ConfigError(f"{label}: index_topk_freq and index_skip_topk_offset must be integers")
        types = ["full" if max(i - offset + 1, 0) % max(freq, 1) == 0 else "shared"
                 for i in range(raw.get("num_hidden_layers") or 0)]
    if types is None:
        return
    if not isinstance(types, (list, tuple)) or any(t not in ("full", "shared") for t in types):
        raise ConfigError(f"{label}: indexer_types must be a list of 'full' or 'shared', got {str(types)[:80]}")
    shared = [i for i, t in enumerate(types) if t == "shared"]
    if shared:
        raise ConfigError(f"{label}: {model_type}: layers reusing an earlier layer's top-k (indexer_types 'shared', "
                          f"layer {shared[0]}) are not supported; every layer must run its own indexer")


def _hf_schedule(raw: Mapping[str, Any], fields: Mapping[str, Any], label: str) -> dict[str, Any]:
    """Which layers are MoE: ``mlp_layer_types`` (GLM-4.7-Flash, A.X-K1) or DeepSeek's ``first_k_dense_replace``
    and ``moe_layer_freq`` (layer ``i`` is MoE when ``i >= k`` and ``i % freq == 0``, as DeepSeek's own code builds
    it), checked against each other when both are given. Returns the fields: ``first_k_dense_replace`` alone when
    the schedule is the first k layers dense, else ``mlp_layer_types`` too."""
    layers = fields.get("num_hidden_layers")
    types = raw.get("mlp_layer_types")
    first_k, freq = raw.get("first_k_dense_replace"), raw.get("moe_layer_freq")
    if freq is not None and freq <= 0:
        raise ConfigError(f"{label}: moe_layer_freq must be a positive integer, got {freq}")
    if types is None and freq in (None, 1):
        return {}  # the first first_k_dense_replace layers dense (the type's default when config.json has none)
    if not isinstance(layers, int) or isinstance(layers, bool) or layers <= 0:
        return {}  # MLAConfig says what is wrong with num_hidden_layers
    derived, k = None, fields.get("first_k_dense_replace", 0)  # k: config.json's, else the type's default
    if first_k is not None or freq not in (None, 1):  # a moe_layer_freq of 1 alone says nothing
        derived = ["sparse" if i >= k and i % (freq or 1) == 0 else "dense" for i in range(layers)]
    if types is None:
        types = derived
    else:
        MLAConfig._check_schedule_of(types, layers, label)
        differ = next((i for i, (a, b) in enumerate(zip(types, derived or types)) if a != b), None)
        if differ is not None:
            raise ConfigError(f"{label}: contradictory MoE schedules: mlp_layer_types makes layer {differ} "
                              f"{types[differ]!r}, first_k_dense_replace {k} and moe_layer_freq "
                              f"{freq if freq is not None else 1} make it {derived[differ]!r}")
    dense = next((i for i, t in enumerate(types) if t != "dense"), len(types))
    if list(types) == ["dense"] * dense + ["sparse"] * (len(types) - dense):
        return {"first_k_dense_replace": dense, "mlp_layer_types": None}
    return {"first_k_dense_replace": 0, "mlp_layer_types": list(types)}


def _hf_rope(raw: Mapping[str, Any], label: str,
             kind: HFModelType) -> tuple[float, YarnScaling | LongRopeScaling | None, float | None]:
    """``(rope_theta, rope_scaling, llama_4_scaling_beta)`` of a config.json."""
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    if params is not None and scaling is not None and params != scaling:
        # transformers 5 keeps both in sync when it writes; two different blocks are ambiguous
        merged = dict(params)
        for k, v in scaling.items():
            if k in merged and merged[k] != v and k not in ("type", "rope_type"):
                raise ConfigError(f"{label}: rope_parameters and rope_scaling disagree on {k}")
        scaling = None
    block = dict(params if params is not None else (scaling or {}))
    theta = block.pop("rope_theta", None)
    if theta is None:
        theta = raw.get("rope_theta", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ConfigError(f"{label}: rope_theta must be a number, got {json.dumps(theta)[:80]}")
    beta = block.pop("llama_4_scaling_beta", None) if kind.query_scale else None
    if kind.head_dim == "qk":  # the rope rotates partial_rotary_factor of head_dim = nope + rope: the rope slice
        factor = block.pop("partial_rotary_factor", None)
        rope, nope = raw.get("qk_rope_head_dim"), raw.get("qk_nope_head_dim")
        if factor is not None and isinstance(rope, int) and isinstance(nope, int) and \
                abs(factor * (rope + nope) - rope) > 1e-6:
            raise ConfigError(f"{label}: rope partial_rotary_factor {factor} of head_dim {rope + nope} is not "
                              f"qk_rope_head_dim ({rope})")
        if block.pop("max_position_embeddings", raw.get("max_position_embeddings")) != raw.get("max_position_embeddings"):
            raise ConfigError(f"{label}: rope_parameters.max_position_embeddings differs from max_position_embeddings")
    yarn = _yarn_from_mapping(block, label) if block else None
    return float(theta), yarn, beta


_HF_ARCHITECTURES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
_HF_MOE = ("moe_intermediate_size", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group",
           "topk_group", "topk_method", "scoring_func", "routed_scaling_factor", "norm_topk_prob")


def to_hf_config(config: MLAConfig, **overrides: Any) -> dict[str, Any]:
    """``config`` as a Hugging Face ``config.json`` dict: the inverse of :func:`from_hf_config`.

    Every key transformers' ``DeepseekV2Config`` / ``DeepseekV3Config`` needs for the same model: the dimensions,
    ``num_key_value_heads`` = the head count, the fixed math (``hidden_act`` silu, no attention bias), the rope
    as transformers 5 writes it (one ``rope_parameters`` block: ``rope_type`` default or yarn, ``rope_theta``,
    YaRN's fields), ``model_type`` and ``architectures``; for V3 also ``rope_interleave`` and
    ``num_nextn_predict_layers = 0`` (no multi-token-prediction layers). A config using what only another type
    has (``mlp_layer_types``, ``post_mlp_layernorm``, longrope, MiniCPM3's scales) is a ConfigError. A dense
    model (no routed experts) has no MoE keys and ``first_k_dense_replace = num_hidden_layers``, so transformers
    builds a dense MLP in every layer.
    ``from_hf_config(to_hf_config(c), name=c.name) == c``.

    Args:
        config: the model.
        overrides: keys to set or replace (e.g. ``num_hidden_layers=2``, ``torch_dtype="bfloat16"``).
    Returns:
        a JSON-serialisable dict (``transformers.AutoConfig.for_model(**d)`` builds the transformers config).
    """
    c = config
    beyond = [name for name, used in (("mlp_layer_types", c.mlp_layer_types is not None),
                                      ("post_mlp_layernorm", c.post_mlp_layernorm),
                                      ("longrope", isinstance(c.rope_scaling, LongRopeScaling)),
                                      ("scale_emb/scale_depth/dim_model_base",
                                       (c.scale_emb, c.scale_depth, c.dim_model_base) != (None, None, None)),
                                      ("llama_4_scaling_beta", c.llama_4_scaling_beta is not None),
                                      ("sparse attention (index_topk)", c.is_sparse),
                                      ("softmax noaux_tc routing", c.is_moe and c.topk_method == "noaux_tc"
                                       and c.scoring_func == "softmax"),
                                      ("longcat_flash's layers (two MLA sub-layers, shortcut MoE, zero experts)",
                                       c.model_type == "longcat_flash")) if used]
    if beyond:
        raise ConfigError(f"{c.name}: a transformers DeepSeek-V2/V3 config cannot express {', '.join(beyond)}")
    out: dict[str, Any] = {
        "architectures": [_HF_ARCHITECTURES[c.model_type]], "model_type": c.model_type,
        **{k: getattr(c, k) for k in _HF_DIRECT if k not in _HF_MOE},
        "num_key_value_heads": c.num_attention_heads, "hidden_act": "silu", "attention_bias": False,
        "attention_dropout": 0.0, "rope_parameters": _hf_rope_parameters(c),
    }
    if c.is_moe:
        out.update({k: getattr(c, k) for k in _HF_MOE})
    if c.model_type == "deepseek_v3":
        out.update(rope_interleave=True, num_nextn_predict_layers=0)
    out.update(overrides)
    if not c.is_moe and "first_k_dense_replace" not in overrides:
        out["first_k_dense_replace"] = out["num_hidden_layers"]  # every layer dense
    return out


def _hf_rope_parameters(config: MLAConfig) -> dict[str, Any]:
    """transformers 5's ``rope_parameters`` block: ``rope_type`` (default or yarn), ``rope_theta``, YaRN's fields."""
    theta = float(config.rope_theta)
    if config.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    yarn = {k: v for k, v in dataclasses.asdict(config.rope_scaling).items() if v is not None}
    return {"rope_type": "yarn", "rope_theta": theta, **yarn}
