"""Stateful Polygraphy runners: each owns its latent cache across a trajectory (see :mod:`.trajectory`).

A feed dict with ``step == 0`` starts a fresh cache of batch ``B`` (prefill); every later step runs the decode
graph (or the reference model) on the runner's own cache from the previous step. Outputs are canonical
(float32 logits with padded positions zeroed, compact valid cache rows ``[B, T, C]``), so runners that lay
out their caches differently (concat with padding holes, static buffers) compare element for element.

* :class:`TorchRunner`: the original ``CC``-form model in fp32, rebuilt from the artifact.
* :class:`OrtRunner`: the artifact run by :class:`~mla_deploy.ort.engine.OrtEngine`.
* :func:`trt_runner`: the artifact's TensorRT engines run by :class:`~mla_deploy.trt.engine.TrtEngine`.

Which cache rows belong to real tokens is asked of the runner's
:class:`~mla_deploy.cache_layout.CacheLayout` (a row-less :class:`~mla_deploy.cache_layout.CacheState`
kept beside the runner's own state).

Polygraphy's own ``PytRunner`` cannot be used (it calls the module with no arguments, casts with Polygraphy
dtypes, moves inputs to CUDA unconditionally and returns a tuple).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
from polygraphy.backend.base import BaseRunner

from ..artifact import Manifest
from ..cache_layout import CONCAT, CacheLayout, CacheState, cache_tensors
from ..errors import InputError
from ..quant import FAST_COMPUTE
from .trajectory import canonical_logits, canonical_rows, input_metadata, step_role


class TrajectoryRunner(BaseRunner):
    """Base class: the step protocol and canonical outputs. Subclasses implement ``_new_state`` and ``_forward``.

    Args:
        config: the model (one ``present_latent.{i}`` output per layer, and ``present_index.{i}`` with sparse
            attention: :func:`~mla_deploy.cache_layout.cache_tensors`).
        layout: the :class:`~mla_deploy.cache_layout.CacheLayout` of the rows the runner returns (e.g.
            :data:`~mla_deploy.cache_layout.CONCAT`: slots appended in order, padding slots included;
            :data:`~mla_deploy.cache_layout.STATIC`: slot ``t`` holds position ``t``).
        name: the runner's name in Polygraphy's results.
    Raises:
        TypeError: ``layout`` is not a CacheLayout.
    """

    #: Polygraphy's ``__del__`` reads it: a subclass whose engine fails to load before ``BaseRunner.__init__`` ran
    #: must not add "Exception ignored ... no attribute 'is_active'" after the error line
    is_active = False

    def __init__(self, config, layout: CacheLayout, name: str, prefix: str):
        super().__init__(name=name, prefix=prefix)
        if not isinstance(layout, CacheLayout):
            raise TypeError(f"layout must be a CacheLayout (CONCAT or STATIC), got {layout!r}")
        self.caches = cache_tensors(config)
        self.layout = layout

    # Polygraphy interface -------------------------------------------------------------------
    def activate_impl(self) -> None:
        self._state = None
        self._slots = None

    def deactivate_impl(self) -> None:
        del self._state, self._slots

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
            self._slots = _slot_bookkeeping(batch)
        elif self._state is None:
            raise InputError(f"{self.name}: a trajectory must start with a prefill (step 0), got step {step}")
        start = time.perf_counter()
        logits, rows = self._forward(step_role(step), ids, pos, valid)
        self.inference_time = time.perf_counter() - start
        self.layout.advance(self._slots, valid, self.layout.control_input(self._slots, valid), [])
        out = OrderedDict(logits=canonical_logits(logits, valid))
        for tensor, layer_rows in zip(self.caches, rows, strict=True):
            layer_rows = np.asarray(layer_rows, dtype=np.float32)
            out[tensor.present] = canonical_rows(layer_rows, self.layout.slot_valid(self._slots, layer_rows.shape[1]))
        return out

    # subclass interface ---------------------------------------------------------------------
    def _new_state(self, batch: int) -> Any:
        raise NotImplementedError

    def _forward(self, role: str, ids: np.ndarray, pos: np.ndarray, valid: np.ndarray) -> tuple[Any, list]:
        """Returns: logits ``[B, S, V]`` and per layer the cache rows the runner holds ``[B, T_raw, C]``."""
        raise NotImplementedError


def _slot_bookkeeping(batch: int) -> CacheState:
    """A row-less cache state of ``batch`` sequences: the lengths (and key-valid mask, for a layout that keeps
    one) that :meth:`CacheLayout.slot_valid` reads, advanced like an engine's."""
    return CacheState(np.zeros(batch, dtype=np.int64), [], np.zeros((batch, 0), dtype=np.int64))


class TorchRunner(TrajectoryRunner):
    """The PyTorch reference: the original ``CC``-form model in fp32 with a growing (concat) latent cache.

    Args:
        model: an :class:`~mla_deploy.model.decoder.MLAForCausalLM` (see :func:`.reference.load_reference_model`).
        name: runner name (default ``torch``).
    """

    def __init__(self, model, name: str = "torch"):
        super().__init__(model.config, CONCAT, name, "torch-runner")
        self._model = model

    @classmethod
    def from_artifact(cls, artifact_dir: str | Path, manifest: Manifest, name: str = "torch",
                      quantized: bool = True) -> "TorchRunner":
        """The artifact's PyTorch original; ``quantized``: with the weights the artifact computes with (a quantized
        artifact's weights quantized and dequantized), else the unquantized original."""
        from .reference import load_reference_model

        return cls(load_reference_model(artifact_dir, manifest, quantized=quantized), name=name)

    def _new_state(self, batch: int):
        """Per layer ``[B, 0, C]`` float32 caches and the key-valid mask ``[B, 0]``."""
        import torch

        return {"caches": self._model.empty_cache(batch, 0, CONCAT, dtype=torch.float32),
                "key_valid": torch.zeros(batch, 0, dtype=torch.long)}

    def _forward(self, role, ids, pos, valid):
        import torch

        key_valid = torch.cat((self._state["key_valid"], torch.from_numpy(valid)), dim=1)
        with torch.inference_mode():
            logits, presents = self._model(torch.from_numpy(ids), torch.from_numpy(pos), self._state["caches"],
                                           CONCAT.policy(key_valid))
        self._state = {"caches": presents, "key_valid": key_valid}
        return logits.float().numpy(), [p.float().numpy() for p in presents]


class EngineRunner(TrajectoryRunner):
    """Any engine with :class:`~mla_deploy.engines.base.Engine`'s protocol: ``.config``, ``.layout``,
    ``.new_state(batch)`` and ``.forward(role, input_ids, position_ids, state, valid)`` returning ``logits`` and
    ``present_latent.{i}`` (the rows :meth:`CacheLayout.held <mla_deploy.cache_layout.CacheLayout.held>` gives).

    Args:
        engine: the engine (built once; :meth:`activate` only resets the trajectory).
        name: runner name.
        provider: what executes it, for the report (e.g. ``CPUExecutionProvider``).
    """

    def __init__(self, engine, name: str, provider: str | None = None, prefix: str = "engine-runner"):
        super().__init__(engine.config, engine.layout, name, prefix)
        self.engine = engine
        self.provider = provider or getattr(engine, "provider", None)

    def _new_state(self, batch: int):
        return self.engine.new_state(batch)

    def _forward(self, role, ids, pos, valid):
        out = self.engine.forward(role, ids, pos, self._state, valid)
        return out["logits"], [out[t.present] for t in self.caches]


class OrtRunner(EngineRunner):
    """The artifact run by ONNX Runtime through the project's :class:`OrtEngine`.

    Args:
        artifact_dir: the export directory.
        provider: ``cpu`` or ``cuda`` (the engine refuses a silent fallback).
        threads: intra-op threads (None: ONNX Runtime's default).
        name: runner name (default ``onnxrt``).
        quantized_compute: quantized weights' arithmetic, ``int8`` or ``fp32`` (exact; see
            :func:`~mla_deploy.ort.engine.open_session`).
        use_engine: open the artifact's pre-built CPU engine where :class:`OrtEngine` would (CPU, ``int8``).
        cuda: the CUDA provider's options (None: :class:`~mla_deploy.ort.cuda.CudaOptions`' defaults).
    """

    def __init__(self, artifact_dir: str | Path, provider: str = "cpu", threads: int | None = None,
                 name: str = "onnxrt", quantized_compute: str = FAST_COMPUTE, use_engine: bool = True, cuda=None):
        from ..ort.engine import OrtEngine

        engine = OrtEngine(artifact_dir, provider=provider, threads=threads, quantized_compute=quantized_compute,
                           use_engine=use_engine, cuda=cuda)
        super().__init__(engine, name, engine.provider, prefix="onnxrt-runner")


def trt_runner(artifact_dir: str | Path, name: str = "tensorrt", **kwargs) -> EngineRunner:
    """The artifact's TensorRT engines (built by ``mla-deploy build``) as a runner:
    :class:`~mla_deploy.trt.engine.TrtEngine` ``(artifact_dir, **kwargs)``.

    Raises:
        RuntimeMissingError: TensorRT or a CUDA GPU is missing. ArtifactError: no, stale or unloadable engines.
    """
    from ..trt.engine import TrtEngine

    engine = TrtEngine(artifact_dir, **kwargs)
    return EngineRunner(engine, name, engine.provider, prefix="trt-runner")
