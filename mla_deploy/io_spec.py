"""The ONNX I/O contract: tensor names, dtypes and symbolic shapes of every exported graph.

Names follow the Hugging Face ONNX convention, adapted to MLA's latent cache (decided here, once,
and written into ``manifest.json``):

==================== ============================================ ===========================================
tensor               concat cache mode                            static cache mode
==================== ============================================ ===========================================
``input_ids``        int64 [batch_size, sequence_length]          same
``position_ids``     int64 [batch_size, sequence_length]          same
``logits_index``     int64 [batch_size, logits_length]: which of   same
                     the step's positions get logits
``attention_mask``   int64 [batch_size, total_sequence_length]    (absent)
``write_indices``    (absent)                                     int64 [batch_size]: valid rows before the step
``past_latent.{i}``  [batch_size, past_sequence_length, C]        [batch_size, 1, max_cache_length, C]
``logits``           [batch_size, logits_length, vocab_size]      same
``present_latent.{i}`` [batch_size, total_sequence_length, C]     [batch_size, 1, max_cache_length, C] (aliases the past)
``past_index.{i}``   [batch_size, past_sequence_length, Di]       [batch_size, 1, max_cache_length, Di]
``present_index.{i}`` [batch_size, total_sequence_length, Di]     [batch_size, 1, max_cache_length, Di] (aliases the past)
==================== ============================================ ===========================================

The ``*_index.{i}`` caches exist only for a model with DeepSeek Sparse Attention (``index_topk`` set: DeepSeek-V3.2,
GLM-5): each layer's lightning-indexer keys, ``Di = index_head_dim`` per token, after every ``past_latent`` input and
every ``present_latent`` output.

``C = kv_lora_rank + qk_rope_head_dim`` (576 for DeepSeek): channels ``[0, kv_lora_rank)`` are ``c_kv``
after ``kv_a_layernorm``; ``[kv_lora_rank, C)`` are ``k_pe`` after rope, adjacent pairs interleaved.
``total_sequence_length = past_sequence_length + sequence_length``. ``logits_index`` picks the positions (in
``[0, sequence_length)``) whose hidden state goes through the final norm and ``lm_head``: a generation step asks
for each sequence's last real token (``logits_length`` 1), so a prefill never computes or returns
``[batch, prompt, vocab]`` logits (transformers' ``logits_to_keep``, TensorRT-LLM's ``last_token_ids``);
validation asks for every position. Logits and latent tensors have the
export's precision (every float input, output and weight does); rope angles, RMSNorm statistics and the
softmax run in float32 inside the graph, as in DeepSeek's reference code.

This module holds the names and :class:`TensorSpec`; what each cache mode means (which control input, the
cache shapes, the per-mode I/O lists and the manifest's ``cache`` entry) is decided by the layouts of
:mod:`mla_deploy.cache_layout` (:meth:`~mla_deploy.cache_layout.CacheLayout.io`,
:meth:`~mla_deploy.cache_layout.CacheLayout.describe`, :data:`~mla_deploy.cache_layout.CACHE_MODES`).
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("prefill", "decode")
PRECISIONS = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}

BATCH = "batch_size"
SEQ = "sequence_length"
PAST = "past_sequence_length"
TOTAL = "total_sequence_length"
LOGITS = "logits_length"
CAPACITY = "max_cache_length"


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output: name, element type (numpy-style name) and shape (ints and symbols)."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, data: dict) -> "TensorSpec":
        return cls(data["name"], data["dtype"], tuple(data["shape"]))


def past_name(layer: int) -> str:
    """Input name of layer ``layer``'s cache."""
    return f"past_latent.{layer}"


def present_name(layer: int) -> str:
    """Output name of layer ``layer``'s cache."""
    return f"present_latent.{layer}"


def index_past_name(layer: int) -> str:
    """Input name of layer ``layer``'s index-key cache (DeepSeek Sparse Attention)."""
    return f"past_index.{layer}"


def index_present_name(layer: int) -> str:
    """Output name of layer ``layer``'s index-key cache (DeepSeek Sparse Attention)."""
    return f"present_index.{layer}"
