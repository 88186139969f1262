"""Import Hugging Face DeepSeek-V2/V3 checkpoints (safetensors only) into :class:`MLAForCausalLM`.

:func:`load_checkpoint` reads ``config.json`` (:func:`~mla_deploy.config.from_hf_config`) and the
``*.safetensors`` shards named by ``model.safetensors.index.json`` (or a lone ``model.safetensors``),
builds the model on the meta device and fills it one tensor at a time from the memory-mapped files,
so the peak memory is about the model's size, not twice it. Pickled checkpoints (``.bin``, ``.pt``)
are refused: loading them can run arbitrary code.

Every tensor of the checkpoint is accounted for. On-disk names equal our state-dict keys, except:

* routed experts, stored one per expert (``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``),
  are stacked into the fused ``experts.gate_up_proj [E, 2I, D]`` and ``experts.down_proj [E, D, I]``
  (table :data:`EXPERT_MAP`);
* DeepSeek-V3's multi-token-prediction layers ``model.layers.{L}..{L+n-1}.*`` (``L`` = num_hidden_layers,
  ``n`` = num_nextn_predict_layers, or the type's own count: GLM-4.7-Flash writes one without the key) and the
  tensors of :data:`IGNORED` are skipped and listed in the :class:`LoadReport`;
* a multimodal wrapper's text model (Kimi K2.5: ``language_model.model.layers.*``, ``language_model.lm_head``) is
  read without its prefix, its vision tower and projector skipped;
* A.X-K1's ``model.layers.{i}.post_mlp_layernorm`` is the MoE block's ``mlp.post_mlp_layernorm`` (skipped for a
  dense layer, which does not use it);
* with ``rope_interleave: false`` the rope rows of the query projection and ``kv_a_proj_with_mqa`` are permuted
  into DeepSeek's interleaved pairs (:func:`~mla_deploy.model.rope.interleave_rope_rows`);
* float8 weights with a ``<name>_scale_inv`` block scale (DeepSeek-V3's own release) are dequantised;
* LongCat-Flash: its multi-token-prediction tensors ``model.mtp.*`` and the gate/up projections transformers
  writes for its zero (identity) experts (which never run them) are skipped; its latent scales are folded into
  ``q_b_proj`` and ``kv_a_layernorm`` (:func:`~mla_deploy.model.longcat.fold_latent_scales`).

A tensor the model does not use, a missing tensor or a wrong shape is a :class:`CheckpointError`.
:func:`from_hf_model` wraps an in-memory transformers model instead, sharing its tensors.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .artifact.files import require_regular_file
from .config import HFLayout, MLAConfig, read_hf_config
from .errors import CheckpointError, ConfigError, name_list
from .model.hf import from_hf_model  # noqa: F401  (re-exported: the in-memory counterpart of load_checkpoint)
from .model.dsa import interleave_index_rows
from .model.longcat import fold_latent_scales
from .model.rope import interleave_rope_rows

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
SCALE_SUFFIX = "_scale_inv"
# On-disk per-expert projection -> (our fused parameter under ``mlp.experts``, row block in it).
# gate_up_proj[e] is [2I, D]: the gate rows are block 0, the up rows block 1; down_proj[e] is [D, I].
EXPERT_MAP: dict[str, tuple[str, int | None]] = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
}
_EXPERT_NAME = re.compile(r"(?P<prefix>model\.layers\.\d+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\.weight")
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")
_POST_MLP_NORM = re.compile(r"(model\.layers\.\d+)\.post_mlp_layernorm\.weight")
# Tensors a checkpoint may carry that the model recomputes: pattern -> why they are skipped.
IGNORED: dict[re.Pattern, str] = {re.compile(r".*rotary_emb\.(original_)?inv_freq"): "rope frequencies (recomputed)"}
# Kept in float32 whatever the dtype, as transformers does (the V3 routing bias).
KEEP_FP32 = ("e_score_correction_bias",)
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_FP8 = ("F8_E4M3", "F8_E5M2")
_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
_REOPEN_BYTES = 64 << 20  # re-map a file after reading this much from it, releasing the pages already copied out


@dataclass
class LoadReport:
    """What :func:`load_checkpoint` read and what it skipped.

    Attributes:
        path: the checkpoint folder.
        files: the safetensors files read.
        dtype: the dtype of the loaded weights.
        used: number of on-disk tensors loaded (block scales not counted).
        dequantized: how many of them were float8 and dequantised.
        skipped: reason -> on-disk names that were deliberately not loaded (MTP layers, rope buffers, tied lm_head).
        bytes_on_disk: total size of the files.
    """

    path: str
    files: list[str]
    dtype: torch.dtype
    used: int = 0
    dequantized: int = 0
    skipped: dict[str, list[str]] = field(default_factory=dict)
    bytes_on_disk: int = 0

    def summary(self) -> str:
        """One line, e.g. ``loaded 53 tensors (bfloat16) from 1 file(s), 0.5 MB; skipped: 12 MTP layer tensors``."""
        skipped = "; ".join(f"{len(v)} {k}" for k, v in self.skipped.items()) or "none"
        fp8 = f", {self.dequantized} dequantised from fp8" if self.dequantized else ""
        return (f"loaded {self.used} tensors ({str(self.dtype).removeprefix('torch.')}{fp8}) from "
                f"{len(self.files)} file(s), {self.bytes_on_disk / 1e6:.1f} MB; skipped: {skipped}")


@dataclass(frozen=True)
class _Source:
    """One tensor on disk."""

    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors spelling: "BF16", "F8_E4M3", ...


@dataclass(frozen=True)
class _Slot:
    """Where an on-disk tensor goes: ``target[expert]`` rows of ``block`` (or the whole ``target``)."""

    target: str
    expert: int | None = None
    block: int | None = None


def load_checkpoint(path: str | Path, form: str = "CC", dtype: torch.dtype | str | None = None):
    """Load a Hugging Face DeepSeek-V2/V3 checkpoint folder into an :class:`MLAForCausalLM` in ``form``.

    Args:
        path: the folder with ``config.json`` and the safetensors file(s) (or one of those files).
        form: the attention form (``CD``, ``CC``, ``A_CC``, ``A_CC_ME``); absorbed forms split ``kv_b_proj``.
        dtype: weight dtype (a torch dtype or ``"bf16"``, ``"fp16"``, ``"fp32"``); None keeps the
            checkpoint's dtype, or bfloat16 for a float8 checkpoint. ``e_score_correction_bias`` stays float32.
    Returns:
        the model in eval mode on the CPU, with ``model.load_report`` (a :class:`LoadReport`).
    Raises:
        CheckpointError: no safetensors file, pickles only, a tensor unknown, missing or of the wrong shape.
        ConfigError: an unreadable or unsupported ``config.json``, a bad ``form`` or ``dtype``.
    """
    from .model import MLAForCausalLM, convert_form
    from .model.mla import FORMS

    if form not in FORMS:
        raise ConfigError(f"unknown attention form {form!r}; choose one of {', '.join(FORMS)}")
    tensors = CheckpointTensors(path, dtype)
    with torch.device("meta"):
        model = MLAForCausalLM(tensors.config, "CC")
    try:
        state = {key: tensors.get(key) for key in tensors.keys()}
    finally:
        tensors.close()
    if tensors.config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.assign_weights(state)
    model = convert_form(model, form).eval()
    model.load_report = tensors.report
    log.info("%s: %s", tensors.folder, tensors.report.summary())
    return model


class CheckpointTensors:
    """A checkpoint read one tensor at a time, in our state-dict layout (the original ``CC`` form).

    Every on-disk tensor is planned and checked when this is made (names, shapes, coverage; headers only);
    :meth:`get` then reads one of our tensors: a stacked ``mlp.experts.*`` tensor is assembled from its
    per-expert pieces, float8 weights are block-dequantised. Memory stays at the tensor being read.

    Args:
        path: the checkpoint folder (or one of its files).
        dtype: as :func:`load_checkpoint`'s.
    Attributes:
        config, folder, files, dtype, report (a :class:`LoadReport`, filled as tensors are read), and
        ``shapes``: ``{key: shape}`` of every tensor :meth:`get` serves (a tied ``lm_head.weight`` excluded).
    Raises:
        CheckpointError, ConfigError: as :func:`load_checkpoint`.
    """

    def __init__(self, path: str | Path, dtype: torch.dtype | str | None = None):
        from .model import MLAForCausalLM

        self.folder, self.files = checkpoint_files(path)
        self.config, self.layout = read_hf_config(self.folder)
        sources = _read_headers(self.files)
        with torch.device("meta"):
            model = MLAForCausalLM(self.config, "CC")
        self.shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        if self.config.tie_word_embeddings:
            del self.shapes["lm_head.weight"]  # the same parameter as model.embed_tokens.weight
        plan, self._scales, skipped = _plan(sources, self.shapes, self.config, self.layout)
        self._pieces: dict[str, list[tuple[_Source, _Slot]]] = {}
        for src, slot in plan:
            self._pieces.setdefault(slot.target, []).append((src, slot))
        self._block = self.layout.weight_block_size
        self.dtype = _resolve_dtype(dtype, sources)
        self.report = LoadReport(str(self.folder), [f.name for f in self.files], self.dtype, skipped=skipped,
                                 bytes_on_disk=sum(f.stat().st_size for f in self.files))
        self._reader = _Reader()

    def keys(self) -> list[str]:
        """Our state-dict keys, in the model's order."""
        return list(self.shapes)

    def get(self, key: str) -> torch.Tensor:
        """Read our tensor ``key`` (a new CPU tensor of :attr:`dtype`; the V3 routing bias in float32)."""
        dtype = torch.promote_types(self.dtype, torch.float32) if key.endswith(KEEP_FP32) else self.dtype
        if key not in self._pieces:  # absent and zero (_check_coverage's zero_if_missing)
            return torch.zeros(self.shapes[key], dtype=dtype)
        out = torch.empty(self.shapes[key], dtype=dtype)
        for src, slot in self._pieces[key]:
            self._copy(src, slot, out if slot.expert is None else out[slot.expert])
        if not self.layout.rope_interleave:
            out = interleave_rope_rows(key, out, self.config)
        if not self.layout.index_rope_interleave:
            out = interleave_index_rows(key, out, self.config)
        return fold_latent_scales(key, out, self.config)

    def expert(self, key: str, index: int) -> torch.Tensor:
        """``get(key)[index]`` of a stacked ``mlp.experts.*`` tensor, reading only that expert's pieces (a new
        tensor ``[...]`` of :attr:`dtype`): a V3 layer's ``gate_up_proj`` is 15 GB in bf16, one expert 59 MB."""
        out = torch.empty(self.shapes[key][1:], dtype=self.dtype)
        whole = [src for src, slot in self._pieces[key] if slot.expert is None]
        if whole:  # stored stacked, as transformers writes Mistral 4's experts: read that expert's slice alone
            out.copy_(self._reader.get(whole[0], index))
            self.report.used += index == 0  # one on-disk tensor, read expert by expert
            return out
        pieces = [(src, slot) for src, slot in self._pieces[key] if slot.expert == index]
        if not pieces:
            raise CheckpointError(f"{key} has no expert {index} in {self.folder}")
        for src, slot in pieces:
            self._copy(src, slot, out)
        return out

    def _copy(self, src: "_Source", slot: _Slot, dest: torch.Tensor) -> None:
        """Read the on-disk tensor ``src`` into ``dest`` (the whole target, or its expert ``slot.expert``; the
        half ``slot.block`` of its rows if set), float8 block-dequantized."""
        tensor = self._reader.get(src)
        if src.dtype in _FP8:
            tensor = dequantize_fp8(tensor, self._reader.get(self._scales[src.name]), self._block, torch.float32)
            self.report.dequantized += 1
        if slot.block is not None:
            dest = dest.chunk(2, dim=0)[slot.block]
        dest.copy_(tensor)
        self.report.used += 1

    def close(self) -> None:
        """Release the memory maps."""
        self._reader.close()

    def weights_source(self):
        """What an export from this checkpoint records as its weights: an ``hf``
        :class:`~mla_deploy.artifact.WeightsSource` with the folder and :meth:`identity`."""
        from .artifact import WeightsSource

        return WeightsSource(kind="hf", path=str(self.folder.resolve()), files=tuple(self.identity()))

    def identity(self) -> list[dict[str, Any]]:
        """What identifies the files read: ``[{"file", "bytes", "sampled_sha256"}]`` (see :func:`sampled_sha256`;
        hashing every byte of tens of GB would take minutes)."""
        return [{"file": f.name, "bytes": f.stat().st_size, "sampled_sha256": sampled_sha256(f)} for f in self.files]


#: how :func:`sampled_sha256` samples a file
SAMPLE_BLOCKS, SAMPLE_BYTES = 64, 1 << 16


def sampled_sha256(path: Path) -> str:
    """sha256 of a safetensors file's header (every tensor's name, dtype, shape and offsets) and of
    :data:`SAMPLE_BLOCKS` evenly spaced :data:`SAMPLE_BYTES`-byte blocks of its data: a change of layout, size or
    of any sampled value shows, at the cost of reading 4 MiB."""
    import hashlib

    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256()
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is not a safetensors file (shorter than its header)")
        length = int.from_bytes(head, "little")
        if length > min(size - 8, 100 << 20):
            raise CheckpointError(f"{path} is not a safetensors file (header of {length} bytes)")
        digest.update(head + f.read(length))
        start = 8 + length
        span = max(size - start - SAMPLE_BYTES, 0)
        for i in range(SAMPLE_BLOCKS):
            f.seek(start + span * i // max(SAMPLE_BLOCKS - 1, 1))
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def checkpoint_files(path: str | Path) -> tuple[Path, list[Path]]:
    """The checkpoint folder and the safetensors files to read (the index's shards, or every ``*.safetensors``)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    folder = path if path.is_dir() else path.parent
    index = folder / INDEX_FILE
    for entry in (index, *folder.glob("*.safetensors")):  # before any open: a FIFO or a device would never end
        require_regular_file(entry, CheckpointError)
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a readable safetensors index ({exc})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names, got "
                                  f"{json.dumps(weight_map)[:80]}")
        files = [require_regular_file(folder / name, CheckpointError) for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{index} names shard(s) that are not there: {name_list(absent)}")
        return folder, files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(f.name for f in folder.iterdir() if f.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(f"{folder} holds only pickled weights ({name_list(pickles)}); mla-deploy reads "
                                  "safetensors only (unpickling can run code): convert them to safetensors first")
        raise CheckpointError(f"no *.safetensors file in {folder}")
    return folder, files


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """DeepSeek-V3 block dequantisation: ``w = w_fp8.float() * scale_inv`` repeated over each block.

    Args:
        weight: ``[O, I]`` float8.
        scale_inv: ``[ceil(O/bo), ceil(I/bi)]`` float32, one scale per ``bo x bi`` block (edge blocks partial).
        block: ``(bo, bi)``, the quantization_config's ``weight_block_size``.
    Returns:
        ``[O, I]`` in ``dtype``.
    """
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (weight.float() * scale).to(dtype)


# planning: map every on-disk tensor before reading any -------------------------------------------------

def _read_headers(files: list[Path]) -> dict[str, _Source]:
    """Name, shape and dtype of every tensor in ``files`` (headers only)."""
    from safetensors import SafetensorError, safe_open

    sources: dict[str, _Source] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                headers = [(name, f.get_slice(name)) for name in f.keys()]
                headers = [(name, tuple(part.get_shape()), part.get_dtype()) for name, part in headers]
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from None
        for name, shape, dtype in headers:
            if name in sources:
                raise CheckpointError(f"tensor {name} is in both {sources[name].file.name} and {file.name}")
            sources[name] = _Source(name, file, shape, dtype)
    return sources


def _plan(sources: dict[str, _Source], targets: dict[str, tuple[int, ...]], config: MLAConfig,
          layout: HFLayout) -> tuple[list[tuple[_Source, _Slot]], dict[str, _Source], dict[str, list[str]]]:
    """Decide where each on-disk tensor goes; check names, shapes and coverage. Reads no data."""
    layers = config.decoder_layers
    scales = {n[: -len(SCALE_SUFFIX)]: s for n, s in sources.items()
              if n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in sources}
    plan: list[tuple[_Source, _Slot]] = []
    skipped: dict[str, list[str]] = {}
    unknown: list[str] = []
    for disk_name, src in sources.items():
        name = _text_name(disk_name, layout)
        if name is None:  # a wrapper's tensor outside its text model: its vision tower, or unknown
            outside = disk_name.startswith(layout.skipped_prefixes)
            (skipped.setdefault(f"{layout.model_type} tensors outside the text model", []) if outside else
             unknown).append(disk_name)
            continue
        base = disk_name[: -len(SCALE_SUFFIX)] if disk_name.endswith(SCALE_SUFFIX) else None
        layer = _LAYER_NAME.match(name)
        if layer and int(layer.group(1)) >= layers:
            if int(layer.group(1)) < layers + layout.mtp_layers:
                skipped.setdefault("MTP layer tensors (not part of the decoder)", []).append(disk_name)
            else:
                unknown.append(disk_name)
            continue
        if base is not None and base in scales and sources[base].dtype in _FP8:
            continue  # consumed with its weight
        if config.post_mlp_layernorm and (norm := _POST_MLP_NORM.fullmatch(name)):
            moe_norm = f"{norm.group(1)}.mlp.post_mlp_layernorm.weight"
            if moe_norm in targets:
                plan.append((src, _Slot(moe_norm)))
            else:
                skipped.setdefault("post_mlp_layernorm of dense layers (unused)", []).append(disk_name)
            continue
        if reason := _skip_reason(name, config, layout):
            skipped.setdefault(reason, []).append(disk_name)
        elif (slot := _slot(name, targets)) is not None:
            plan.append((src, slot))
        elif config.tie_word_embeddings and name == "lm_head.weight":
            if layout.text_prefix + "model.embed_tokens.weight" in sources:
                skipped.setdefault("tied lm_head (same as model.embed_tokens.weight)", []).append(disk_name)
            else:
                plan.append((src, _Slot("model.embed_tokens.weight")))
        else:
            unknown.append(disk_name)
    if unknown:
        raise CheckpointError(f"{len(unknown)} tensor(s) in the checkpoint that the model does not use: {name_list(unknown)}")
    _check_shapes(plan, scales, targets, layout.weight_block_size)
    for zero in _check_coverage(plan, targets, layout.zero_if_missing):
        skipped.setdefault("absent, zero as transformers makes it", []).append(zero)
    return plan, scales, skipped


def _text_name(disk_name: str, layout: HFLayout) -> str | None:
    """Our name of the on-disk tensor ``disk_name``: without a wrapper's text prefix, another spelling renamed;
    None for a wrapper's tensor outside its text model."""
    if not disk_name.startswith(layout.text_prefix):
        return None
    name = disk_name[len(layout.text_prefix):]
    for old, new in layout.renames:
        if name.startswith(old):
            name = new + name[len(old):]
    return name


def _skip_reason(name: str, config: MLAConfig, layout: HFLayout) -> str | None:
    """Why the tensor ``name`` (our spelling) is skipped, by its name alone: :data:`IGNORED`, a type's MTP prefix
    (LongCat's ``model.mtp.``), a zero expert's projection; None: not skipped for its name."""
    if layout.mtp_prefix and name.startswith(layout.mtp_prefix):
        return "MTP layer tensors (not part of the decoder)"
    if _zero_expert_projection(name, config):
        return "gate/up projections of zero (identity) experts (unused)"
    return next((r for p, r in IGNORED.items() if p.fullmatch(name)), None)


def _zero_expert_projection(name: str, config: MLAConfig) -> bool:
    """True for the gate or up projection (or its block scale) of a zero expert, ``model.layers.{i}.mlp.experts.{e}``
    with ``E <= e < E + zero_expert_num``: transformers sizes its ``gate_up_proj`` for every expert and writes them."""
    if not config.zero_expert_num:
        return False
    m = _EXPERT_NAME.fullmatch(name.removesuffix(SCALE_SUFFIX).removesuffix(".weight") + ".weight")
    return m is not None and m.group("proj") in ("gate_proj", "up_proj") and \
        config.n_routed_experts <= int(m.group("e")) < config.n_routed_experts + config.zero_expert_num


def _slot(name: str, targets: dict[str, tuple[int, ...]]) -> _Slot | None:
    """Our parameter (or expert slice of one) for the on-disk ``name``; None if the model has no such tensor."""
    if name in targets:
        return _Slot(name)
    m = _EXPERT_NAME.fullmatch(name)
    if m is None or m.group("proj") not in EXPERT_MAP:
        return None
    param, block = EXPERT_MAP[m.group("proj")]
    target, expert = f"{m.group('prefix')}.{param}", int(m.group("e"))
    if target not in targets or not expert < targets[target][0]:
        return None
    return _Slot(target, expert, block)


def _expected_shape(slot: _Slot, targets: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    shape = targets[slot.target]
    if slot.expert is None:
        return shape
    shape = shape[1:]
    return shape if slot.block is None else (shape[0] // 2, *shape[1:])


def _check_shapes(plan, scales, targets, block) -> None:
    """Each planned tensor has the shape its slot needs; each float8 one has a block scale of the right shape."""
    for src, slot in plan:
        want = _expected_shape(slot, targets)
        if src.shape != want:
            raise CheckpointError(f"{src.name}: shape {src.shape} in {src.file.name}, the model expects {want}")
        if src.dtype in _FP8:
            scale = scales.get(src.name)
            if scale is None:
                raise CheckpointError(f"{src.name} is float8 but the checkpoint has no {src.name}{SCALE_SUFFIX}")
            need = tuple(-(-n // b) for n, b in zip(src.shape, block))
            if len(src.shape) != 2 or scale.shape != need:
                raise CheckpointError(f"{scale.name}: shape {scale.shape}, expected {need} for a {src.shape} "
                                      f"weight in {block[0]}x{block[1]} blocks")
        elif src.dtype not in _ST_DTYPES:
            raise CheckpointError(f"{src.name}: dtype {src.dtype} is not a floating-point weight type")


def _check_coverage(plan: list[tuple[_Source, _Slot]], targets: dict[str, tuple[int, ...]],
                    zero_if_missing: tuple[str, ...] = ()) -> list[str]:
    """Each target filled exactly once: whole, or (fused experts) one slot per expert and row block. Returns the
    targets absent from the checkpoint that end with one of ``zero_if_missing`` (read as zeros)."""
    by_target: dict[str, dict[_Slot, str]] = {}
    for src, slot in plan:
        got = by_target.setdefault(slot.target, {})
        clash = got.get(_Slot(slot.target)) or got.get(slot) or (next(iter(got.values()), None) if slot.expert is None else None)
        if clash:
            raise CheckpointError(f"{src.name} and {clash} both supply {slot.target}")
        got[slot] = src.name
    missing: list[str] = []
    for target, shape in targets.items():
        got = by_target.get(target, {})
        if _Slot(target) in got:
            continue
        prefix, param = target.rsplit(".", 1)
        if prefix.endswith(".mlp.experts") and param in {p for p, _ in EXPERT_MAP.values()}:
            missing += [f"{prefix}.{e}.{proj}.weight" for proj, (p, block) in EXPERT_MAP.items() if p == param
                        for e in range(shape[0]) if _Slot(target, e, block) not in got]
        else:
            missing.append(target)
    zeros = [t for t in missing if zero_if_missing and t.endswith(zero_if_missing)]
    missing = [t for t in missing if t not in zeros]
    if missing:
        raise CheckpointError(f"the checkpoint lacks {len(missing)} tensor(s) the model needs: {name_list(missing)}")
    return zeros


# reading ------------------------------------------------------------------------------------------------

class _Reader:
    """Memory-mapped access to the shards; a file is re-mapped after ``_REOPEN_BYTES`` read from it, which
    drops the pages already copied out (a mapping's touched pages count as resident until it is closed)."""

    def __init__(self):
        self._open: dict[Path, tuple[Any, int]] = {}

    def get(self, src: _Source, index: int | None = None) -> torch.Tensor:
        """The tensor ``src`` (``index``: its ``[index]`` alone, read without the rest)."""
        from safetensors import safe_open

        handle, done = self._open.get(src.file, (None, 0))
        if handle is None or done > _REOPEN_BYTES:
            self._open[src.file] = (safe_open(str(src.file), framework="pt"), 0)
            handle, done = self._open[src.file]
        tensor = handle.get_tensor(src.name) if index is None else handle.get_slice(src.name)[index]
        self._open[src.file] = (handle, done + tensor.nbytes)
        return tensor

    def close(self) -> None:
        self._open.clear()


def _resolve_dtype(dtype: torch.dtype | str | None, sources: dict[str, _Source]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point or dtype.itemsize < 2:
            raise ConfigError(f"dtype {dtype} is not supported; choose float32, bfloat16 or float16")
        return dtype
    if isinstance(dtype, str):
        if dtype.lower().removeprefix("torch.") not in _DTYPE_NAMES:
            raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(_DTYPE_NAMES)}")
        return _DTYPE_NAMES[dtype.lower().removeprefix("torch.")]
    if dtype is not None:
        raise ConfigError(f"dtype must be a torch dtype, a name or None, got {dtype!r}")
    if any(s.dtype in _FP8 for s in sources.values()):
        return torch.bfloat16
    counts: dict[str, int] = {}
    for s in sources.values():  # the floating dtype holding most of the elements
        if s.dtype in _ST_DTYPES:
            counts[s.dtype] = counts.get(s.dtype, 0) + math.prod(s.shape)
    return _ST_DTYPES[max(counts, key=counts.get)] if counts else torch.float32
