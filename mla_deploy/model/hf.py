"""Interop with transformers' own DeepSeek models (transformers itself is never imported here).

* :func:`is_hf_deepseek`: is this object a transformers ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM``?
* :func:`from_hf_model`: an :class:`~mla_deploy.model.decoder.MLAForCausalLM` sharing such a model's tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import HF_MODEL_TYPES, read_hf_config
from ..errors import CheckpointError, name_list
from .decoder import MLAForCausalLM
from .dsa import interleave_index_rows
from .longcat import fold_latent_scales
from .rope import interleave_rope_rows

HF_DEEPSEEK_CLASSES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


def is_hf_deepseek(model: object) -> bool:
    """True for a transformers ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM`` (transformers not imported):
    by class name, or a ``PreTrainedModel`` with an ``lm_head`` whose ``config.model_type`` is deepseek_v2/v3."""
    if type(model).__name__ in HF_DEEPSEEK_CLASSES:
        return True
    bases = {cls.__name__ for cls in type(model).__mro__}
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return "PreTrainedModel" in bases and hasattr(model, "lm_head") and model_type in HF_MODEL_TYPES


def from_hf_model(hf_model: nn.Module) -> MLAForCausalLM:
    """An :class:`MLAForCausalLM` sharing the tensors of a transformers ``DeepseekV{2,3}ForCausalLM``.

    The result is in the original ``CC`` form and every parameter is the HF model's own tensor (same storage);
    :func:`~mla_deploy.model.absorb.absorb` rewrites it (splitting ``kv_b_proj.weight`` into new ``w_uk``/``w_uv``).

    Raises:
        CheckpointError: the HF model's tensors do not match its own config.
    """
    name = getattr(hf_model.config, "_name_or_path", "") or type(hf_model).__name__
    config, layout = read_hf_config(hf_model.config.to_dict(), name=name)
    if layout.text_prefix:
        raise CheckpointError(f"{type(hf_model).__name__} is a multimodal wrapper: save it and load the folder "
                              "(mla-deploy reads its text model from the checkpoint)")
    with torch.device("meta"):
        model = MLAForCausalLM(config, "CC")
    state = hf_model.state_dict()
    if config.zero_expert_num:  # transformers sizes gate_up_proj for the zero experts too; they never use it
        state = {k: v[: config.n_routed_experts] if k.endswith("mlp.experts.gate_up_proj") else v
                 for k, v in state.items()}
    expected = set(model.state_dict())
    if set(state) != expected:
        extra, missing = sorted(set(state) - expected), sorted(expected - set(state))
        raise CheckpointError(f"{type(hf_model).__name__} does not match its config: "
                              f"unexpected {name_list(extra)}; missing {name_list(missing)}")
    for key, value in model.state_dict().items():
        if tuple(state[key].shape) != tuple(value.shape):
            raise CheckpointError(f"{key}: shape {tuple(state[key].shape)} in the model, expected {tuple(value.shape)}")
    if not layout.rope_interleave:  # half-rotated rope rows: new, permuted tensors instead of shared ones
        state = {key: interleave_rope_rows(key, value, config) for key, value in state.items()}
    if not layout.index_rope_interleave:  # DeepSeek-V3.2's half-rotated indexer rope, likewise
        state = {key: interleave_index_rows(key, value, config) for key, value in state.items()}
    if config.model_type == "longcat_flash":  # the latent scales: new, scaled tensors
        state = {key: fold_latent_scales(key, value, config) for key, value in state.items()}
    model.assign_weights(state)
    return model.train(hf_model.training)
