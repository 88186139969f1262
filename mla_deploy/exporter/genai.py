"""The onnxruntime-genai target: a folder ``onnxruntime_genai.Model(folder)`` loads and generates from.

``mla-deploy export --hf CHECKPOINT --out DIR --target genai`` writes:

* ``model.onnx`` (+ ``weights.data`` for large models): the absorbed decoder (``[export] decode_form``) as genai's
  decoder-only graph over the :data:`~mla_deploy.cache_layout.GENAI` cache layout (which owns these names and
  shapes), written by the one export pipeline (:func:`~.export.run_export`, with the decode checks every target
  runs):

  ================================ ========================================================================
  ``input_ids``                    int64 ``[batch_size, sequence_length]``
  ``attention_mask``               int64 ``[batch_size, total_sequence_length]``: 1 a real token, 0 (left)
                                   padding; genai grows it by one column per step
  ``past_key_values.{i}.key``      ``[batch_size, 1, max_cache_length, C/2]``: channels ``[0, C/2)`` of the
                                   latent row (``c_kv[:C/2]``)
  ``past_key_values.{i}.value``    ``[batch_size, 1, max_cache_length, C/2]``: channels ``[C/2, C)``
                                   (``c_kv[C/2:] | k_pe``)
  ``logits``                       ``[batch_size, sequence_length, vocab_size]``, every position
  ``present.{i}.key`` / ``.value`` the same buffers, written in place (``past_present_share_buffer``)
  ================================ ========================================================================

  MLA's latent row (``C = kv_lora_rank + qk_rope_head_dim``, 576 for DeepSeek) stays whole; it is only split
  into two halves of ``C/2`` columns because genai gives the value cache the key cache's width. The graph
  writes the step's rows at slot ``total_sequence_length - sequence_length`` (``TensorScatter``, opset 24),
  takes each sequence's visible slots from the mask and its positions as ``cumsum(mask) - 1`` (so a left-padded
  row of a batch sees only its own tokens, at transformers' positions), and scores the absorbed query block by
  block (``q[:C/2] . K + q[C/2:] . V``, then ``P . K | P . V``), never concatenating the cache
  (:class:`~mla_deploy.model.cache.MaskedBlockCache`, :func:`~mla_deploy.model.mla.latent_scores`).
* ``genai_config.json``: the decoder's I/O names, one key/value head of ``C/2``, the context length
  (``max_cache_length``), bos/eos/pad ids, ``past_present_share_buffer: true``, greedy search by default.
* the checkpoint's tokenizer files (as the normal export copies them).

onnxruntime-genai is an optional extra; nothing here imports it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..artifact import copy_tokenizer_files
from ..artifact.manifest import GENAI_CONFIG
from ..artifact.tokenizer_files import TOKENIZER_FILES
from ..cache_layout import GENAI
from ..config import MLAConfig
from ..expert_forms import fused_layout
from ..errors import ExportError
from ..io_spec import BATCH, SEQ
from ..model import MLAForCausalLM
from ..quant import Quantization
from ..recipe import Recipe
from .export import TORCH_DTYPES, Exported, GraphPlan, Log, decode_checks, run_export
from .onnx_export import cached_dynamic_shapes
from .weights import WEIGHTS_FILE, Progress, TensorSource

GRAPH_FILE = "model.onnx"
#: the files a genai export writes (re-exporting replaces these and keeps anything else in the folder)
GENAI_FILES = (GENAI_CONFIG, GRAPH_FILE, WEIGHTS_FILE, *TOKENIZER_FILES)


class GenaiGraph(nn.Module):
    """``(input_ids, attention_mask, past key_0, value_0, key_1, ...) -> (logits, present key_0, value_0, ...)``:
    the decoder over the :data:`~mla_deploy.cache_layout.GENAI` layout.

    Args:
        model: the absorbed decoder (``A_CC`` or ``A_CC_ME``).
    """

    def __init__(self, model: MLAForCausalLM):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, *past):
        """input_ids ``[B, S]``; attention_mask ``[B, total]``; past: per layer the key and value halves
        ``[B, 1, T_max, C/2]``. Returns logits ``[B, S, V]`` and the present halves (the same layout)."""
        cache = GENAI.policy(attention_mask)
        logits, presents = self.model(input_ids, cache.positions(input_ids.shape[1]), GENAI.layer_caches(past), cache)
        return (logits, *GENAI.flat_caches(presents))


def check_genai_target(out: str | Path, overwrite: bool) -> list[str]:
    """Check that ``out`` can take a genai export; return the names there the export keeps.

    Raises:
        ExportError: ``out`` is a file, a non-empty folder without a genai export, or a genai export while
            ``overwrite`` is off.
    """
    out = Path(out)
    if not out.exists():
        return []
    if not out.is_dir():
        raise ExportError(f"{out} exists and is not a directory")
    names = sorted(entry.name for entry in out.iterdir())
    if not names:
        return []
    if GENAI_CONFIG not in names:
        raise ExportError(f"{out} is not empty and holds no onnxruntime-genai export; choose another --out")
    if not overwrite:
        raise ExportError(f"{out} already holds an onnxruntime-genai export; pass --overwrite to replace it")
    return [name for name in names if name not in GENAI_FILES]


def export_genai(recipe: Recipe, out: str | Path, source: TensorSource, checkpoint: str | Path | None,
                 overwrite: bool = False, progress: Progress | None = None, log: Log | None = None) -> dict:
    """Export ``recipe``'s model as an onnxruntime-genai folder and return its ``genai_config.json`` as a dict.

    Args:
        recipe: model and ``[export]`` settings (``precision``, ``max_cache_length`` = genai's context length,
            ``decode_form``, ``opset`` raised to 24 when older, the weights' quantization).
        out: the folder to write (replaced as a whole when it holds a genai export and ``overwrite``; files
            that are not the export's are kept).
        source: the original-form state dict served one tensor at a time (closed when the export ends).
        checkpoint: the checkpoint folder whose tokenizer files and special ids are carried (None: none).
        progress, log: as :func:`~mla_deploy.exporter.export.run_export`'s.
    Raises:
        ExportError: ``out`` cannot take the export, the trace fails, or a check fails (the decode checks of
            every target: no per-head K/V over the cache, no expert computed for every token).
        ConfigError: a model the target cannot hold (odd latent width, sparse attention's second cache).
    """
    try:
        GENAI.check_model(recipe.model)
        GENAI.block_widths(recipe.model.latent_dim)
    except BaseException:
        source.close()
        raise
    return run_export(GenaiTarget(recipe, checkpoint), out, source, overwrite, progress, log)


@dataclass(frozen=True)
class GenaiTarget:
    """The onnxruntime-genai folder: one graph over the :data:`~mla_deploy.cache_layout.GENAI` layout,
    ``genai_config.json`` and the checkpoint's tokenizer files.

    Attributes:
        recipe: the model and ``[export]`` settings.
        checkpoint: the checkpoint folder whose tokenizer files and special ids are carried (None: none).
    """

    recipe: Recipe
    checkpoint: str | Path | None = None
    #: kept in the float type: onnxruntime-genai's sessions are not given the option that folds their
    #: dequantization once (mla_deploy.quant.HEADWISE), so it would run at every step
    per_head_weights = False

    @property
    def config(self) -> MLAConfig:
        return self.recipe.model

    @property
    def quantization(self) -> Quantization:  # genai's sessions run MatMulNBits like ours
        return self.recipe.export.quantization

    @property
    def external_data_threshold(self) -> int:
        return self.recipe.export.external_data_threshold

    def prepare(self, out: Path, overwrite: bool) -> list[str]:
        return check_genai_target(out, overwrite)

    def graphs(self) -> list[GraphPlan]:
        settings, config = self.recipe.export, self.recipe.model
        dtype = TORCH_DTYPES[settings.precision]
        with torch.device("meta"):
            decoder = MLAForCausalLM(config, settings.decode_form).to(dtype)
        # batch 2, 3 new tokens after 5 cached ones: every dynamic axis traced at >= 2
        mask, caches = GENAI.example_state(2, 5, 3, config.latent_dim, config.num_hidden_layers,
                                           settings.max_cache_length, dtype)
        args = tuple(a.to("meta") for a in (torch.zeros(2, 3, dtype=torch.long), mask, *caches))
        inputs, outputs = GENAI.io(config, settings.precision)
        shapes = cached_dynamic_shapes(GENAI, ({0: BATCH, 1: SEQ},), config.num_hidden_layers)
        return [GraphPlan(GRAPH_FILE, f"onnxruntime-genai, form {settings.decode_form}", GenaiGraph(decoder).eval(),
                          args, shapes, inputs, outputs, max(settings.opset, GENAI.min_opset), decode_checks(config),
                          settings.expert_form(config), fused_layout(settings.precision))]

    def finish(self, tmp: Path, exported: Exported) -> dict:
        carried = copy_tokenizer_files(self.checkpoint, tmp) if self.checkpoint else None
        genai = genai_config(self.recipe, _special_ids(tmp) if carried else _config_ids(self.checkpoint))
        (tmp / GENAI_CONFIG).write_text(json.dumps(genai, indent=2) + "\n")
        return genai


def genai_config(recipe: Recipe, special: dict) -> dict:
    """``genai_config.json`` for ``recipe``'s graph (:meth:`GENAI.io <mla_deploy.cache_layout.GenaiLayout.io>`), with ``special``'s bos/eos/pad ids."""
    config, settings = recipe.model, recipe.export
    half = GENAI.block_widths(config.latent_dim)[0]
    decoder = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "filename": GRAPH_FILE,
        "head_size": half,
        "hidden_size": config.hidden_size,
        "inputs": {"input_ids": "input_ids", "attention_mask": GENAI.control,
                   "past_key_names": GENAI.past_key_names, "past_value_names": GENAI.past_value_names},
        "outputs": {"logits": "logits", "present_key_names": GENAI.present_key_names,
                    "present_value_names": GENAI.present_value_names},
        "num_attention_heads": config.num_attention_heads,
        "num_hidden_layers": config.num_hidden_layers,
        "num_key_value_heads": 1,
    }
    model = {"type": "decoder", "context_length": settings.max_cache_length, "vocab_size": config.vocab_size,
             "decoder": decoder, **special}
    search = {"do_sample": False, "num_beams": 1, "num_return_sequences": 1, "max_length": settings.max_cache_length,
              "min_length": 0, "past_present_share_buffer": True, "early_stopping": True, "temperature": 1.0,
              "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0, "length_penalty": 1.0,
              "no_repeat_ngram_size": 0, "diversity_penalty": 0.0}
    return {"model": model, "search": search}


def _config_ids(checkpoint: str | Path | None) -> dict:
    """``bos_token_id``, ``eos_token_id``, ``pad_token_id`` of a checkpoint's config.json (a checkpoint without a
    tokenizer; the EOS stands in for a missing pad id)."""
    try:
        config = json.loads((Path(checkpoint) / "config.json").read_text()) if checkpoint else {}
    except (OSError, ValueError):
        config = {}
    special = {name: config[name] for name in ("bos_token_id", "eos_token_id", "pad_token_id")
               if isinstance(config.get(name), (int, list))}
    if "pad_token_id" not in special and isinstance(special.get("eos_token_id"), int):
        special["pad_token_id"] = special["eos_token_id"]
    return special


def _special_ids(folder: Path) -> dict:
    """``bos_token_id``, ``eos_token_id`` (an id or a list), ``pad_token_id`` of the tokenizer in ``folder``
    (generation_config.json's EOS ids first, as :class:`~mla_deploy.generate.tokenizer.ArtifactTokenizer` reads them);
    genai needs a pad id, so the EOS stands in when the tokenizer has none."""
    from ..generate.tokenizer import ArtifactTokenizer

    tok = ArtifactTokenizer(folder)
    ids = {name: tok.backend.token_to_id(text) for name, text in tok.special_tokens.items()}
    special = {}
    if ids.get("bos_token") is not None:
        special["bos_token_id"] = ids["bos_token"]
    if tok.eos_ids:
        special["eos_token_id"] = tok.eos_ids[0] if len(tok.eos_ids) == 1 else list(tok.eos_ids)
    pad = ids.get("pad_token")
    if pad is None and tok.eos_ids:
        pad = tok.eos_ids[0]
    if pad is not None:
        special["pad_token_id"] = pad
    return special
