"""A GGUF file's metadata and tensors (read from its header, no dependency), and the bytes one decode step
of llama.cpp reads from them.

A decode step of one token reads every tensor whole except the routed experts (``blk.N.ffn_*_exps``: ``k`` of
their ``E`` experts, ``k`` = ``{arch}.expert_used_count``) and the token embedding (one row; read whole when the
output matrix is tied to it), plus the cache rows it attends to: for MLA (``{arch}.attention.kv_lora_rank``)
``kv_lora_rank + rope`` values per layer and row, at 2 bytes (llama.cpp's default F16 cache).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from .settings import CompareError

MAGIC = b"GGUF"
#: GGUF metadata value types: struct format of the scalars
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
#: ggml tensor types by id (the ones the comparison writes, and a few more)
TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
              11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 30: "BF16"}
_EXPERTS = re.compile(r"blk\.\d+\.ffn_(gate|up|down|gate_up)_exps\.weight")
#: bytes per cached value (llama.cpp's default cache type, F16)
CACHE_ITEMSIZE = 2


@dataclass(frozen=True)
class Tensor:
    """One tensor: its name, ggml dims (``ne0`` first: ``[columns, rows, experts]``), type id and stored bytes."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    nbytes: int

    @property
    def type_name(self) -> str:
        return TYPE_NAMES.get(self.type_id, f"type {self.type_id}")


@dataclass(frozen=True)
class GGUF:
    """A GGUF file's metadata (scalars and strings; arrays as their length) and tensors."""

    path: Path
    metadata: dict
    tensors: tuple[Tensor, ...]

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default=None):
        """``{arch}.key`` from the metadata."""
        return self.metadata.get(f"{self.arch}.{key}", default)


def _read(f: BinaryIO, fmt: str):
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise EOFError
    return struct.unpack(fmt, data)[0]


def _string(f: BinaryIO) -> str:
    return f.read(_read(f, "<Q")).decode("utf-8", "replace")


def _value(f: BinaryIO, kind: int):
    if kind in _SCALARS:
        return _read(f, _SCALARS[kind])
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        item, count = _read(f, "<I"), _read(f, "<Q")
        for _ in range(count):
            _value(f, item)
        return count
    raise ValueError(f"unknown metadata type {kind}")


def read_gguf(path: Path) -> GGUF:
    """The metadata and tensors of the GGUF file ``path``; :class:`CompareError` when it is none."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != MAGIC:
                raise CompareError(f"{path} is not a GGUF file")
            _read(f, "<I")  # version
            n_tensors, n_kv = _read(f, "<Q"), _read(f, "<Q")
            metadata = {}
            for _ in range(n_kv):
                key = _string(f)
                metadata[key] = _value(f, _read(f, "<I"))
            infos = []
            for _ in range(n_tensors):
                name, n_dims = _string(f), _read(f, "<I")
                dims = tuple(_read(f, "<Q") for _ in range(n_dims))
                infos.append((name, dims, _read(f, "<I"), _read(f, "<Q")))
            align = int(metadata.get("general.alignment", 32))
            start = -(-f.tell() // align) * align
    except (EOFError, ValueError, struct.error) as exc:
        raise CompareError(f"{path}: a damaged GGUF header ({exc or 'truncated'})") from None
    return GGUF(path, metadata, _tensors(infos, path.stat().st_size - start))


def _tensors(infos: list[tuple], data_bytes: int) -> tuple[Tensor, ...]:
    """Each tensor's stored bytes: from its offset to the next one's (the data section's end for the last; the
    alignment padding, at most 31 bytes, counts with the tensor before it)."""
    ends = sorted({offset for *_, offset in infos} | {data_bytes})
    following = {offset: ends[i + 1] for i, offset in enumerate(ends[:-1])}
    return tuple(Tensor(name, dims, type_id, following[offset] - offset) for name, dims, type_id, offset in infos)


def decode_bytes(model: GGUF, rows: float) -> dict:
    """Bytes one decode step of one token reads (see the module docstring) with ``rows`` cached rows.

    Returns: ``{"weight_bytes", "expert_bytes", "cache_bytes", "bytes"}``."""
    used = int(model.get("expert_used_count", 0) or 0)
    names = {t.name for t in model.tensors}
    weights = experts = 0.0
    for t in model.tensors:
        if _EXPERTS.fullmatch(t.name):
            experts += t.nbytes * used / t.dims[-1]
        elif t.name == "token_embd.weight" and "output.weight" in names:
            weights += t.nbytes / t.dims[1]
        else:
            weights += t.nbytes
    latent = int(model.get("attention.kv_lora_rank", 0) or 0) + int(model.get("rope.dimension_count", 0) or 0)
    cache = rows * latent * CACHE_ITEMSIZE * int(model.get("block_count", 0) or 0) if latent else 0.0
    return {"weight_bytes": int(weights + experts), "expert_bytes": int(experts), "cache_bytes": int(cache),
            "bytes": int(weights + experts + cache)}


def other_types(model: GGUF, kind: str) -> dict[str, str]:
    """The matrices of ``model`` (two or more dimensions) stored in a type other than ``kind`` and F32 (the routers
    and what llama.cpp keeps in F32 at every type), by name: e.g. ``{"output.weight": "Q6_K"}`` in a Q4_0 file
    that llama-quantize made without ``--pure``."""
    return {t.name: t.type_name for t in model.tensors
            if len(t.dims) >= 2 and t.type_name not in (kind, "F32")}


def held_apart(models: dict) -> str:
    """The title's note of the matrices a GGUF file holds in another type than its own (``models``: type ->
    :class:`GGUF`), e.g. ``; the Q4_0 file holds output.weight in Q6_K``; empty where none."""
    notes = []
    for kind, model in models.items():
        other = other_types(model, kind)
        if other:
            by_type: dict[str, list[str]] = {}
            for name, type_name in other.items():
                by_type.setdefault(type_name, []).append(name)
            held = ", ".join(f"{', '.join(names) if len(names) <= 3 else f'{len(names)} matrices'} in {type_name}"
                             for type_name, names in by_type.items())
            notes.append(f"the {kind} file holds {held}")
    return "".join(f"; {note}" for note in notes)


def summary(model: GGUF) -> dict:
    """The file's size, tensor bytes and types (for the report)."""
    types: dict[str, int] = {}
    for t in model.tensors:
        types[t.type_name] = types.get(t.type_name, 0) + t.nbytes
    return {"path": str(model.path), "file_bytes": model.path.stat().st_size,
            "tensor_bytes": sum(t.nbytes for t in model.tensors), "tensors": len(model.tensors),
            "bytes_by_type": types, "arch": model.arch}
