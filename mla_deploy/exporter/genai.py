"""The onnxruntime-genai target: a folder ``onnxruntime_genai.Model(folder)`` loads and generates from.

``mla-deploy export --hf CHECKPOINT --out DIR --target genai`` writes:

* ``model.onnx`` (+ ``weights.data`` for large models): the absorbed decoder (``[export] decode_form``) as genai's
  decoder-only graph, every genai-specific name decided here:

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
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..artifact import atomic_dir, copy_tokenizer_files
from ..artifact.files import remove_stale
from ..artifact.manifest import GENAI_CONFIG
from ..artifact.tokenizer_files import TOKENIZER_FILES
from ..errors import ConfigError, ExportError
from ..io_spec import BATCH, CAPACITY, PRECISIONS, SEQ, TOTAL, TensorSpec
from ..model import MLAForCausalLM
from ..model.cache import MaskedBlockCache
from ..recipe import Recipe

GRAPH_FILE = "model.onnx"
#: the files a genai export writes (re-exporting replaces these and keeps anything else in the folder)
GENAI_FILES = (GENAI_CONFIG, GRAPH_FILE, "weights.data", *TOKENIZER_FILES)
#: the opset of the in-place cache write (``TensorScatter``)
MIN_OPSET = 24
PAST_KEY, PAST_VALUE = "past_key_values.%d.key", "past_key_values.%d.value"
PRESENT_KEY, PRESENT_VALUE = "present.%d.key", "present.%d.value"

Log = Callable[[str], None]


def block_widths(latent_dim: int) -> tuple[int, int]:
    """The key and value halves of the latent row (genai needs them equal).

    Raises:
        ConfigError: an odd latent width.
    """
    if latent_dim % 2:
        raise ConfigError(f"the genai target splits the latent row in two equal halves; {latent_dim} is odd")
    return latent_dim // 2, latent_dim // 2


def genai_io(config, precision: str) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The genai graph's inputs and outputs, in graph order (see the module docstring)."""
    dtype = PRECISIONS[precision]
    half = block_widths(config.latent_dim)[0]
    cache = (BATCH, 1, CAPACITY, half)
    layers = range(config.num_hidden_layers)
    inputs = [TensorSpec("input_ids", "int64", (BATCH, SEQ)), TensorSpec("attention_mask", "int64", (BATCH, TOTAL))]
    outputs = [TensorSpec("logits", dtype, (BATCH, SEQ, config.vocab_size))]
    for i in layers:
        inputs += [TensorSpec(PAST_KEY % i, dtype, cache), TensorSpec(PAST_VALUE % i, dtype, cache)]
        outputs += [TensorSpec(PRESENT_KEY % i, dtype, cache), TensorSpec(PRESENT_VALUE % i, dtype, cache)]
    return inputs, outputs


class GenaiGraph(nn.Module):
    """``(input_ids, attention_mask, past key_0, value_0, key_1, ...) -> (logits, present key_0, value_0, ...)``.

    Args:
        model: the absorbed decoder (``A_CC`` or ``A_CC_ME``).
    """

    def __init__(self, model: MLAForCausalLM):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, *past):
        """input_ids ``[B, S]``; attention_mask ``[B, total]``; past: per layer the key and value halves
        ``[B, 1, T_max, C/2]``. Returns logits ``[B, S, V]`` and the present halves (the same layout)."""
        cache = MaskedBlockCache(attention_mask)
        caches = [(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)]
        logits, presents = self.model(input_ids, cache.positions(input_ids.shape[1]), caches, cache)
        return (logits, *(half for present in presents for half in present))


def _dynamic_shapes(layers: int) -> tuple:
    from torch.export import Dim

    batch, seq = Dim(BATCH, min=1, max=4096), Dim(SEQ, min=1, max=1 << 20)
    capacity = Dim(CAPACITY, min=2, max=1 << 22)
    return ({0: batch, 1: seq}, {0: batch, 1: Dim.DYNAMIC}, tuple({0: batch, 2: capacity} for _ in range(2 * layers)))


def _example_inputs(config, capacity: int, dtype) -> tuple:
    """Batch 2, 3 new tokens after 5 cached ones (every dynamic axis traced at >= 2), on the meta device."""
    batch, seq, past = 2, 3, 5
    half = block_widths(config.latent_dim)[0]
    caches = [torch.zeros(batch, 1, max(capacity, past + seq + 1), half, dtype=dtype)
              for _ in range(2 * config.num_hidden_layers)]
    args = (torch.zeros(batch, seq, dtype=torch.long), torch.ones(batch, past + seq, dtype=torch.long), *caches)
    return tuple(a.to("meta") for a in args)


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


def export_genai(recipe: Recipe, out: str | Path, source, checkpoint: str | Path | None, overwrite: bool = False,
                 progress=None, log: Log | None = None) -> dict:
    """Export ``recipe``'s model as an onnxruntime-genai folder and return its ``genai_config.json`` as a dict.

    Args:
        recipe: model and ``[export]`` settings (``precision``, ``max_cache_length`` = genai's context length,
            ``decode_form``, ``opset`` raised to 24 when older).
        out: the folder to write (replaced as a whole when it holds a genai export and ``overwrite``; files
            that are not the export's are kept).
        source: the original-form state dict served one tensor at a time (closed when the export ends).
        checkpoint: the checkpoint folder whose tokenizer files and special ids are carried (None: none).
        progress, log: as :func:`~mla_deploy.exporter.export.export_recipe`'s.
    Raises:
        ExportError: ``out`` cannot take the export, the trace fails, or a check fails.
        ConfigError: a model the target cannot hold (odd latent width).
    """
    from .export import TORCH_DTYPES, make_weights, nbytes, trace_meta_graph
    from .onnx_export import bind_initializers, per_head_kv_tensors, save_graph
    from .weights import WEIGHTS_FILE

    out = Path(out)
    log = log or (lambda line: None)
    settings, config = recipe.export, recipe.model
    block_widths(config.latent_dim)
    opset = max(settings.opset, MIN_OPSET)
    try:
        keep = check_genai_target(out, overwrite)
        for path in remove_stale(out):
            log(f"removed {path}, left by an export that was killed")
        dtype = TORCH_DTYPES[settings.precision]
        inputs, outputs = genai_io(config, settings.precision)
        with torch.device("meta"):
            decoder = MLAForCausalLM(config, settings.decode_form).to(dtype)
        log(f"tracing {GRAPH_FILE} (onnxruntime-genai, form {settings.decode_form}) ...")
        start = time.perf_counter()
        model, placeholders, specs = trace_meta_graph(
            GenaiGraph(decoder).eval(), _example_inputs(config, settings.max_cache_length, dtype), inputs, outputs,
            _dynamic_shapes(config.num_hidden_layers), opset, GRAPH_FILE)
        log(f"traced {GRAPH_FILE} in {time.perf_counter() - start:.1f} s")
        settings.quantization.quantize_graphs([(model, placeholders, specs)], log)
        total = sum(nbytes(v) for v in placeholders.values())
        external = total > settings.external_data_threshold
        with atomic_dir(out, keep=keep) as tmp:
            tensors, _ = make_weights(specs, placeholders, source, config, tmp if external else None, total, progress)
            bind_initializers(placeholders, tensors)
            inferred = save_graph(model, tmp / GRAPH_FILE, inputs, outputs)
            offenders = per_head_kv_tensors(inferred, config)
            if offenders:
                raise ExportError(f"the genai graph holds per-head K/V over the cache: {offenders[0]}")
            carried = copy_tokenizer_files(checkpoint, tmp) if checkpoint else None
            genai = genai_config(recipe, _special_ids(tmp) if carried else _config_ids(checkpoint))
            (tmp / GENAI_CONFIG).write_text(json.dumps(genai, indent=2) + "\n")
            if external:
                log(f"weights in {WEIGHTS_FILE}")
    except OSError as exc:
        raise ExportError(f"cannot write {out}: {exc.strerror or exc}") from None
    finally:
        source.close()
    return genai


def genai_config(recipe: Recipe, special: dict) -> dict:
    """``genai_config.json`` for ``recipe``'s graph (:func:`genai_io`), with ``special``'s bos/eos/pad ids."""
    config, settings = recipe.model, recipe.export
    half = block_widths(config.latent_dim)[0]
    decoder = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "filename": GRAPH_FILE,
        "head_size": half,
        "hidden_size": config.hidden_size,
        "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                   "past_key_names": PAST_KEY, "past_value_names": PAST_VALUE},
        "outputs": {"logits": "logits", "present_key_names": PRESENT_KEY, "present_value_names": PRESENT_VALUE},
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
