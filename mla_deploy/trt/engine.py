"""The TensorRT engine: binds the latent cache (CUDA torch tensors) and runs the engines that ``mla-deploy build``
wrote; the input checks, the cache state and capacity checks, and prefill and decode for the generation loop are
:class:`~mla_deploy.engines.base.Engine`'s.

Every run goes through ``IExecutionContext.execute_async_v3`` on one CUDA stream, after ``set_input_shape`` for
each input and ``set_tensor_address`` for every input and output. Each role has its own execution context on its
own optimisation profile (``build.json``'s ``roles``): a graph serving prefill and decode is one engine, loaded
once, with one context per profile.
TensorRT wants non-null, 256-byte-aligned addresses: an empty tensor (a growing past of length 0) is bound to a
dummy buffer, never to its null ``data_ptr()``.

* An in-place (``static``) layout: one ``[B, 1, capacity, C]`` buffer per layer. When the engine reports the
  present cache as aliased to the past (``ICudaEngine.get_aliased_input_tensor``, TensorRT >= 10.15, the in-place
  KV-cache update), both are bound to that buffer and a step writes only its new rows. Otherwise the present goes
  to a scratch buffer and only the new rows ``[lengths[b], lengths[b] + S)`` are copied back.
* A growing (``concat``) layout: the past ``[B, P, C]`` is bound as is and the engine's present ``[B, P + S, C]``
  (shape computed by TensorRT from the input shapes) replaces it; ``attention_mask`` marks right-padding slots.

The control input (``attention_mask`` or ``write_indices``) comes from the layout as a host int64 array and is
uploaded with the ids and positions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..artifact import load_manifest
from ..cache_layout import CacheState
from ..errors import ArtifactError, CacheCapacityError, ShapeError
from ..engines.base import Engine

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


class TrtEngine(Engine):
    """Runs the engines that ``mla-deploy build`` wrote into ``<artifact>/trt``.

    Args:
        artifact: the export directory (``manifest.json`` and ``trt/``).
        device: CUDA device index.
        prefill_chunk: the most prompt tokens per sequence in one prefill call (None: the scores' budget of
            :meth:`Engine.prefill <mla_deploy.engines.base.Engine.prefill>`); never more than the prefill profile's
            largest ``prompt_length``, so a longer prompt is prefilled in chunks of that.
    Raises:
        RuntimeMissingError: no TensorRT or no GPU. ArtifactError: engines missing, stale or unloadable.
    """

    def __init__(self, artifact: str | Path, device: int = 0, prefill_chunk: int | None = None):
        from .build import TRT_DIR, read_build_record, require_tensorrt

        trt, self.gpu = require_tensorrt()
        import torch

        manifest = load_manifest(artifact)
        super().__init__(artifact, manifest, prefill_chunk=prefill_chunk)
        self.trt, self.torch = trt, torch
        self.record = read_build_record(self.root)
        if self.record.get("fingerprint") != manifest.fingerprint:
            raise ArtifactError(f"the engines in {self.root / TRT_DIR} were built for another export "
                                f"(fingerprint {self.record.get('fingerprint')}); run `mla-deploy build {self.root}`")
        if manifest.uses_plugin:
            from ..trt.plugin_loader import register_mla_decode_plugin

            register_mla_decode_plugin()  # a JIT plugin's Python must be loaded before deserialising
        self.device = torch.device("cuda", device)
        torch.cuda.set_device(self.device)
        self.dtype = getattr(torch, manifest.dtype)
        self.stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self.stream):
            self.dummy = torch.zeros(ALIGNMENT, dtype=torch.uint8, device=self.device)
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engines, self.contexts, self.aliases, self.profiles = {}, {}, {}, {}
        loaded: dict[str, Any] = {}  # one deserialised engine per file: a graph serving two roles is loaded once
        roles = self.record.get("roles") or {}
        for role in manifest.graphs:
            if role not in roles:
                raise ArtifactError(f"{self.root / TRT_DIR} has no engine for {role}; run `mla-deploy build {self.root}`")
            file, profile = roles[role]["engine"], int(roles[role]["profile"])
            if file not in loaded:
                loaded[file] = self._deserialize(self.root / TRT_DIR / file)
            self._attach(role, loaded[file], profile, file)
        self.provider = f"TensorRT {trt.__version__}"

    def _deserialize(self, path: Path):
        if not path.is_file():
            raise ArtifactError(f"{path} is missing; run `mla-deploy build {self.root}`")
        engine = self.runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            raise ArtifactError(f"TensorRT {self.trt.__version__} cannot load {path} (built by TensorRT "
                                f"{self.record.get('tensorrt')}?); run `mla-deploy build {self.root}`")
        return engine

    def _attach(self, role: str, engine, profile: int, path: str) -> None:
        """An execution context of ``engine`` for ``role``, on its optimisation profile ``profile`` (each role of a
        shared engine has its own context and profile)."""
        trt = self.trt
        if not 0 <= profile < engine.num_optimization_profiles:
            raise ArtifactError(f"{path} has {engine.num_optimization_profiles} profiles, build.json names profile "
                                f"{profile} for {role}; run `mla-deploy build {self.root}`")
        context = engine.create_execution_context()
        if context is None:
            raise ArtifactError(f"TensorRT could not create an execution context for {path} (out of GPU memory?)")
        context.set_optimization_profile_async(profile, self.stream.cuda_stream)
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        outputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        expected = self.manifest.graph(role).input_names
        if sorted(inputs) != sorted(expected):
            raise ArtifactError(f"{path} has inputs {inputs}, the manifest says {expected}")
        aliases = {}
        if hasattr(engine, "get_aliased_input_tensor"):  # TensorRT >= 10.15
            aliases = {n: engine.get_aliased_input_tensor(n) for n in outputs if engine.get_aliased_input_tensor(n)}
        self.engines[role], self.contexts[role], self.aliases[role] = engine, context, aliases
        self.profiles[role] = {n: engine.get_tensor_profile_shape(n, profile) for n in inputs}

    def _aliased(self, role: str, layer: int) -> bool:
        """``role``'s engine writes ``present_latent.{layer}`` into the ``past_latent.{layer}`` buffer."""
        return self.aliases[role].get(self.cache_tensors[layer].present) == self.cache_tensors[layer].past

    def _all_aliased(self) -> bool:
        return all(self._aliased(role, i) for role in self.engines for i in range(len(self.cache_tensors)))

    # runtime interface ---------------------------------------------------------------------------
    def _allocate(self, shape):
        with self.torch.cuda.stream(self.stream):
            return self.torch.zeros(tuple(shape), dtype=self.dtype, device=self.device)

    resizable_capacity = False  # the engine's profile fixes the capacity axis at the exported max_cache_length

    def _prefill_limit(self) -> int | None:
        """The prefill profile's largest sequence length (``[build] prompt_length``'s max): a longer prompt is
        prefilled in chunks of it."""
        shape = self.profiles.get("prefill", {}).get("input_ids")
        return int(shape[2][1]) if shape is not None else None

    def new_state(self, batch: int, rows: int | None = None) -> CacheState:
        """An empty cache for ``batch`` sequences; an in-place layout whose engines do not alias the present
        to the past also gets one scratch present buffer per layer (``state.extra["scratch"]``)."""
        state = super().new_state(batch, rows)
        if self.layout.in_place and not self._all_aliased():
            with self.torch.cuda.stream(self.stream):
                state.extra["scratch"] = [self.torch.empty_like(cache) for cache in state.caches]
        return state

    def _upload(self, array: np.ndarray):
        """A host int64 array as a CUDA tensor (queued on :attr:`stream`; call inside its context)."""
        host = self.torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
        return host.to(self.device)

    def _run(self, role, ids, positions, logits_index, control, state):
        torch = self.torch
        batch, steps = ids.shape
        with torch.cuda.stream(self.stream):
            inputs = {"input_ids": self._upload(ids), "position_ids": self._upload(positions),
                      "logits_index": self._upload(logits_index), self.layout.control: self._upload(control)}
            inputs.update((t.past, cache) for t, cache in zip(self.cache_tensors, state.caches))
            self._set_inputs(role, inputs)
            outputs = {"logits": self._output(role, "logits", (batch, logits_index.shape[1], self.config.vocab_size))}
            for i, cache in enumerate(state.caches):
                outputs[self.cache_tensors[i].present] = self._present(role, i, cache, state)
            self._execute(role, outputs)
            presents = [outputs[t.present] for t in self.cache_tensors]
            if self.layout.in_place:
                self._copy_new_rows(state, presents, steps)
                presents = list(state.caches)
        return outputs["logits"], presents

    def _present(self, role: str, layer: int, cache, state: CacheState):
        """The buffer bound as ``present_latent.{layer}``: the past itself (aliased in place), the scratch buffer
        (in place without aliasing), or a new tensor of the shape TensorRT computes (a growing cache)."""
        if not self.layout.in_place:
            shape = tuple(self.contexts[role].get_tensor_shape(self.cache_tensors[layer].present))
            same = len(shape) == cache.dim() and shape[0] == cache.shape[0] and shape[-1] == cache.shape[-1]
            if not same or min(shape) < 0:
                raise ArtifactError(f"{role} output {self.cache_tensors[layer].present}: the engine computes {list(shape)} for a "
                                    f"past of {list(cache.shape)}")
            return self._output(role, self.cache_tensors[layer].present, shape)
        if self._aliased(role, layer):
            return cache
        return state.extra["scratch"][layer]

    def _copy_new_rows(self, state: CacheState, presents: list, steps: int) -> None:
        """Copy the rows a step wrote into scratch presents, ``[lengths[b], lengths[b] + S)``, to the caches."""
        torch, rows = self.torch, None
        for cache, present in zip(state.caches, presents):
            if present is cache:
                continue
            if rows is None:  # [B, 1, S, C]: slots lengths[b] .. lengths[b] + S - 1
                start = self._upload(state.lengths)
                rows = (start.view(-1, 1) + torch.arange(steps, device=self.device)).view(-1, 1, steps, 1)
                rows = rows.expand(-1, 1, steps, cache.shape[-1])
            cache.scatter_(2, rows, present.gather(2, rows))

    def _set_inputs(self, role: str, inputs: dict) -> None:
        context = self.contexts[role]
        for name, tensor in inputs.items():
            check_in_profile(role, name, tensor.shape, self.profiles[role][name])
            if not context.set_input_shape(name, tuple(tensor.shape)):
                raise ShapeError(f"TensorRT refused the shape {list(tensor.shape)} for {role} input {name}")
            context.set_tensor_address(name, binding_address(tensor, self.dummy))

    def _execute(self, role: str, outputs: dict) -> None:
        context = self.contexts[role]
        for name, tensor in outputs.items():
            expected = tuple(context.get_tensor_shape(name))
            if expected != tuple(tensor.shape):
                raise ArtifactError(f"{role} output {name}: the engine computes {list(expected)}, "
                                    f"the runner bound {list(tensor.shape)}")
            context.set_tensor_address(name, binding_address(tensor, self.dummy))
        if not context.execute_async_v3(self.stream.cuda_stream):
            raise ArtifactError(f"TensorRT failed to execute the {role} engine (see its log above)")

    def _output(self, role: str, name: str, shape):
        dtype = getattr(self.torch, TORCH_DTYPE_NAMES[self.engines[role].get_tensor_dtype(name).name])
        return self.torch.empty(tuple(shape), dtype=dtype, device=self.device)

    def to_host(self, array) -> np.ndarray:
        """A CUDA tensor as a NumPy array (bfloat16, which NumPy lacks, as float32)."""
        torch = self.torch
        if not isinstance(array, torch.Tensor):
            return np.asarray(array)
        with torch.cuda.stream(self.stream):
            if array.dtype == torch.bfloat16:
                array = array.float()
            return array.detach().cpu().numpy()

    def argmax(self, logits) -> np.ndarray:
        """``[B]`` int64: the argmax of ``logits [B, V]`` taken on the GPU (only ``B`` ids are copied back)."""
        with self.torch.cuda.stream(self.stream):
            return logits.argmax(-1).cpu().numpy().astype(np.int64)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def info(self) -> dict[str, Any]:
        """What this engine runs: TensorRT version, GPU, precision, cache mode and capacity, and per role whether
        its engine writes the present cache into the past's buffer (aliased) and which outputs it aliases."""
        return {**super().info(), "gpu": self.gpu, "aliased": {role: bool(a) for role, a in self.aliases.items()},
                "aliases": self.aliases}
