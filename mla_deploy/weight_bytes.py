"""How many bytes a model's weights take, sorted by how a step reads them: what the whole-model bench bounds a step
by, what ``validate`` checks its PyTorch reference against the memory with, and what an export checks the disk
with. Pure arithmetic over the model's parameter list, built on the meta device (nothing is allocated).

The weights are sorted from the model's own parameter list (an :class:`~mla_deploy.model.MLAForCausalLM` in the
absorbed ``A_CC`` form):

* routed experts (``mlp.experts.gate_up_proj``/``down_proj``): a step reads only the experts routed to by its
  tokens: per MoE layer, the union over the batch (and, in a prefill, over the prompt);
* the embedding: one row per distinct token id of the step (a tied lm_head reads the whole matrix anyway);
* the lm_head: read whole;
* everything else (attention, norms, dense MLPs, shared experts, routers): read whole every step.

Each tensor counts its bytes as the artifact stores it, as the manifest's quantization record says
(:meth:`mla_deploy.quant.Quantization.stored_nbytes`): a tensor held quantized its integers and scales in its
format's layout (per expert for stacked experts), every other tensor ``numel * itemsize``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .config import MLAConfig
from .quant import FLOAT, Quantization, QuantizedKeys

_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
#: memory every process that holds a model needs besides its tensors (interpreter, torch, ONNX Runtime)
PROCESS_OVERHEAD = 600 << 20
#: bytes per value of each artifact precision
ITEMSIZE = {"fp32": 4, "fp16": 2, "bf16": 2}


@dataclass(frozen=True)
class WeightGroups:
    """The model's weights sorted by how a step reads them (see the module docstring), in bytes as the artifact
    stores them.

    Attributes:
        itemsize: bytes per float weight (and per scale of a quantized one).
        always_bytes: weights every step reads whole.
        always_matrix_params: the matrix (>= 2-D) parameters among them: 2 FLOPs per parameter per token.
        expert_params: parameters of one routed expert (gate, up, down).
        expert_bytes: bytes of one routed expert.
        moe_layers: indices of the layers with routed experts.
        n_experts, top_k: routed experts per MoE layer, experts chosen per token.
        embedding_row_bytes: one embedding row (0 when the lm_head shares the matrix: it is read whole).
        lm_head_params, lm_head_bytes: the lm_head.
        total_params, total_bytes: every parameter of the model.
        quantization: the weights' quantization (:data:`~mla_deploy.quant.FLOAT`: none), the keys it holds.
        quantized_bytes: bytes of the quantized tensors (integers and scales; 0 for float weights).
    """

    itemsize: int
    always_bytes: int
    always_matrix_params: int
    expert_params: int
    expert_bytes: int
    moe_layers: tuple[int, ...]
    n_experts: int
    top_k: int
    embedding_row_bytes: int
    lm_head_params: int
    lm_head_bytes: int
    total_params: int
    total_bytes: int
    quantization: Quantization = FLOAT
    quantized_bytes: int = 0

    @property
    def weights(self) -> str:
        """``float``, ``int8`` or ``int4``."""
        return self.quantization.weights

    def active_params_per_token(self) -> int:
        """Matrix parameters one token multiplies with (its k routed experts per MoE layer, the lm_head)."""
        return self.always_matrix_params + self.top_k * self.expert_params * len(self.moe_layers) + self.lm_head_params

    def to_dict(self) -> dict:
        return {"weights": self.weights, "itemsize": self.itemsize, "always_bytes": self.always_bytes,
                "always_matrix_params": self.always_matrix_params, "expert_bytes": self.expert_bytes,
                "moe_layers": len(self.moe_layers), "n_experts": self.n_experts, "top_k": self.top_k,
                "all_experts_bytes": self.expert_bytes * self.n_experts * len(self.moe_layers),
                "embedding_row_bytes": self.embedding_row_bytes, "lm_head_bytes": self.lm_head_bytes,
                "total_params": self.total_params, "total_bytes": self.total_bytes,
                "quantized_bytes": self.quantized_bytes, "quantized_tensors": self.quantization.key_count,
                "active_params_per_token": self.active_params_per_token()}


def _meta_state(config: MLAConfig) -> dict:
    """The absorbed model's state dict, on the meta device (nothing allocated)."""
    import torch

    from .model import MLAForCausalLM

    with torch.device("meta"):
        return MLAForCausalLM(config, "A_CC").state_dict()


def weight_groups(config: MLAConfig, itemsize: int = 4, quantization: Quantization = FLOAT) -> WeightGroups:
    """Sort ``config``'s parameters (the absorbed model's, on the meta device) into :class:`WeightGroups`.

    Args:
        itemsize: bytes per float weight (and per scale).
        quantization: the manifest's record (:func:`manifest_weight_groups`): its keys (``Linear [out, in]`` or
            stacked experts ``[E, out, in]``) count as its format stores them.
    """
    state = _meta_state(config)
    unknown = quantization.unknown_keys(state)
    if unknown:
        raise ValueError(f"quantized key {unknown[0]} is no parameter of the model")
    always_bytes = matrices = expert = expert_bytes = lm_head = lm_head_bytes = total = total_bytes = 0
    moe_layers, tied = set(), config.tie_word_embeddings
    for name, tensor in state.items():
        n, size = tensor.numel(), quantization.stored_nbytes(name, tensor.shape, itemsize)
        if not (tied and name == "lm_head.weight"):
            total, total_bytes = total + n, total_bytes + size
        match = _EXPERT.match(name)
        if match:
            moe_layers.add(int(match.group(1)))
            expert += n // config.n_routed_experts
            expert_bytes += size // config.n_routed_experts
        elif name == "lm_head.weight":
            lm_head, lm_head_bytes = n, size
        elif name != "model.embed_tokens.weight":
            always_bytes += size
            matrices += n if tensor.dim() >= 2 else 0
    layers, per_layer = tuple(sorted(moe_layers)), max(len(moe_layers), 1)
    return WeightGroups(itemsize=itemsize, always_bytes=always_bytes, always_matrix_params=matrices,
                        expert_params=expert // per_layer, expert_bytes=expert_bytes // per_layer, moe_layers=layers,
                        n_experts=config.n_routed_experts or 0, top_k=config.num_experts_per_tok if layers else 0,
                        embedding_row_bytes=0 if tied else config.hidden_size * itemsize, lm_head_params=lm_head,
                        lm_head_bytes=lm_head_bytes, total_params=total, total_bytes=total_bytes,
                        quantization=quantization, quantized_bytes=quantization.quantized_nbytes(
                            {k: v.shape for k, v in state.items()}, itemsize))


def export_bytes(config: MLAConfig, quantization: Quantization = FLOAT, itemsize: int = 4) -> int:
    """About the bytes an export of ``config`` writes with ``quantization`` (a plan, before the export says which
    tensors it quantizes): every matrix but the embedding counted quantized, the rest at ``itemsize``; for the disk
    check before an export (a full-size V2-Lite is 63 GB in fp32, about 10 GB in int4)."""
    state = _meta_state(config)
    keys = [k for k, t in state.items() if t.dim() >= 2 and k != "model.embed_tokens.weight"]
    recorded = quantization.recorded(QuantizedKeys(tuple(keys)), ())  # float: nothing recorded
    return weight_groups(config, itemsize, recorded).total_bytes


def manifest_weight_groups(manifest, scales_half: bool = False) -> WeightGroups:
    """:func:`weight_groups` of an artifact: its precision, and the tensors its manifest records as quantized;
    ``scales_half``: their scales counted at 2 bytes, as a CPU engine that stores them as float16 reads them
    (:attr:`mla_deploy.ort.record.CpuOperators.scales_half`)."""
    quantization = manifest.quantization.with_scale_bytes(2) if scales_half else manifest.quantization
    return weight_groups(manifest.config, precision_itemsize(manifest.precision), quantization)


def precision_itemsize(precision: str) -> int:
    """Bytes per value of an artifact's ``precision`` (``fp32``, ``fp16``, ``bf16``)."""
    return ITEMSIZE[precision]
