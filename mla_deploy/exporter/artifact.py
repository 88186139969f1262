"""The artifact target: a recipe's model as an mla-deploy artifact directory (the graph(s), one weights file,
``manifest.json``), written by the one export pipeline (:func:`~.export.run_export`).

When the prefill and decode forms are the same (the default, ``A_CC``), prefill and decode are one graph,
``model.onnx``, so a runtime also holds the weights once; with a ``CC`` prefill there are two graphs over the same
``weights.data``. The cache layout (:mod:`mla_deploy.cache_layout`) decides the graphs' I/O, traced shapes and
capacity. A checkpoint export also copies the checkpoint's tokenizer files into the artifact
(:func:`~mla_deploy.artifact.copy_tokenizer_files`, recorded in the manifest).

Re-exporting into an artifact directory replaces only the artifact's own files (manifest, graphs, weights); anything
else there (``validation/``, ``trt/``, the user's files) is kept.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from ..artifact import GraphEntry, Manifest, WeightsSource, copy_tokenizer_files, now
from ..artifact.target import check_export_target
from ..cache_layout import cache_tensors
from ..config import MLAConfig
from ..expert_forms import fused_layout
from ..model import MLAForCausalLM
from ..quant import Quantization
from ..recipe import Recipe
from .export import TORCH_DTYPES, Exported, GraphPlan, Log, decode_checks, nbytes, run_export, versions
from .graphs import CausalLMGraph, example_decoder_inputs
from .onnx_export import decoder_dynamic_shapes
from .weights import WEIGHTS_FILE, ModuleTensors, Progress, RandomTensors, TensorSource


def fingerprint(recipe: Recipe, weights: WeightsSource) -> str:
    """Identity of the model an artifact holds: its dimensions and where its weights came from (16 hex digits)."""
    identity = {"model": recipe.model.to_dict(), "weights": weights.to_dict(),
                **recipe.export.quantization.fingerprint()}  # a quantized model is another model (float ones: none)
    blob = json.dumps(identity, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def export_recipe(recipe: Recipe, out: str | Path, model: MLAForCausalLM | None = None,
                  weights: WeightsSource | Mapping[str, Any] | None = None, overwrite: bool = False,
                  source: TensorSource | None = None, progress: Progress | None = None,
                  log: Log | None = None) -> Manifest:
    """Export ``recipe``'s model to ``out`` and return its manifest.

    Args:
        recipe: model and ``[export]`` settings.
        out: the artifact directory to create (or replace, when it holds the same model).
        model: an original-form model in memory (fp32) to export; None: ``source``, or the preset's random
            weights from ``[export]``'s seed and init_std (rebuilt from them for validation, not stored twice).
        weights: where the weights came from (recorded in the manifest), e.g. ``WeightsSource(kind="hf",
            path=...)`` or the same as a dict; None: ``in-memory`` for ``model``/``source``.
        overwrite: replace ``out`` even when it holds a different model.
        source: the original-form state dict served one tensor at a time (e.g.
            :class:`~mla_deploy.checkpoint.CheckpointTensors`); closed when the export ends.
        progress: called as ``progress(bytes_written, total_bytes, seconds)`` while the weights are written.
        log: called with one line per step (tracing each graph, saving it, temporaries of a killed export removed).
    Returns:
        the :class:`~mla_deploy.artifact.Manifest` written to ``out/manifest.json``.
    Raises:
        ExportError: ``out`` holds something else or cannot be written (no space, no permission), a weight is
            not finite, or the export or a check fails.
    """
    settings = recipe.export
    if model is not None:
        source = ModuleTensors(model.eval())
    if source is None:
        source = RandomTensors(recipe.model, settings.init_std, settings.seed)
        weights = WeightsSource(kind="random", seed=settings.seed, std=settings.init_std)
    elif not isinstance(weights, WeightsSource):
        weights = WeightsSource.from_dict(weights or {"kind": "in-memory"})
    try:
        target = ArtifactTarget(recipe, weights, fingerprint(recipe, weights))
    except BaseException:
        source.close()
        raise
    return run_export(target, out, source, overwrite, progress, log)


@dataclass(frozen=True)
class ArtifactTarget:
    """The artifact: one graph per distinct (form, attention) of the prefill and decode roles, and the manifest.

    Attributes:
        recipe: the model and ``[export]`` settings.
        weights: where the weights come from (recorded in the manifest).
        fingerprint: the model's identity (:func:`fingerprint`), compared with an artifact already in ``out``.
    """

    recipe: Recipe
    weights: WeightsSource
    fingerprint: str
    per_head_weights = True  # OrtEngine and the CPU engine build fold or read them (mla_deploy.quant.HEADWISE)

    @property
    def config(self) -> MLAConfig:
        return self.recipe.model

    @property
    def quantization(self) -> Quantization:
        return self.recipe.export.quantization

    @property
    def external_data_threshold(self) -> int:
        return self.recipe.export.external_data_threshold

    def roles(self) -> dict[str, tuple[str, str, str]]:
        """``{role: (file, form, attention)}``: one ``model.onnx`` when prefill and decode share a form, else
        ``prefill.onnx`` (standard attention) and ``decode.onnx``."""
        s = self.recipe.export
        if s.prefill_form == s.decode_form:
            return {role: ("model.onnx", s.decode_form, s.decode_attention) for role in ("prefill", "decode")}
        return {"prefill": ("prefill.onnx", s.prefill_form, "standard"),
                "decode": ("decode.onnx", s.decode_form, s.decode_attention)}

    def prepare(self, out: Path, overwrite: bool) -> list[str]:
        return check_export_target(out, self.fingerprint, overwrite)

    def graphs(self) -> list[GraphPlan]:
        roles, plans = self.roles(), {}
        for file, form, attention in roles.values():
            if file not in plans:
                served = [role for role, entry in roles.items() if entry[0] == file]
                plans[file] = self._plan(file, form, attention, " + ".join(served), "decode" in served)
        return list(plans.values())

    def _plan(self, file: str, form: str, attention: str, roles: str, decodes: bool) -> GraphPlan:
        settings, config, layout = self.recipe.export, self.recipe.model, self.recipe.export.layout
        dtype = TORCH_DTYPES[settings.precision]
        with torch.device("meta"):
            model = MLAForCausalLM(config, form).to(dtype)
        if attention == "plugin":
            from .decode_plugin import use_decode_plugin

            use_decode_plugin(model)
        args = tuple(a.to("meta") for a in example_decoder_inputs(model, layout, settings.max_cache_length, dtype))
        inputs, outputs = layout.io(config, settings.precision)
        return GraphPlan(file, f"{roles}, form {form}", CausalLMGraph(model, layout).eval(), args,
                         decoder_dynamic_shapes(layout, len(cache_tensors(config))), inputs, outputs, settings.opset,
                         decode_checks(config) if decodes else (), settings.expert_form(config),
                         fused_layout(settings.precision))

    def finish(self, tmp: Path, exported: Exported) -> Manifest:
        recipe, settings, layout = self.recipe, self.recipe.export, self.recipe.export.layout
        inputs, outputs = layout.io(recipe.model, settings.precision)
        graphs, experts = {}, settings.expert_form(recipe.model)
        for role, (file, form, attention) in self.roles().items():
            saved = exported.graphs[file]
            graphs[role] = GraphEntry(role=role, file=file, form=form, inputs=tuple(inputs), outputs=tuple(outputs),
                                      attention=attention, experts=experts, bytes=saved.bytes, sha256=saved.sha256,
                                      external_data=WEIGHTS_FILE if exported.weights_data is not None else None)
        weights = self.weights
        manifest = Manifest(
            name=recipe.name, fingerprint=self.fingerprint, model=recipe.model, weights=weights,
            precision=settings.precision, opset=settings.opset, cache=layout.describe(recipe.model),
            max_cache_length=layout.manifest_capacity(settings.max_cache_length), graphs=graphs,
            recipe=recipe.to_dict(), versions=versions(), created=now(), weights_data=exported.weights_data,
            tokenizer=copy_tokenizer_files(weights.path, tmp) if weights.kind == "hf" and weights.path else None,
            quantization=self.quantization.recorded(exported.quantized, ((s.quant, nbytes(exported.values[n]))
                                                                         for n, s in exported.specs.items())))
        manifest.save(tmp)
        return manifest

