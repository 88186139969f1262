"""ONNX export: graphs with the latent cache as explicit inputs and outputs.

Public: :func:`export_recipe` (a recipe to an artifact), :func:`fingerprint`, :func:`versions`; the one export
pipeline every target goes through (:func:`run_export`, :class:`GraphPlan`, :func:`decode_checks`; the targets
:class:`~.artifact.ArtifactTarget`, :class:`~.genai.GenaiTarget`, :class:`~.blocks.BlockTarget`); and the tracing
pieces any graph that steps the latent cache can reuse: :class:`DecoderGraph` (wraps a module called as
``(x, position_ids, past, cache_policy)`` so it takes ``(x, position_ids, control, *caches)``),
:func:`cached_dynamic_shapes` (its ``torch.export`` dynamic shapes for a cache layout) and :func:`trace_to_onnx`;
graph scans :func:`per_head_kv_tensors` and :func:`dense_expert_products` (a dense MoE: an expert weight computed
with every token).
"""

from .artifact import ArtifactTarget, export_recipe, fingerprint
from .export import GraphPlan, decode_checks, run_export, versions
from .graphs import DecoderGraph
from .moe_onnx import dense_expert_products
from .onnx_export import cached_dynamic_shapes, check_onnx_file, per_head_kv_tensors, trace_to_onnx

__all__ = ["export_recipe", "fingerprint", "versions", "ArtifactTarget", "GraphPlan", "decode_checks", "run_export",
           "DecoderGraph", "cached_dynamic_shapes", "check_onnx_file", "per_head_kv_tensors", "dense_expert_products",
           "trace_to_onnx"]
