"""ONNX export: graphs with the latent cache as explicit inputs and outputs."""

from .artifact import MANIFEST, export_recipe, fingerprint
from .onnx_export import check_onnx_file, per_head_kv_tensors, trace_to_onnx

__all__ = ["MANIFEST", "export_recipe", "fingerprint", "check_onnx_file", "per_head_kv_tensors", "trace_to_onnx"]
