"""The ONNX I/O contract: tensor names, dtypes and symbolic shapes of every exported graph.

Names follow the Hugging Face ONNX convention, adapted to MLA's latent cache (decided here, once,
and written into ``manifest.json``):

==================== ============================================ ===========================================
tensor               concat cache mode                            static cache mode
==================== ============================================ ===========================================
``input_ids``        int64 [batch_size, sequence_length]          same
``position_ids``     int64 [batch_size, sequence_length]          same
``attention_mask``   int64 [batch_size, total_sequence_length]    (absent)
``write_indices``    (absent)                                     int64 [batch_size]: valid rows before the step
``past_latent.{i}``  [batch_size, past_sequence_length, C]        [batch_size, 1, max_cache_length, C]
``logits``           [batch_size, sequence_length, vocab_size]    same
``present_latent.{i}`` [batch_size, total_sequence_length, C]     [batch_size, 1, max_cache_length, C] (aliases the past)
==================== ============================================ ===========================================

``C = kv_lora_rank + qk_rope_head_dim`` (576 for DeepSeek): channels ``[0, kv_lora_rank)`` are ``c_kv``
after ``kv_a_layernorm``; ``[kv_lora_rank, C)`` are ``k_pe`` after rope, adjacent pairs interleaved.
``total_sequence_length = past_sequence_length + sequence_length``. Logits and latent tensors have the
export's precision (every float input, output and weight does); rope angles, RMSNorm statistics and the
softmax run in float32 inside the graph, as in DeepSeek's reference code.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import MLAConfig

CACHE_MODES = ("concat", "static")
ROLES = ("prefill", "decode")
PRECISIONS = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}

BATCH = "batch_size"
SEQ = "sequence_length"
PAST = "past_sequence_length"
TOTAL = "total_sequence_length"
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


def decoder_io(config: MLAConfig, cache_mode: str, precision: str) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Inputs and outputs of a decoder graph (prefill and decode share them).

    Args:
        config: the model.
        cache_mode: ``concat`` or ``static``.
        precision: ``fp32``, ``fp16`` or ``bf16`` (the latent caches' dtype).
    Returns:
        (inputs, outputs) in graph order.
    """
    if cache_mode not in CACHE_MODES:
        raise ValueError(f"cache_mode must be one of {CACHE_MODES}, got {cache_mode!r}")
    dtype = PRECISIONS[precision]
    c = config.latent_dim
    inputs = [TensorSpec("input_ids", "int64", (BATCH, SEQ)), TensorSpec("position_ids", "int64", (BATCH, SEQ))]
    if cache_mode == "concat":
        inputs.append(TensorSpec("attention_mask", "int64", (BATCH, TOTAL)))
        past_shape: tuple = (BATCH, PAST, c)
        present_shape: tuple = (BATCH, TOTAL, c)
    else:
        inputs.append(TensorSpec("write_indices", "int64", (BATCH,)))
        past_shape = present_shape = (BATCH, 1, CAPACITY, c)
    layers = range(config.num_hidden_layers)
    inputs += [TensorSpec(past_name(i), dtype, past_shape) for i in layers]
    outputs = [TensorSpec("logits", dtype, (BATCH, SEQ, config.vocab_size))]
    outputs += [TensorSpec(present_name(i), dtype, present_shape) for i in layers]
    return inputs, outputs


def cache_layout(config: MLAConfig, cache_mode: str) -> dict:
    """The manifest's description of the latent cache."""
    r, c = config.kv_lora_rank, config.latent_dim
    return {
        "mode": cache_mode,
        "width": c,
        "channels": {"c_kv": [0, r], "k_pe": [r, c]},
        "c_kv": "kv_a_layernorm(c_kv), the compressed key/value latent",
        "k_pe": "rope(k_pe) shared by all heads, adjacent pairs (2i, 2i+1) interleaved as in DeepSeek's weights",
        "sequence_axis": -2,
        "layers": [{"past": past_name(i), "present": present_name(i)} for i in range(config.num_hidden_layers)],
        "aliased": cache_mode == "static",
    }
