"""ONNX export: graphs with the latent cache as explicit inputs and outputs.

Public: :func:`export_recipe` (a recipe to an artifact), :func:`fingerprint`, :func:`versions`, and the tracing
pieces any graph that steps the latent cache can reuse: :class:`DecoderGraph` (wraps a module called as
``(x, position_ids, past, cache_policy)`` so it takes ``(x, position_ids, control, *caches)``),
:func:`cached_dynamic_shapes` (its ``torch.export`` dynamic shapes for a cache layout) and :func:`trace_to_onnx`;
graph scans :func:`per_head_kv_tensors` and :func:`all_expert_tensors` (a dense MoE).
"""

from .export import export_recipe, fingerprint, versions
from .graphs import DecoderGraph
from .moe_onnx import all_expert_tensors
from .onnx_export import cached_dynamic_shapes, check_onnx_file, per_head_kv_tensors, trace_to_onnx

__all__ = ["export_recipe", "fingerprint", "versions", "DecoderGraph", "cached_dynamic_shapes", "check_onnx_file",
           "per_head_kv_tensors", "all_expert_tensors", "trace_to_onnx"]
