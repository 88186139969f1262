"""A TensorRT engine runner: prefill then greedy decode, the latent cache kept on the GPU as torch tensors.

Same ``generate(prompts, max_new_tokens)`` interface as :class:`mla_deploy.runtime.ort_engine.OrtEngine`.
Every run goes through ``IExecutionContext.execute_async_v3`` on one CUDA stream, after
``set_input_shape`` for each input (the engine's single optimisation profile 0) and ``set_tensor_address``
for every input and output. TensorRT wants non-null, 256-byte-aligned addresses: an empty tensor
(a concat past of length 0) is bound to a 1-element dummy buffer, never to its null ``data_ptr()``.

* ``static`` artifacts: one ``[B, 1, capacity, C]`` buffer per layer. When the engine reports the present
  cache as aliased to the past (``ICudaEngine.get_aliased_input_tensor``, TensorRT >= 10.15, the in-place
  KV-cache update), both are bound to that buffer and a step writes only its new rows. Otherwise the
  present goes to a scratch buffer and only the new rows ``[lengths[b], lengths[b] + S)`` are copied back.
* ``concat`` artifacts: the past ``[B, P, C]`` is bound as is and the engine's present ``[B, P + S, C]``
  replaces it (``attention_mask`` marks right-padding slots, as in the ONNX Runtime engine).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..errors import ArtifactError, CacheCapacityError, InputError, ShapeError

ALIGNMENT = 256
TORCH_DTYPE_NAMES = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT64": "int64", "INT32": "int32",
                     "INT8": "int8", "BOOL": "bool", "UINT8": "uint8"}


def binding_address(tensor, dummy) -> int:
    """The address to bind for ``tensor``: ``dummy``'s for an empty tensor, else its own (checked aligned).

    Raises: ShapeError: a non-contiguous tensor or one whose address is not 256-byte aligned.
    """
    if tensor.numel() == 0:
        return dummy.data_ptr()
    if not tensor.is_contiguous():
        raise ShapeError(f"a TensorRT binding must be contiguous; got strides {tensor.stride()}")
    address = tensor.data_ptr()
    if address % ALIGNMENT:
        raise ShapeError(f"a TensorRT binding must be {ALIGNMENT}-byte aligned; address {address:#x} is not")
    return address


def _host(tensor) -> np.ndarray:
    """A CUDA tensor as a NumPy array (bfloat16, which NumPy lacks, as float32)."""
    import torch

    if tensor.dtype == torch.bfloat16:
        tensor = tensor.float()
    return tensor.detach().cpu().numpy()


def check_in_profile(role: str, name: str, shape: Sequence[int], profile: Sequence[Sequence[int]]) -> None:
    """Raise if ``shape`` is outside the engine's ``(min, opt, max)`` profile for input ``name``.

    Raises: CacheCapacityError: a cache axis beyond the profile. ShapeError: any other axis or the rank.
    """
    lo, _, hi = (tuple(int(d) for d in s) for s in profile)
    shape = tuple(int(d) for d in shape)
    if len(shape) != len(lo):
        raise ShapeError(f"{role} input {name} has rank {len(shape)}, the engine expects {len(lo)}")
    for axis, (d, a, b) in enumerate(zip(shape, lo, hi)):
        if not a <= d <= b:
            kind = CacheCapacityError if ("latent" in name or name == "attention_mask") and axis >= 1 else ShapeError
            raise kind(f"{role} input {name} {list(shape)}: axis {axis} = {d} is outside the engine's profile "
                       f"[{a}, {b}]; rebuild with wider [build] ranges (mla-deploy build)")


def pad_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Right-pad ``prompts``. Returns: ids ``[B, W]`` int64, valid ``[B, W]`` int64, lengths ``[B]`` int64.

    Raises: InputError: no prompt, an empty prompt, or an id outside ``[0, vocab_size)``.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InputError("every prompt needs at least one token id")
    lengths = np.array([len(p) for p in prompts], dtype=np.int64)
    ids = np.zeros((len(prompts), int(lengths.max())), dtype=np.int64)
    valid = np.zeros_like(ids)
    for b, prompt in enumerate(prompts):
        ids[b, : len(prompt)], valid[b, : len(prompt)] = prompt, 1
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise InputError(f"token id {int(bad[0])} is outside the vocabulary [0, {vocab_size})")
    return ids, valid, lengths


@dataclass
class TrtState:
    """The cache of one batch of sequences, on the GPU.

    Attributes:
        lengths: ``[B]`` rows held per sequence (host copy; the next token's position).
        caches: per layer: static ``[B, 1, capacity, C]``; concat ``[B, P, C]``.
        key_valid: concat only: ``[B, P]`` int64 on the GPU, 1 for real tokens, 0 for padding slots.
        scratch: static without aliasing: per layer a ``[B, 1, capacity, C]`` present buffer.
    """

    lengths: np.ndarray
    caches: list
    key_valid: Any = None
    scratch: list = field(default_factory=list)


class TrtEngine:
    """Runs the engines that ``mla-deploy build`` wrote into ``<artifact>/trt``.

    Args:
        artifact: the export directory (``manifest.json`` and ``trt/``).
        device: CUDA device index.
    Raises:
        RuntimeMissingError: no TensorRT or no GPU. ArtifactError: engines missing, stale or unloadable.
    """

    def __init__(self, artifact: str | Path, device: int = 0):
        from ..io_spec import PRECISIONS
        from ..runtime.artifact import load_manifest, manifest_config
        from .build import TRT_DIR, read_build_record, require_tensorrt

        trt, self.gpu = require_tensorrt()
        import torch

        self.trt, self.torch = trt, torch
        self.root = Path(artifact)
        self.manifest = load_manifest(self.root)
        self.config = manifest_config(self.manifest)
        self.record = read_build_record(self.root)
        if self.record.get("fingerprint") != self.manifest.get("fingerprint"):
            raise ArtifactError(f"the engines in {self.root / TRT_DIR} were built for another export "
                                f"(fingerprint {self.record.get('fingerprint')}); run `mla-deploy build {self.root}`")
        if any(g.get("attention") == "plugin" for g in self.manifest["graphs"].values()):
            from .plugin_loader import register_mla_decode_plugin

            register_mla_decode_plugin()  # a JIT plugin's Python must be loaded before deserialising
        self.cache_mode = self.manifest["cache"]["mode"]
        self.precision = self.manifest["precision"]
        self.capacity = int(self.manifest.get("max_cache_length") or 0)
        self.device = torch.device("cuda", device)
        torch.cuda.set_device(self.device)
        self.dtype = getattr(torch, PRECISIONS[self.precision])
        self.stream = torch.cuda.Stream(self.device)
        self.dummy = torch.zeros(ALIGNMENT, dtype=torch.uint8, device=self.device)
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engines, self.contexts, self.aliases, self.profiles = {}, {}, {}, {}
        for role in self.manifest["graphs"]:
            self._load(role, self.root / TRT_DIR / f"{role}.engine")
        self.provider = f"TensorRT {trt.__version__}"

    def _load(self, role: str, path: Path) -> None:
        trt = self.trt
        if not path.is_file():
            raise ArtifactError(f"{path} is missing; run `mla-deploy build {self.root}`")
        engine = self.runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            raise ArtifactError(f"TensorRT {trt.__version__} cannot load {path} (built by TensorRT "
                                f"{self.record.get('tensorrt')}?); run `mla-deploy build {self.root}`")
        context = engine.create_execution_context()
        if context is None:
            raise ArtifactError(f"TensorRT could not create an execution context for {path} (out of GPU memory?)")
        context.set_optimization_profile_async(0, self.stream.cuda_stream)
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        outputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        expected = [t["name"] for t in self.manifest["graphs"][role]["inputs"]]
        if sorted(inputs) != sorted(expected):
            raise ArtifactError(f"{path} has inputs {inputs}, the manifest says {expected}")
        aliases = {}
        if hasattr(engine, "get_aliased_input_tensor"):  # TensorRT >= 10.15
            aliases = {n: engine.get_aliased_input_tensor(n) for n in outputs if engine.get_aliased_input_tensor(n)}
        self.engines[role], self.contexts[role], self.aliases[role] = engine, context, aliases
        self.profiles[role] = {n: engine.get_tensor_profile_shape(n, 0) for n in inputs}

    def _torch_dtype(self, engine, name: str):
        return getattr(self.torch, TORCH_DTYPE_NAMES[engine.get_tensor_dtype(name).name])

    # state ---------------------------------------------------------------------------------
    def new_state(self, batch: int) -> TrtState:
        """An empty cache for ``batch`` sequences (static: zeros of the full capacity)."""
        torch, c, layers = self.torch, self.config.latent_dim, self.config.num_hidden_layers
        lengths = np.zeros(batch, dtype=np.int64)
        if self.cache_mode == "concat":
            caches = [torch.empty((batch, 0, c), dtype=self.dtype, device=self.device) for _ in range(layers)]
            return TrtState(lengths, caches, torch.zeros((batch, 0), dtype=torch.int64, device=self.device))
        shape = (batch, 1, self.capacity, c)
        caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(layers)]
        in_place = all(self.aliases[role].get(f"present_latent.{i}") == f"past_latent.{i}"
                       for role in self.engines for i in range(layers))
        scratch = [] if in_place else [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(layers)]
        return TrtState(lengths, caches, None, scratch)

    # one run -------------------------------------------------------------------------------
    def _execute(self, role: str, inputs: dict, outputs: dict) -> None:
        engine, context = self.engines[role], self.contexts[role]
        for name, tensor in inputs.items():
            check_in_profile(role, name, tensor.shape, self.profiles[role][name])
            if not context.set_input_shape(name, tuple(tensor.shape)):
                raise ShapeError(f"TensorRT refused the shape {list(tensor.shape)} for {role} input {name}")
            context.set_tensor_address(name, binding_address(tensor, self.dummy))
        for name, tensor in outputs.items():
            expected = tuple(context.get_tensor_shape(name))
            if expected != tuple(tensor.shape):
                raise ArtifactError(f"{role} output {name}: the engine computes {list(expected)}, "
                                    f"the runner bound {list(tensor.shape)}")
            context.set_tensor_address(name, binding_address(tensor, self.dummy))
        if not context.execute_async_v3(self.stream.cuda_stream):
            raise ArtifactError(f"TensorRT failed to execute the {role} engine (see its log above)")

    def _output(self, role: str, name: str, shape):
        return self.torch.empty(tuple(shape), dtype=self._torch_dtype(self.engines[role], name), device=self.device)

    def forward(self, role: str, input_ids, position_ids, state: TrtState, valid=None) -> dict[str, np.ndarray]:
        """Run the ``prefill`` or ``decode`` engine on ``S`` new tokens per sequence and update ``state``
        (:meth:`OrtEngine.forward <mla_deploy.runtime.ort_engine.OrtEngine.forward>`'s protocol, host arrays).

        Args:
            input_ids, position_ids: ``[B, S]`` int64.
            state: from :meth:`new_state`; updated in place.
            valid: ``[B, S]``, 1 for real tokens, 0 for right padding (default: all real).
        Returns:
            ``logits [B, S, V]`` and ``present_latent.{i}`` ``[B, T, C]`` on the host (bf16 as float32): concat
            every slot held; static rows ``0 .. max(lengths)``.
        """
        logits = self.step(role, input_ids, position_ids, state, valid)
        self.stream.synchronize()
        if self.cache_mode == "concat":
            rows = list(state.caches)
        else:
            held = int(state.lengths.max(initial=0))
            rows = [cache[:, 0, :held] for cache in state.caches]
        return {"logits": _host(logits), **{f"present_latent.{i}": _host(r) for i, r in enumerate(rows)}}

    def step(self, role: str, input_ids, position_ids, state: TrtState, valid=None):
        """:meth:`forward` without copies to the host: returns the ``[B, S, V]`` logits as a CUDA tensor
        (valid until the next call; work queued on :attr:`stream`)."""
        torch = self.torch
        if not isinstance(input_ids, torch.Tensor):  # host ids are checked here; the runner's own are valid
            host = np.asarray(input_ids)
            if host.size and (host.min() < 0 or host.max() >= self.config.vocab_size):
                raise InputError(f"token id {int(host[(host < 0) | (host >= self.config.vocab_size)][0])} is "
                                 f"outside the vocabulary [0, {self.config.vocab_size})")
        with torch.cuda.stream(self.stream):
            ids = torch.as_tensor(input_ids, dtype=torch.int64).to(self.device).contiguous()
            pos = torch.as_tensor(position_ids, dtype=torch.int64).to(self.device).contiguous()
            batch, steps = ids.shape
            if tuple(pos.shape) != (batch, steps) or batch != len(state.lengths):
                raise ShapeError(f"input_ids {list(ids.shape)} and position_ids {list(pos.shape)} must both be "
                                 f"[{len(state.lengths)}, S]")
            counted = np.ones((batch, steps), np.int64) if valid is None else np.asarray(valid, dtype=np.int64)
            out = self._output(role, "logits", (batch, steps, self.config.vocab_size))
            if self.cache_mode == "concat":
                self._run_concat(role, ids, pos, torch.as_tensor(counted).to(self.device), state, out)
            else:
                self._run_static(role, ids, pos, state, out)
        state.lengths = state.lengths + counted.sum(axis=1)
        return out

    def _run_concat(self, role, ids, pos, valid, state: TrtState, logits) -> None:
        torch = self.torch
        mask = torch.cat((state.key_valid, valid), dim=1).contiguous()
        inputs = {"input_ids": ids, "position_ids": pos, "attention_mask": mask}
        outputs = {"logits": logits}
        total = mask.shape[1]
        for i, cache in enumerate(state.caches):
            inputs[f"past_latent.{i}"] = cache
            outputs[f"present_latent.{i}"] = self._output(role, f"present_latent.{i}",
                                                          (ids.shape[0], total, self.config.latent_dim))
        self._execute(role, inputs, outputs)
        state.caches = [outputs[f"present_latent.{i}"] for i in range(len(state.caches))]
        state.key_valid = mask

    def _run_static(self, role, ids, pos, state: TrtState, logits) -> None:
        torch = self.torch
        steps = ids.shape[1]
        held = int(state.lengths.max(initial=0))
        if held + steps > self.capacity:
            raise CacheCapacityError(f"{held} cached + {steps} new tokens exceed the static cache capacity "
                                     f"{self.capacity}")
        write = torch.as_tensor(state.lengths, dtype=torch.int64).to(self.device)
        inputs = {"input_ids": ids, "position_ids": pos, "write_indices": write}
        outputs = {"logits": logits}
        aliases = self.aliases[role]
        for i, cache in enumerate(state.caches):
            inputs[f"past_latent.{i}"] = cache
            aliased = aliases.get(f"present_latent.{i}") == f"past_latent.{i}"
            outputs[f"present_latent.{i}"] = cache if aliased else state.scratch[i]
        self._execute(role, inputs, outputs)
        rows = None
        for i, cache in enumerate(state.caches):
            present = outputs[f"present_latent.{i}"]
            if present is cache:
                continue
            if rows is None:  # [B, 1, S, C]: slots lengths[b] .. lengths[b] + S - 1
                rows = (write.view(-1, 1) + torch.arange(steps, device=self.device)).view(-1, 1, steps, 1)
                rows = rows.expand(-1, 1, steps, cache.shape[-1])
            cache.scatter_(2, rows, present.gather(2, rows))  # copy only the new rows

    # generation ----------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int):
        """Greedy generation: prefill the (right-padded) prompts, then ``max_new_tokens - 1`` decode steps.

        Returns: a :class:`mla_deploy.runtime.ort_engine.Generation`.
        Raises: InputError: an empty prompt, an id outside the vocabulary, max_new_tokens < 1.
            CacheCapacityError: the static capacity or the engines' profiles are too small.
        """
        from ..runtime.ort_engine import Generation

        torch = self.torch
        if max_new_tokens < 1:
            raise InputError("max_new_tokens must be at least 1")
        ids, valid, lengths = pad_prompts(prompts, self.config.vocab_size)
        batch, width = ids.shape
        if self.cache_mode == "static" and width + max_new_tokens - 1 > self.capacity:
            raise CacheCapacityError(f"a prompt of {width} tokens plus {max_new_tokens} new ones exceeds the "
                                     f"static cache capacity {self.capacity} (export with a larger max_cache_length)")
        state = self.new_state(batch)
        self.stream.synchronize()
        start = time.perf_counter()
        logits = self.step("prefill", ids, np.broadcast_to(np.arange(width), ids.shape), state, valid)
        with torch.cuda.stream(self.stream):
            last = torch.as_tensor(lengths - 1).to(self.device)
            token = logits[torch.arange(batch, device=self.device), last].argmax(-1)
        self.stream.synchronize()
        prefill = time.perf_counter() - start
        tokens = [token]
        start = time.perf_counter()
        for _ in range(max_new_tokens - 1):
            positions = state.lengths[:, None].copy()
            logits = self.step("decode", token[:, None], positions, state)
            with torch.cuda.stream(self.stream):
                token = logits[:, -1].argmax(-1)
            tokens.append(token)
        self.stream.synchronize()
        decode = time.perf_counter() - start
        new = torch.stack(tokens, dim=1).cpu().numpy()
        return Generation([row.tolist() for row in new], prefill, decode, max_new_tokens - 1, self.provider,
                          {"gpu": self.gpu, "aliased": {r: bool(a) for r, a in self.aliases.items()}})

    def info(self) -> dict[str, Any]:
        """What this engine runs: TensorRT version, GPU, precision, cache mode and capacity, aliasing."""
        return {"provider": self.provider, "gpu": self.gpu, "precision": self.precision, "cache_mode": self.cache_mode,
                "capacity": self.capacity if self.cache_mode == "static" else None, "aliases": self.aliases}
