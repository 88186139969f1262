"""An ONNX Runtime engine that owns the latent cache, runs prefill then decode, and generates greedily.

* ``concat`` artifacts: the cache is a NumPy array per layer ``[B, P, C]`` that grows by the step's
  rows; ``attention_mask [B, P+S]`` marks the padded slots of shorter sequences.
* ``static`` artifacts: the cache is one ONNX Runtime buffer per layer ``[B, 1, capacity, C]`` bound
  as both ``past_latent.{i}`` and ``present_latent.{i}`` (IO binding), so ``TensorScatter`` writes the
  new rows in place and a decode step never copies the cache. ``write_indices [B]`` = rows already held.

Batches of different prompt lengths are right-padded; each sequence continues from its own length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..errors import CacheCapacityError, InputError, RuntimeMissingError, ShapeError, ArtifactError
from ..io_spec import PRECISIONS, past_name, present_name
from .artifact import load_manifest, manifest_config

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def _np_dtype(precision: str):
    if precision == "bf16":
        try:
            import ml_dtypes

            return ml_dtypes.bfloat16
        except ImportError as exc:  # pragma: no cover - onnx depends on ml_dtypes
            raise RuntimeMissingError("bf16 caches need the ml_dtypes package") from exc
    return np.dtype(PRECISIONS[precision])


@dataclass
class EngineState:
    """The cache of one batch of sequences.

    Attributes:
        lengths: ``[B]`` rows held per sequence (= position of its next token).
        caches: per layer: concat ``np.ndarray [B, P, C]``; static ``OrtValue [B, 1, capacity, C]``.
        key_valid: concat only: ``[B, P]`` int64, 1 for real tokens, 0 for padding slots.
    """

    lengths: np.ndarray
    caches: list
    key_valid: np.ndarray | None = None


@dataclass
class Generation:
    """Result of :meth:`OrtEngine.generate`.

    Attributes:
        tokens: the new ids of each sequence.
        prefill_seconds: time of the prefill run.
        decode_seconds: time of all decode steps.
        decode_steps: number of decode runs.
        provider: the execution provider that ran.
    """

    tokens: list[list[int]]
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    provider: str
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: new tokens of all sequences per second of decode."""
        if not self.decode_seconds:
            return float("nan")
        return self.decode_steps * len(self.tokens) / self.decode_seconds


class OrtEngine:
    """Runs an exported artifact with ONNX Runtime.

    Args:
        artifact: the export directory (holding ``manifest.json``).
        provider: ``cpu`` or ``cuda``; an engine whose session falls back to another provider is refused.
        threads: intra-op threads (None: ONNX Runtime's default).
        capacity: static mode: cache rows per sequence (default: the manifest's ``max_cache_length``).
        log_severity: ONNX Runtime's log level (0 verbose .. 4 fatal).
    """

    def __init__(self, artifact: str | Path, provider: str = "cpu", threads: int | None = None,
                 capacity: int | None = None, log_severity: int = 3):
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise RuntimeMissingError("onnxruntime is not installed (pip install onnxruntime-gpu)") from exc
        if provider not in PROVIDERS:
            raise InputError(f"provider must be one of {', '.join(PROVIDERS)}, got {provider!r}")
        self.root = Path(artifact)
        self.manifest = load_manifest(self.root)
        self.config = manifest_config(self.manifest)
        self.cache_mode = self.manifest["cache"]["mode"]
        self.precision = self.manifest["precision"]
        self.dtype = _np_dtype(self.precision)
        self.capacity = int(capacity or self.manifest.get("max_cache_length") or 0)
        self.device = "cuda" if provider == "cuda" else "cpu"
        options = ort.SessionOptions()
        options.log_severity_level = log_severity
        if threads:
            options.intra_op_num_threads = threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.run_options = ort.RunOptions()
        self.run_options.log_severity_level = log_severity
        wanted = PROVIDERS[provider]
        self.sessions = {}
        for role, graph in self.manifest["graphs"].items():
            if graph.get("attention", "standard") != "standard":
                raise RuntimeMissingError(f"{graph['file']} holds the TensorRT MlaDecode plugin node, which ONNX "
                                          f"Runtime cannot run; export with [export] decode_attention = \"standard\" "
                                          f"for ONNX Runtime, or build it with `mla-deploy build`")
            try:
                session = ort.InferenceSession(str(self.root / graph["file"]), options,
                                               providers=list(dict.fromkeys([wanted, "CPUExecutionProvider"])))
            except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types
                raise ArtifactError(f"ONNX Runtime cannot load {graph['file']}: {str(exc).splitlines()[0]}") from exc
            if session.get_providers()[0] != wanted:
                raise RuntimeMissingError(f"ONNX Runtime could not use {wanted} (it fell back to "
                                          f"{session.get_providers()[0]}); run `mla-deploy doctor`")
            self._check_io(role, session, graph)
            self.sessions[role] = session
        self.provider = wanted

    def _check_io(self, role: str, session, graph: dict) -> None:
        names = [i.name for i in session.get_inputs()], [o.name for o in session.get_outputs()]
        expected = [t["name"] for t in graph["inputs"]], [t["name"] for t in graph["outputs"]]
        if names != expected:
            raise ArtifactError(f"{graph['file']} does not match manifest.json: graph inputs/outputs {names}, "
                                f"manifest {expected}")

    # state ---------------------------------------------------------------------------------
    def new_state(self, batch: int) -> EngineState:
        """An empty cache for ``batch`` sequences."""
        c, layers = self.config.latent_dim, self.config.num_hidden_layers
        lengths = np.zeros(batch, dtype=np.int64)
        if self.cache_mode == "concat":
            caches = [np.zeros((batch, 0, c), dtype=self.dtype) for _ in range(layers)]
            return EngineState(lengths, caches, np.zeros((batch, 0), dtype=np.int64))
        import onnxruntime as ort

        if self.capacity < 1:
            raise CacheCapacityError("static cache needs a capacity (the manifest has none; pass capacity=)")
        caches = [ort.OrtValue.ortvalue_from_numpy(np.zeros((batch, 1, self.capacity, c), dtype=self.dtype),
                                                   self.device, 0) for _ in range(layers)]
        return EngineState(lengths, caches)

    # one run -------------------------------------------------------------------------------
    def forward(self, role: str, input_ids: np.ndarray, position_ids: np.ndarray, state: EngineState,
                valid: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Run the ``prefill`` or ``decode`` graph on ``S`` new tokens per sequence and update ``state``.

        Args:
            input_ids, position_ids: ``[B, S]`` int64.
            state: from :meth:`new_state`; updated in place.
            valid: ``[B, S]``, 1 for real tokens, 0 for right padding (default: all real).
        Returns:
            ``logits [B, S, V]`` and ``present_latent.{i}`` ``[B, T, C]`` (the rows held after the step;
            static mode: rows ``0 .. max(lengths)``).
        """
        ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        pos = np.ascontiguousarray(position_ids, dtype=np.int64)
        batch, steps = ids.shape
        if pos.shape != ids.shape or batch != len(state.lengths):
            raise ShapeError(f"input_ids {ids.shape} and position_ids {pos.shape} must both be "
                             f"[{len(state.lengths)}, S]")
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            bad = ids[(ids < 0) | (ids >= self.config.vocab_size)][0]
            raise InputError(f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")
        valid = np.ones_like(ids) if valid is None else np.ascontiguousarray(valid, dtype=np.int64)
        session = self.sessions[role]
        if self.cache_mode == "concat":
            out = self._run_concat(session, ids, pos, valid, state)
        else:
            out = self._run_static(session, ids, pos, state)
        state.lengths = state.lengths + valid.sum(axis=1)
        return out

    def _run_concat(self, session, ids, pos, valid, state: EngineState) -> dict[str, np.ndarray]:
        mask = np.concatenate((state.key_valid, valid), axis=1)
        feed = {"input_ids": ids, "position_ids": pos, "attention_mask": mask}
        for i, cache in enumerate(state.caches):
            if cache.shape[-1] != self.config.latent_dim:
                raise ShapeError(f"{past_name(i)} has width {cache.shape[-1]}, expected {self.config.latent_dim}")
            feed[past_name(i)] = cache
        results = session.run(None, feed, self.run_options)
        state.caches, state.key_valid = results[1:], mask
        return {"logits": results[0], **{present_name(i): r for i, r in enumerate(results[1:])}}

    def _run_static(self, session, ids, pos, state: EngineState) -> dict[str, np.ndarray]:
        steps = ids.shape[1]
        if int(state.lengths.max(initial=0)) + steps > self.capacity:
            raise CacheCapacityError(f"{int(state.lengths.max())} cached + {steps} new tokens exceed the static "
                                     f"cache capacity {self.capacity}")
        binding = session.io_binding()
        binding.bind_output("logits", "cpu")  # outputs come back in binding order: logits first
        binding.bind_cpu_input("input_ids", ids)
        binding.bind_cpu_input("position_ids", pos)
        binding.bind_cpu_input("write_indices", np.ascontiguousarray(state.lengths, dtype=np.int64))
        for i, cache in enumerate(state.caches):
            binding.bind_ortvalue_input(past_name(i), cache)
            binding.bind_ortvalue_output(present_name(i), cache)  # same buffer: updated in place
        session.run_with_iobinding(binding, self.run_options)
        logits = binding.get_outputs()[0].numpy()
        held = int((state.lengths + steps).max())
        rows = {present_name(i): c.numpy()[:, 0, :held] for i, c in enumerate(state.caches)}
        return {"logits": logits, **rows}

    # generation ----------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> Generation:
        """Greedy generation: prefill the (right-padded) prompts, then ``max_new_tokens - 1`` decode steps.

        Args:
            prompts: B lists of token ids, lengths may differ.
            max_new_tokens: new tokens per sequence (>= 1).
        Raises:
            InputError: empty prompt or id outside the vocabulary. CacheCapacityError: a static cache too small.
        """
        if not prompts or any(len(p) == 0 for p in prompts):
            raise InputError("every prompt needs at least one token id")
        if max_new_tokens < 1:
            raise InputError("max_new_tokens must be at least 1")
        lengths = np.array([len(p) for p in prompts], dtype=np.int64)
        width = int(lengths.max())
        if self.cache_mode == "static" and width + max_new_tokens - 1 > self.capacity:
            raise CacheCapacityError(f"a prompt of {width} tokens plus {max_new_tokens} new ones exceeds the "
                                     f"static cache capacity {self.capacity} (export with a larger max_cache_length)")
        ids = np.zeros((len(prompts), width), dtype=np.int64)
        valid = np.zeros_like(ids)
        for b, prompt in enumerate(prompts):
            ids[b, : len(prompt)], valid[b, : len(prompt)] = prompt, 1
        state = self.new_state(len(prompts))
        start = time.perf_counter()
        out = self.forward("prefill", ids, np.broadcast_to(np.arange(width), ids.shape), state, valid)
        prefill = time.perf_counter() - start
        token = out["logits"][np.arange(len(prompts)), lengths - 1].argmax(-1)
        tokens = [token]
        start = time.perf_counter()
        for _ in range(max_new_tokens - 1):
            out = self.forward("decode", token[:, None], state.lengths[:, None].copy(), state)
            token = out["logits"][:, -1].argmax(-1)
            tokens.append(token)
        decode = time.perf_counter() - start
        new = np.stack(tokens, axis=1)
        return Generation([row.tolist() for row in new], prefill, decode, max_new_tokens - 1, self.provider)

    def info(self) -> dict[str, Any]:
        """What this engine runs: provider, precision, cache mode and capacity."""
        return {"provider": self.provider, "precision": self.precision, "cache_mode": self.cache_mode,
                "capacity": self.capacity if self.cache_mode == "static" else None}
