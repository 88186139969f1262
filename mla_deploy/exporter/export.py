"""Export a recipe to an artifact directory: ``prefill.onnx``, ``decode.onnx``, weights, ``manifest.json``.

The directory is built with :func:`~mla_deploy.artifact.atomic_dir` (under a temporary name beside the target,
swapped into place at the end), so a failed export never leaves a half-written artifact. The manifest is a
:class:`~mla_deploy.artifact.Manifest`; the cache layout (:mod:`mla_deploy.cache_layout`) decides the graphs'
I/O, the traced shapes and the capacity it records.
"""

from __future__ import annotations

import copy
import hashlib
import json
import platform
from pathlib import Path
from typing import Any, Mapping

import torch

from .. import __version__
from ..artifact import (MANIFEST, REFERENCE_WEIGHTS, GraphEntry, Manifest, WeightsSource, atomic_dir, now,
                        read_fingerprint, sha256_file)
from ..errors import ExportError
from ..model import MLAForCausalLM, build_model, convert_form
from ..recipe import Recipe
from .graphs import DecoderGraph, example_decoder_inputs
from .onnx_export import check_onnx_file, decoder_dynamic_shapes, per_head_kv_tensors, trace_to_onnx

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def fingerprint(recipe: Recipe, weights: WeightsSource) -> str:
    """Identity of the model an artifact holds: its dimensions and where its weights came from (16 hex digits)."""
    blob = json.dumps({"model": recipe.model.to_dict(), "weights": weights.to_dict()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def versions() -> dict[str, str]:
    """Versions of what produced an artifact."""
    import onnx

    out = {"mla_deploy": __version__, "torch": torch.__version__, "onnx": onnx.__version__,
           "python": platform.python_version()}
    try:
        import onnxscript

        out["onnxscript"] = onnxscript.__version__
    except ImportError:  # pragma: no cover - a dependency
        pass
    return out


def export_recipe(recipe: Recipe, out: str | Path, model: MLAForCausalLM | None = None,
                  weights: WeightsSource | Mapping[str, Any] | None = None, overwrite: bool = False) -> Manifest:
    """Export ``recipe``'s model to ``out`` and return its manifest.

    Args:
        recipe: model and ``[export]`` settings.
        out: the artifact directory to create (or replace, when it holds the same model).
        model: the original-form model (fp32); None builds one with random weights from ``[export]``'s
            seed and init_std (saved as the artifact's reference weights).
        weights: how ``model``'s weights were obtained (recorded in the manifest), e.g.
            ``WeightsSource(kind="hf", path=...)`` or the same as a dict; None: ``in-memory``.
        overwrite: replace ``out`` even when it holds a different model.
    Returns:
        the :class:`~mla_deploy.artifact.Manifest` written to ``out/manifest.json``.
    Raises:
        ExportError: ``out`` holds something else, or the export or a check fails.
    """
    out = Path(out)
    settings = recipe.export
    if model is None:
        model = build_model(recipe.model, "CC", std=settings.init_std, seed=settings.seed)
        weights = WeightsSource(kind="random", seed=settings.seed, std=settings.init_std, file=REFERENCE_WEIGHTS)
    elif not isinstance(weights, WeightsSource):
        weights = WeightsSource.from_dict(weights or {"kind": "in-memory"})
    fp = fingerprint(recipe, weights)
    _check_target(out, fp, overwrite)
    with atomic_dir(out) as tmp:
        manifest = _write_artifact(recipe, model.eval(), weights, fp, tmp)
    return manifest


def _check_target(out: Path, fp: str, overwrite: bool) -> None:
    if not out.exists():
        return
    if not out.is_dir():
        raise ExportError(f"{out} exists and is not a directory")
    if not (out / MANIFEST).is_file():
        if any(out.iterdir()):
            raise ExportError(f"{out} is not empty and holds no mla-deploy artifact; choose another --out")
        return
    old = read_fingerprint(out)
    if old != fp and not overwrite:
        raise ExportError(f"{out} already holds a different model (fingerprint {old}, this one {fp}); "
                          f"choose another --out or pass --overwrite")


def _export_graph(recipe: Recipe, model: MLAForCausalLM, role: str, form: str, path: Path,
                  external: bool) -> GraphEntry:
    """Trace ``role``'s graph (``model`` converted to ``form``) to ``path`` and check it."""
    settings, config, layout = recipe.export, recipe.model, recipe.export.layout
    dtype = TORCH_DTYPES[settings.precision]
    inputs, outputs = layout.io(config, settings.precision)
    graph_model = convert_form(copy.deepcopy(model), form).to(dtype)
    attention = settings.decode_attention if role == "decode" else "standard"
    if attention == "plugin":
        from .decode_plugin import use_decode_plugin

        use_decode_plugin(graph_model)
    wrapper = DecoderGraph(graph_model, layout).eval()
    args = example_decoder_inputs(graph_model, layout, settings.max_cache_length, dtype)
    with torch.no_grad():
        trace_to_onnx(wrapper, args, path, inputs, outputs, decoder_dynamic_shapes(layout, config.num_hidden_layers),
                      settings.opset, external)
    inferred = check_onnx_file(path)
    if role == "decode":
        offenders = per_head_kv_tensors(inferred, config)
        if offenders:
            raise ExportError(f"decode graph holds per-head K/V over the cache: {offenders[0]}")
    return GraphEntry(role=role, file=path.name, form=form, inputs=tuple(inputs), outputs=tuple(outputs),
                      attention=attention, external_data=path.name + ".data" if external else None,
                      bytes=path.stat().st_size, sha256=sha256_file(path))


def _write_artifact(recipe: Recipe, model: MLAForCausalLM, weights: WeightsSource, fp: str, tmp: Path) -> Manifest:
    settings, config = recipe.export, recipe.model
    weight_bytes = sum(p.numel() for p in model.parameters()) * TORCH_DTYPES[settings.precision].itemsize
    external = weight_bytes > settings.external_data_threshold
    graphs = {role: _export_graph(recipe, model, role, form, tmp / f"{role}.onnx", external)
              for role, form in (("prefill", settings.prefill_form), ("decode", settings.decode_form))}
    if weights.kind == "random":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp / REFERENCE_WEIGHTS))
    layout = settings.layout
    manifest = Manifest(
        name=recipe.name, fingerprint=fp, model=config, weights=weights, precision=settings.precision,
        opset=settings.opset, cache=layout.describe(config),
        max_cache_length=layout.manifest_capacity(settings.max_cache_length), graphs=graphs,
        recipe=recipe.to_dict(), versions=versions(), created=now())
    manifest.save(tmp)
    return manifest
