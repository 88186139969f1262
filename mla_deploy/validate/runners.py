"""Stateful Polygraphy runners: each owns its latent cache across a trajectory (see :mod:`.trajectory`).

A feed dict with ``step == 0`` starts a fresh cache of batch ``B`` (prefill); every later step runs the decode
graph (or the reference model) on the runner's own cache from the previous step. Outputs are canonical
(float32 logits with padded positions zeroed, compact valid cache rows ``[B, T, C]``), so runners that lay
out their caches differently (concat with padding holes, static buffers) compare element for element.

* :class:`TorchRunner`: the original ``CC``-form model in fp32, rebuilt from the artifact.
* :class:`OrtRunner`: the artifact run by :class:`~mla_deploy.runtime.ort_engine.OrtEngine`.
* :func:`trt_runner`: an optional hook for a TensorRT engine with the same protocol (``mla_deploy.trt``).

Polygraphy's own ``PytRunner`` cannot be used (it calls the module with no arguments, casts with Polygraphy
dtypes, moves inputs to CUDA unconditionally and returns a tuple).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import numpy as np
from polygraphy.backend.base import BaseRunner

from ..errors import InputError, RuntimeMissingError
from ..io_spec import present_name
from .trajectory import canonical_logits, canonical_rows, input_metadata, step_role


class TrajectoryRunner(BaseRunner):
    """Base class: the step protocol and canonical outputs. Subclasses implement ``_new_state`` and ``_forward``.

    Args:
        layers: number of decoder layers (one ``present_latent.{i}`` output each).
        layout: how the runner's cache rows are laid out: ``concat`` (slots appended in order, padding slots
            included) or ``static`` (slot ``t`` holds position ``t``).
        name: the runner's name in Polygraphy's results.
    """

    def __init__(self, layers: int, layout: str, name: str, prefix: str):
        super().__init__(name=name, prefix=prefix)
        if layout not in ("concat", "static"):
            raise ValueError(f"layout must be concat or static, got {layout!r}")
        self.layers = layers
        self.layout = layout

    # Polygraphy interface -------------------------------------------------------------------
    def activate_impl(self) -> None:
        self._state = None
        self._slot_valid = None
        self._lengths = None

    def deactivate_impl(self) -> None:
        del self._state, self._slot_valid, self._lengths

    def get_input_metadata_impl(self):
        return input_metadata()

    def infer_impl(self, feed_dict: dict[str, Any]) -> "OrderedDict[str, np.ndarray]":
        """Run one trajectory step.

        Args:
            feed_dict: ``input_ids``, ``position_ids``, ``valid`` ``[B, S]`` int64 and ``step`` ``[1]``.
        Returns:
            ``logits [B, S, V]`` and ``present_latent.{i} [B, T, C]``, float32, canonical.
        """
        ids = np.ascontiguousarray(feed_dict["input_ids"], dtype=np.int64)
        pos = np.ascontiguousarray(feed_dict["position_ids"], dtype=np.int64)
        valid = np.ascontiguousarray(feed_dict["valid"], dtype=np.int64)
        step = int(np.asarray(feed_dict["step"]).reshape(-1)[0])
        batch = ids.shape[0]
        if step == 0:
            self._state = self._new_state(batch)
            self._slot_valid = np.zeros((batch, 0), dtype=np.int64)
            self._lengths = np.zeros(batch, dtype=np.int64)
        elif self._state is None:
            raise InputError(f"{self.name}: a trajectory must start with a prefill (step 0), got step {step}")
        start = time.perf_counter()
        logits, rows = self._forward(step_role(step), ids, pos, valid)
        self.inference_time = time.perf_counter() - start
        self._lengths = self._lengths + valid.sum(axis=1)
        if self.layout == "concat":
            self._slot_valid = np.concatenate((self._slot_valid, valid), axis=1)
        out = OrderedDict(logits=canonical_logits(logits, valid))
        for i, layer_rows in enumerate(rows):
            layer_rows = np.asarray(layer_rows, dtype=np.float32)
            if self.layout == "concat":
                slot_valid = self._slot_valid
            else:
                slot_valid = np.arange(layer_rows.shape[1])[None, :] < self._lengths[:, None]
            out[present_name(i)] = canonical_rows(layer_rows, slot_valid)
        return out

    # subclass interface ---------------------------------------------------------------------
    def _new_state(self, batch: int) -> Any:
        raise NotImplementedError

    def _forward(self, role: str, ids: np.ndarray, pos: np.ndarray, valid: np.ndarray) -> tuple[Any, list]:
        """Returns: logits ``[B, S, V]`` and per layer the cache rows the runner holds ``[B, T_raw, C]``."""
        raise NotImplementedError


class TorchRunner(TrajectoryRunner):
    """The PyTorch reference: the original ``CC``-form model in fp32 with a growing (concat) latent cache.

    Args:
        model: an :class:`~mla_deploy.model.decoder.MLAForCausalLM` (see :func:`.reference.load_reference_model`).
        name: runner name (default ``torch``).
    """

    def __init__(self, model, name: str = "torch"):
        super().__init__(model.config.num_hidden_layers, "concat", name, "torch-runner")
        self._model = model

    @classmethod
    def from_artifact(cls, artifact_dir: str | Path, manifest: dict[str, Any], name: str = "torch") -> "TorchRunner":
        from .reference import load_reference_model

        return cls(load_reference_model(artifact_dir, manifest), name=name)

    def _new_state(self, batch: int):
        """Per layer ``[B, 0, C]`` float32 caches and the key-valid mask ``[B, 0]``."""
        import torch

        return {"caches": self._model.empty_cache(batch, 0, dtype=torch.float32),
                "key_valid": torch.zeros(batch, 0, dtype=torch.long)}

    def _forward(self, role, ids, pos, valid):
        import torch

        from ..model.cache import ConcatCache

        key_valid = torch.cat((self._state["key_valid"], torch.from_numpy(valid)), dim=1)
        with torch.inference_mode():
            logits, presents = self._model(torch.from_numpy(ids), torch.from_numpy(pos), self._state["caches"],
                                           ConcatCache(key_valid))
        self._state = {"caches": presents, "key_valid": key_valid}
        return logits.float().numpy(), [p.float().numpy() for p in presents]


class EngineRunner(TrajectoryRunner):
    """Any engine with :class:`~mla_deploy.runtime.ort_engine.OrtEngine`'s protocol: ``.config``, ``.cache_mode``,
    ``.new_state(batch)`` and ``.forward(role, input_ids, position_ids, state, valid)`` returning ``logits`` and
    ``present_latent.{i}`` (concat: every slot held; static: rows ``0 .. max(lengths)``).

    Args:
        engine: the engine (built once; :meth:`activate` only resets the trajectory).
        name: runner name.
        provider: what executes it, for the report (e.g. ``CPUExecutionProvider``).
    """

    def __init__(self, engine, name: str, provider: str | None = None, prefix: str = "engine-runner"):
        super().__init__(engine.config.num_hidden_layers, engine.cache_mode, name, prefix)
        self.engine = engine
        self.provider = provider or getattr(engine, "provider", None)

    def _new_state(self, batch: int):
        return self.engine.new_state(batch)

    def _forward(self, role, ids, pos, valid):
        out = self.engine.forward(role, ids, pos, self._state, valid)
        return out["logits"], [out[present_name(i)] for i in range(self.layers)]


class OrtRunner(EngineRunner):
    """The artifact run by ONNX Runtime through the project's :class:`OrtEngine`.

    Args:
        artifact_dir: the export directory.
        provider: ``cpu`` or ``cuda`` (the engine refuses a silent fallback).
        threads: intra-op threads (None: ONNX Runtime's default).
        name: runner name (default ``onnxrt``).
    """

    def __init__(self, artifact_dir: str | Path, provider: str = "cpu", threads: int | None = None,
                 name: str = "onnxrt"):
        from ..runtime.ort_engine import OrtEngine

        engine = OrtEngine(artifact_dir, provider=provider, threads=threads)
        super().__init__(engine, name, engine.provider, prefix="onnxrt-runner")


def trt_runner(artifact_dir: str | Path, name: str = "tensorrt", **kwargs) -> EngineRunner:
    """A TensorRT runner, when ``mla_deploy.trt`` provides an engine with the OrtEngine protocol.

    Looks for ``mla_deploy.trt.TrtEngine(artifact_dir, **kwargs)``.

    Raises:
        RuntimeMissingError: ``mla_deploy.trt`` (or its ``TrtEngine``) is absent, or TensorRT is not installed.
    """
    try:
        from .. import trt as trt_module
    except ImportError as exc:
        raise RuntimeMissingError(f"no TensorRT runtime in this mla-deploy (mla_deploy.trt: {exc})") from None
    factory: Callable | None = getattr(trt_module, "TrtEngine", None)
    if factory is None:
        raise RuntimeMissingError("mla_deploy.trt provides no TrtEngine to validate")
    engine = factory(artifact_dir, **kwargs)
    return EngineRunner(engine, name, getattr(engine, "provider", "TensorRT"), prefix="trt-runner")
