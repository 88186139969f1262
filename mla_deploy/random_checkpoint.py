"""Write a DeepSeek-V2/V3-shaped checkpoint with random weights, in the layout transformers and DeepSeek publish.

For measuring full-size models without downloading one: ``config.json`` (transformers' keys), sharded
``model-0000k-of-0000n.safetensors`` files and ``model.safetensors.index.json``. Routed experts are stored one
tensor per expert (``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``), as in the released
checkpoints. Values are :func:`~mla_deploy.model.decoder.random_tensor`'s (matrices ``N(0, std)``, norm scales
``1 + N(0, 0.1)``, the V3 routing bias ``N(0, 0.1)``, kept in float32 as transformers keeps it).

The files are streamed: each tensor is drawn and written straight into its shard, so memory stays at one tensor
(the largest is the embedding: 0.8 GB while drawn in float32 for DeepSeek-V2-Lite) whatever the model's size. The folder is written under a temporary name and renamed into
place, so an interrupted run leaves no half-written checkpoint.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .config import MLAConfig, to_hf_config
from .errors import ConfigError, ExportError

INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"bf16": ("BF16", 2), "fp16": ("F16", 2), "fp32": ("F32", 4)}


@dataclass(frozen=True)
class TensorEntry:
    """One on-disk tensor: its checkpoint name, shape and safetensors dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "F32" else 2

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def checkpoint_tensors(config: MLAConfig, dtype: str = "bf16") -> list[TensorEntry]:
    """Every tensor of ``config``'s checkpoint in on-disk order (per-expert routed weights).

    The names and shapes are those of our model's state dict (equal to transformers'), with the fused
    ``mlp.experts.gate_up_proj [E, 2I, D]`` / ``down_proj [E, D, I]`` split into per-expert tensors.
    """
    import torch

    from .model import MLAForCausalLM

    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    st_dtype = DTYPES[dtype][0]
    with torch.device("meta"):
        model = MLAForCausalLM(config, "CC")
    entries, pending = [], {}
    for name, tensor in model.state_dict().items():
        if name.endswith("rotary_emb.inv_freq") or (config.tie_word_embeddings and name == "lm_head.weight"):
            continue
        shape = tuple(tensor.shape)
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, D]: emitted with down_proj, expert by expert
            pending[name[: -len("gate_up_proj")]] = shape
        elif name.endswith("mlp.experts.down_proj"):  # [E, D, I]
            prefix = name[: -len("down_proj")]
            experts, rows, cols = pending.pop(prefix)
            for e in range(experts):
                entries += [TensorEntry(f"{prefix}{e}.gate_proj.weight", (rows // 2, cols), st_dtype),
                            TensorEntry(f"{prefix}{e}.up_proj.weight", (rows // 2, cols), st_dtype),
                            TensorEntry(f"{prefix}{e}.down_proj.weight", shape[1:], st_dtype)]
        elif name.endswith("e_score_correction_bias"):
            entries.append(TensorEntry(name, shape, "F32"))
        else:
            entries.append(TensorEntry(name, shape, st_dtype))
    assert not pending, f"experts without down_proj: {list(pending)}"
    return entries


def plan_shards(entries: list[TensorEntry], shard_bytes: int) -> list[list[TensorEntry]]:
    """Split ``entries`` into consecutive shards of at most ``shard_bytes`` (a larger tensor gets a shard alone)."""
    shards: list[list[TensorEntry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def write_random_checkpoint(config: MLAConfig, out: str | Path, dtype: str = "bf16", shard_bytes: int = 5 * 10**9,
                            seed: int = 0, std: float = 0.02,
                            progress: Callable[[int, int, float], None] | None = None) -> dict:
    """Write ``config``'s checkpoint with random weights to the folder ``out`` (created; must not exist or be empty).

    Args:
        config: the model (e.g. ``load_recipe("deepseek-v2-lite").model``).
        out: the checkpoint folder.
        dtype: ``bf16``, ``fp16`` or ``fp32`` (the V3 routing bias stays float32).
        shard_bytes: the largest shard.
        seed: each tensor's values come from ``seed`` and its index, so a rerun writes the same bytes.
        std: standard deviation of the matrices.
        progress: called as ``progress(bytes_written, total_bytes, seconds)`` after each tensor.
    Returns:
        ``{"path", "files", "tensors", "bytes", "seconds"}``.
    Raises:
        ExportError: ``out`` exists and is not an empty folder. ConfigError: a bad dtype or shard size.
    """
    from .artifact.files import atomic_dir

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not an empty folder; choose another output folder")
    if shard_bytes < 1:
        raise ConfigError(f"shard_bytes must be positive, got {shard_bytes}")
    entries = checkpoint_tensors(config, dtype)
    shards = plan_shards(entries, shard_bytes)
    total = sum(e.nbytes for e in entries)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    start, written = time.perf_counter(), 0
    weight_map = {}
    with atomic_dir(out) as tmp:
        for file, shard in zip(names, shards):
            with (tmp / file).open("wb") as f:
                f.write(_header(shard))
                for entry in shard:
                    _write_tensor(f, entry, seed, std)
                    written += entry.nbytes
                    weight_map[entry.name] = file
                    if progress is not None:
                        progress(written, total, time.perf_counter() - start)
        (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2) + "\n")
        hf = to_hf_config(config)
        hf["torch_dtype"] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype]
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return {"path": str(out), "files": names, "tensors": len(entries), "bytes": total,
            "seconds": time.perf_counter() - start}


def _header(shard: list[TensorEntry]) -> bytes:
    """The safetensors header of a shard: 8-byte little-endian length, then JSON padded to 8 bytes."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in shard:
        header[entry.name] = {"dtype": entry.dtype, "shape": list(entry.shape),
                              "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return len(blob).to_bytes(8, "little") + blob


def _write_tensor(f, entry: TensorEntry, seed: int, std: float) -> None:
    """Draw ``entry``'s values (:func:`~mla_deploy.model.decoder.random_tensor`) and append their bytes to ``f``."""
    import torch

    from .model.decoder import random_tensor

    torch_dtype = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[entry.dtype]
    data = random_tensor(entry.name, entry.shape, std, seed).to(torch_dtype).contiguous()
    f.write((data.view(torch.int16) if entry.itemsize == 2 else data).numpy().tobytes())
