"""PyTorch models: MLA in every form, the absorbed rewrite, baselines, and a DeepSeek-style decoder."""

from .absorb import absorb, absorb_state_dict, convert_form, unabsorb_state_dict
from .baselines import FoldedRopelessMLA, LatentCrossAttention, MultiHeadAttention, RopelessMLA, fold_ropeless
from .cache import ConcatCache, StaticCache, tensor_scatter
from .build import build_model, build_stack
from .decoder import AttentionStack, MLAForCausalLM, init_random_, run_layers
from .hf import from_hf_model, is_hf_deepseek
from .mla import ABSORBED_FORMS, FORMS, ORIGINAL_FORMS, AbsorbedMLAttention, MLAttention

__all__ = [
    "ABSORBED_FORMS", "AttentionStack", "FORMS", "ORIGINAL_FORMS", "AbsorbedMLAttention", "ConcatCache", "FoldedRopelessMLA",
    "LatentCrossAttention", "MLAForCausalLM", "MLAttention", "MultiHeadAttention", "RopelessMLA", "StaticCache",
    "absorb", "absorb_state_dict", "build_model", "build_stack", "convert_form", "fold_ropeless", "from_hf_model", "is_hf_deepseek",
    "init_random_", "run_layers", "tensor_scatter", "unabsorb_state_dict",
]
