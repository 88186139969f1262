"""Where an export's weights come from, and the one file they are streamed into.

An export never holds the model: the graphs are traced from a model on the ``meta`` device (shapes only), and
each weight the graphs need is then read from its *source*, turned into the graph's layout and written, one
tensor at a time, into one shared ``weights.data`` file that every graph of the artifact references.

Sources serve the original (``CC``) form's state dict, by key:

* :class:`ModuleTensors`: a model in memory (the Python API);
* :class:`RandomTensors`: a preset's seeded random weights (:func:`~mla_deploy.model.decoder.random_tensor`);
* :class:`mla_deploy.checkpoint.CheckpointTensors`: a Hugging Face checkpoint, read one tensor at a time.

A graph's initializer is a :class:`WeightSpec`: a source key, optionally one half of ``kv_b_proj`` (the
absorbed form's ``w_uk``/``w_uv``) and a transpose (the exporter's ``MatMul(x, Transpose(W))`` folded into
the stored tensor, so no runtime copies or re-lays out a weight).
"""

from __future__ import annotations

import re
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch

from ..config import MLAConfig
from ..quant import WHOLE, WeightPart

#: offsets of the tensors in weights.data: page-aligned so that runtimes can map them (64 KiB covers every OS)
ALIGNMENT = 1 << 16
WEIGHTS_FILE = "weights.data"
Progress = Callable[[int, int, float], None]


class TensorSource(Protocol):
    """The original-form state dict, served one tensor at a time."""

    def keys(self) -> list[str]: ...

    def get(self, key: str) -> torch.Tensor: ...

    def expert(self, key: str, index: int) -> torch.Tensor:
        """``get(key)[index]``: one expert of a stacked ``[E, ...]`` tensor, read alone where the source can."""
        ...

    def close(self) -> None: ...


class ModuleTensors:
    """The state dict of a model in memory (the original form: ``kv_b_proj``, stacked experts), and its buffers
    that the state dict leaves out (e.g. a block's rope frequencies)."""

    def __init__(self, model: torch.nn.Module):
        self._state = model.state_dict()
        self._state.update({k: v for k, v in model.named_buffers() if k not in self._state})

    def keys(self) -> list[str]:
        return list(self._state)

    def get(self, key: str) -> torch.Tensor:
        return self._state[key]

    def expert(self, key: str, index: int) -> torch.Tensor:
        return self._state[key][index]

    def close(self) -> None:
        pass


class RandomTensors:
    """A preset's random weights, each drawn on demand exactly as :func:`~mla_deploy.model.build_model` draws it."""

    def __init__(self, config: MLAConfig, std: float, seed: int):
        from ..model import MLAForCausalLM

        with torch.device("meta"):
            model = MLAForCausalLM(config, "CC")
        self.shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith("inv_freq")}
        self.std, self.seed = std, seed
        self._last: tuple[str | None, torch.Tensor | None] = (None, None)

    def keys(self) -> list[str]:
        return list(self.shapes)

    def expert(self, key: str, index: int) -> torch.Tensor:
        """One expert of the stacked tensor ``key``, which is drawn whole (as the model draws it) and kept while
        the experts of one key are asked for in turn."""
        if self._last[0] != key:
            self._last = (None, None)
            self._last = (key, self.get(key))
        return self._last[1][index]

    def get(self, key: str) -> torch.Tensor:
        from ..model.decoder import random_tensor

        return random_tensor(key, self.shapes[key], self.std, self.seed)

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class WeightSpec:
    """How one graph initializer is made from the source.

    Attributes:
        key: the source's state-dict key (the original form's, e.g. ``...self_attn.kv_b_proj.weight``).
        part: ``w_uk`` or ``w_uv`` to take that half of ``kv_b_proj`` per head; None for the whole tensor.
        ops: views applied in order after ``part``: ``("index", i)`` selects ``tensor[i]`` (one expert of a stacked
            tensor), ``("perm", p)`` transposes, ``("shape", s)`` reshapes (row-major, as ONNX ``Reshape``).
        quant: what the initializer is of the view (:class:`mla_deploy.quant.WeightPart`): the view itself
            (:data:`~mla_deploy.quant.WHOLE`), or one stored tensor of its quantization (the integers or the scales
            of :func:`mla_deploy.quant.quantize` of the ``[K, N]`` view, in its format's layout).
    """

    key: str
    part: str | None = None
    ops: tuple = ()
    quant: WeightPart = WHOLE

    @classmethod
    def for_parameter(cls, name: str) -> "WeightSpec":
        """The spec of our model's parameter ``name`` in any form (absorbed ``w_uk``/``w_uv`` included)."""
        for part in ("w_uk", "w_uv"):
            if re.search(r"self_attn(\.\d+)?\." + part + "$", name):  # LongCat's sub-layers: self_attn.{0,1}
                return cls(name[: -len(part)] + "kv_b_proj.weight", part)
        return cls(name)

    def per_expert(self, experts: int) -> "WeightSpec | None":
        """This view of a stacked ``[experts, ...]`` tensor as the stack of one view per expert: the spec that makes
        expert ``e``'s slice of the view from the source's ``tensor[e]``, or None when an op selects one expert
        (``("index", i)``) or mixes them (a reshape or transpose that moves the leading axis)."""
        if self.part is not None:
            return None
        ops = []
        for kind, arg in self.ops:
            if kind == "shape" and len(arg) > 1 and arg[0] == experts and -1 not in arg:
                ops.append(("shape", tuple(arg[1:])))
            elif kind == "perm" and arg[0] == 0:
                ops.append(("perm", tuple(a - 1 for a in arg[1:])))
            else:
                return None
        return WeightSpec(self.key, None, tuple(ops))

    def then(self, op: tuple) -> "WeightSpec":
        """This spec followed by the view ``op`` (``("index", i)``, ``("perm", p)`` or ``("shape", s)``)."""
        return WeightSpec(self.key, self.part, (*self.ops, op), self.quant)

    @property
    def view(self) -> "WeightSpec":
        """The view this initializer is made from (this spec without its :attr:`quant` part)."""
        return WeightSpec(self.key, self.part, self.ops)

    def apply(self, tensor: torch.Tensor, config: MLAConfig) -> torch.Tensor:
        """The view made from the source's tensor ``key`` (same dtype; a view where possible); ``quant`` is
        applied by the writer (:func:`~mla_deploy.exporter.export.make_weights`, through
        :meth:`mla_deploy.quant.WeightPart.make`)."""
        if self.part is not None:
            from ..model.absorb import split_kv_b

            tensor = split_kv_b(tensor, config)[0 if self.part == "w_uk" else 1]
        for kind, arg in self.ops:
            if kind == "index":
                tensor = tensor[arg]
            else:
                tensor = tensor.reshape(arg) if kind == "shape" else tensor.permute(*arg)
        return tensor


class WeightsFile:
    """``weights.data``: tensors appended at :data:`ALIGNMENT`-aligned offsets, hashed as they are written.

    Args:
        path: the file to create.
        total: the bytes expected (for progress), or 0.
        progress: called as ``progress(bytes_written, total, seconds)`` after each tensor.
    """

    def __init__(self, path: Path, total: int = 0, progress: Progress | None = None):
        self.path = Path(path)
        self._file = self.path.open("wb")
        self._digest = hashlib.sha256()
        self.offset = 0
        self.written = 0
        self.total = total
        self._progress = progress
        self._start = time.perf_counter()

    def append(self, tensor: torch.Tensor) -> tuple[int, int]:
        """Write ``tensor``'s bytes; returns ``(offset, length)``."""
        return self.append_chunks([tensor])

    def append_chunks(self, chunks) -> tuple[int, int]:
        """Write the bytes of each tensor of the iterable ``chunks`` one after the other, as one tensor (made one
        chunk at a time: a stacked experts' weight, expert by expert); returns ``(offset, length)``."""
        pad = -self.offset % ALIGNMENT
        if pad:
            self._write(b"\0" * pad)
        start = self.offset
        for tensor in chunks:
            data = tensor.contiguous()
            size = data.dtype.itemsize
            raw = data.view(torch.uint8) if size == 1 else data.view(_INT_OF_SIZE[size])
            self._write(memoryview(raw.numpy()).cast("B"))
            self.written += data.numel() * size
            if self._progress is not None:
                self._progress(self.written, self.total, time.perf_counter() - self._start)
        return start, self.offset - start

    def _write(self, data) -> None:
        self._file.write(data)  # an OSError (no space, file too large) is the caller's to report
        self._digest.update(data)
        self.offset += len(data)

    def close(self) -> dict:
        """Finish the file; returns ``{"file", "bytes", "sha256"}`` for the manifest."""
        self._file.close()
        return {"file": self.path.name, "bytes": self.offset, "sha256": self._digest.hexdigest()}


_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}
