"""Export a recipe to an artifact directory: ``prefill.onnx``, ``decode.onnx``, weights, ``manifest.json``.

The directory is written under a temporary name beside the target and renamed into place at the end,
so a failed export never leaves a half-written artifact.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import os
import platform
import shutil
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..artifact_check import sha256_file
from ..errors import ExportError
from ..io_spec import PRECISIONS, cache_layout, decoder_io
from ..model.absorb import convert_form
from ..model.build import build_model
from ..model.decoder import MLAForCausalLM
from ..recipe import Recipe
from .graphs import DecoderGraph, example_decoder_inputs
from .onnx_export import check_onnx_file, decoder_dynamic_shapes, per_head_kv_tensors, trace_to_onnx

MANIFEST = "manifest.json"
FORMAT = "mla-deploy-artifact"
FORMAT_VERSION = 1
REFERENCE_WEIGHTS = "reference.safetensors"
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def fingerprint(recipe: Recipe, weights: dict[str, Any]) -> str:
    """Identity of the model an artifact holds: its dimensions and where its weights came from."""
    blob = json.dumps({"model": recipe.model.to_dict(), "weights": weights}, sort_keys=True)
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
                  weights: dict[str, Any] | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Export ``recipe``'s model to ``out`` and return the manifest.

    Args:
        recipe: model and ``[export]`` settings.
        out: the artifact directory to create (or replace, when it holds the same model).
        model: the original-form model (fp32); None builds one with random weights from ``[export]``'s
            seed and init_std.
        weights: how ``model``'s weights were obtained (recorded in the manifest), e.g.
            ``{"kind": "hf", "path": ...}``; None for the random weights built here.
        overwrite: replace ``out`` even when it holds a different model.
    Raises:
        ExportError: ``out`` holds something else, or the export or a check fails.
    """
    out = Path(out)
    settings = recipe.export
    if model is None:
        model = build_model(recipe.model, "CC", std=settings.init_std, seed=settings.seed)
        weights = {"kind": "random", "seed": settings.seed, "std": settings.init_std, "file": REFERENCE_WEIGHTS}
    weights = dict(weights or {"kind": "in-memory"})
    fp = fingerprint(recipe, weights)
    _check_target(out, fp, overwrite)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        manifest = _write_artifact(recipe, model.eval(), weights, fp, tmp)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _check_target(out: Path, fp: str, overwrite: bool) -> None:
    if not out.exists():
        return
    if not out.is_dir():
        raise ExportError(f"{out} exists and is not a directory")
    manifest = out / MANIFEST
    if not manifest.is_file():
        if any(out.iterdir()):
            raise ExportError(f"{out} is not empty and holds no mla-deploy artifact; choose another --out")
        return
    try:
        old = json.loads(manifest.read_text()).get("fingerprint")
    except (OSError, json.JSONDecodeError):
        old = None
    if old != fp and not overwrite:
        raise ExportError(f"{out} already holds a different model (fingerprint {old}, this one {fp}); "
                          f"choose another --out or pass --overwrite")


def _replace_dir(tmp: Path, out: Path) -> None:
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_artifact(recipe: Recipe, model: MLAForCausalLM, weights: dict, fp: str, tmp: Path) -> dict:
    settings = recipe.export
    config = recipe.model
    dtype = TORCH_DTYPES[settings.precision]
    inputs, outputs = decoder_io(config, settings.cache_mode, settings.precision)
    weight_bytes = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    external = weight_bytes > settings.external_data_threshold
    graphs = {}
    for role, form in (("prefill", settings.prefill_form), ("decode", settings.decode_form)):
        graph_model = convert_form(copy.deepcopy(model), form).to(dtype)
        attention = settings.decode_attention if role == "decode" else "standard"
        if attention == "plugin":
            from .decode_plugin import use_decode_plugin

            use_decode_plugin(graph_model)
        wrapper = DecoderGraph(graph_model, settings.cache_mode).eval()
        args = example_decoder_inputs(graph_model, settings.cache_mode, settings.max_cache_length, dtype)
        path = tmp / f"{role}.onnx"
        with torch.no_grad():
            trace_to_onnx(wrapper, args, path, inputs, outputs,
                          decoder_dynamic_shapes(settings.cache_mode, config.num_hidden_layers),
                          settings.opset, external)
        inferred = check_onnx_file(path)
        if role == "decode":
            offenders = per_head_kv_tensors(inferred, config)
            if offenders:
                raise ExportError(f"decode graph holds per-head K/V over the cache: {offenders[0]}")
        graphs[role] = {
            "file": path.name, "form": form, "attention": attention, "inputs": [t.to_dict() for t in inputs],
            "outputs": [t.to_dict() for t in outputs], "external_data": path.name + ".data" if external else None,
            "bytes": path.stat().st_size, "sha256": sha256_file(path),
        }
        del graph_model, wrapper
    if weights.get("kind") == "random":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp / REFERENCE_WEIGHTS))
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "name": recipe.name, "fingerprint": fp,
        "model": config.to_dict(), "weights": weights, "precision": settings.precision,
        "dtype": PRECISIONS[settings.precision], "opset": settings.opset, "cache": cache_layout(config, settings.cache_mode),
        "max_cache_length": settings.max_cache_length if settings.cache_mode == "static" else None,
        "graphs": graphs, "recipe": recipe.to_dict(), "versions": versions(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
