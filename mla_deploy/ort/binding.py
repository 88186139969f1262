"""The engine's IO bindings for an in-place (static) cache, the same code on every provider: each step's inputs and
logits live in ``OrtValue`` buffers on the engine's device, allocated once per binding key and updated in place;
the binding itself is made once per key and only its values are refreshed.

A key is ``(role, batch, new tokens, logits rows, the cache buffers' addresses)``: a decode step at a given batch
over a given state always finds the same binding, which is what a CUDA graph needs (it replays the addresses it
was captured with). The caches themselves are the state's (allocated once per ``(batch, capacity)``:
:meth:`~mla_deploy.ort.engine.OrtEngine.new_state` reuses a dropped state's buffers of the same shape).

* :class:`StepBinding`: one key's binding, its input and logits buffers and its run options (its ``gpu_graph_id``).
* :class:`Bindings`: the bindings of one engine, by key (bindings that run without a CUDA graph are kept for the
  :data:`KEEP` most recent keys; a prefill's prompt width varies with every request).
* :class:`DeviceLogits`: what a step returns: a view of a binding's logits buffer, valid until its next run.
* :class:`TokenChooser`: the token-choice graphs of :mod:`.choice` bound to a step's logits buffer, so that only
  the ids ``[B]`` are copied to the host.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from .cuda import EAGER

#: bindings kept that run without a CUDA graph (a captured one is kept while the engine lives)
KEEP = 8
STEP_INPUTS = ("input_ids", "position_ids", "logits_index")


class DeviceLogits:
    """Logits ``[B, K, V]`` in a binding's buffer (on the engine's device), or ``[B, V]`` when ``K`` is 1 and the
    loop takes ``[:, 0]``. Valid until that binding runs again; :meth:`host` (``np.asarray``) copies them."""

    def __init__(self, engine, value, shape: tuple[int, ...]):
        self.engine, self.value, self.shape = engine, value, tuple(shape)

    @property
    def address(self) -> int:
        return self.value.data_ptr()

    def host(self) -> np.ndarray:
        return self.engine.to_host(self.value).reshape(self.shape)

    def __array__(self, dtype=None, copy=None):
        array = self.host()
        return array if dtype is None else array.astype(dtype)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index):
        # the loop's [:, 0] of a step with one logits row is the same memory, reshaped
        if (isinstance(index, tuple) and len(index) == 2 and index[0] == slice(None) and index[1] == 0
                and len(self.shape) == 3 and self.shape[1] == 1):
            return DeviceLogits(self.engine, self.value, (self.shape[0], self.shape[2]))
        return self.host()[index]


class StepBinding:
    """The IO binding of one key: input buffers, the logits buffer and the caches bound once.

    Attributes:
        binding: the session's ``IOBinding``. inputs: name -> ``OrtValue``. logits: the ``OrtValue`` ``[B, K, V]``.
        graph_id: its ``gpu_graph_id`` (:data:`~.cuda.EAGER`: none). captured: a run under ``graph_id`` succeeded.
    """

    def __init__(self, engine, session, key, shapes: dict, caches, graph_id: int):
        ort, device, element = engine.ort, engine.device, engine.element
        self.key, self.session, self.graph_id, self.captured = key, session, graph_id, False
        self.binding = session.io_binding()
        self.inputs = {name: ort.OrtValue.ortvalue_from_shape_and_type(list(shape), np.int64, device,
                                                                      engine.device_id)
                       for name, shape in shapes.items()}
        for name, value in self.inputs.items():
            self.binding.bind_ortvalue_input(name, value)
        batch, rows = shapes["logits_index"]
        self.logits = ort.OrtValue.ortvalue_from_shape_and_type([batch, rows, engine.config.vocab_size], element,
                                                                device, engine.device_id)
        self.binding.bind_ortvalue_output("logits", self.logits)
        for tensor, cache in zip(engine.cache_tensors, caches, strict=True):
            if hasattr(cache, "address"):  # some rows of a larger state's buffer, bound by address (_Rows)
                self.binding.bind_input(tensor.past, device, engine.device_id, element, cache.shape, cache.address)
                self.binding.bind_output(tensor.present, device, engine.device_id, element, cache.shape,
                                         cache.address)
                continue
            self.binding.bind_ortvalue_input(tensor.past, cache)
            self.binding.bind_ortvalue_output(tensor.present, cache)  # the same buffer: updated in place
        self.run_options = engine.new_run_options(graph_id)

    def update(self, values: dict[str, np.ndarray]) -> None:
        """Copy this step's host inputs into the bound buffers (their addresses do not change)."""
        for name, array in values.items():
            self.inputs[name].update_inplace(np.ascontiguousarray(array, dtype=np.int64))

    def run(self) -> None:
        self.session.run_with_iobinding(self.binding, self.run_options)


class Bindings:
    """The :class:`StepBinding` of each key of one engine (see the module docstring).

    Attributes:
        made: how many bindings were made (a decode at one batch over one state makes one, whatever its steps).
    """

    def __init__(self, engine):
        self.engine = engine
        self.kept: OrderedDict = OrderedDict()
        self.made = 0

    @staticmethod
    def key(role: str, control_name: str, ids: np.ndarray, logits_index: np.ndarray, control: np.ndarray, caches):
        addresses = tuple((c.address, tuple(c.shape)) if hasattr(c, "address") else (c.data_ptr(), tuple(c.shape()))
                          for c in caches)
        return role, ids.shape, logits_index.shape, control_name, control.shape, addresses

    def get(self, role: str, session, ids, positions, logits_index, control_name: str, control, caches,
            graph_id) -> StepBinding:
        """The binding of this step's key (made on first use), its inputs refreshed with the step's values.
        ``graph_id(key)``: the id a new binding is captured under."""
        key = self.key(role, control_name, ids, logits_index, control, caches)
        step = self.kept.get(key)
        if step is None:
            shapes = {"input_ids": ids.shape, "position_ids": positions.shape, "logits_index": logits_index.shape,
                      control_name: control.shape}
            step = StepBinding(self.engine, session, key, shapes, caches, graph_id(key))
            self.made += 1
            self.kept[key] = step
            self._evict()
        self.kept.move_to_end(key)
        step.update({"input_ids": ids, "position_ids": positions, "logits_index": logits_index, control_name: control})
        return step

    def _evict(self) -> None:
        eager = [k for k, s in self.kept.items() if s.graph_id == EAGER]
        for key in eager[: max(0, len(eager) - KEEP)]:
            del self.kept[key]

    def forget(self) -> None:
        self.kept.clear()


class TokenChooser:
    """Greedy and sampled token choice on the engine's provider (the graphs of :mod:`.choice`), bound to the
    logits buffer of the step that made them; only ``ids [B]`` int64 is copied to the host.

    One session per ``(kind, batch, top_k)``, opened on first use with the engine's provider and options (never
    captured as a CUDA graph: one or a few kernels, and its logits input moves between bindings).
    """

    def __init__(self, engine):
        self.engine = engine
        self.sessions: dict = {}

    def _session(self, kind: str, batch: int, top_k: int | None):
        key = (kind, batch, top_k)
        if key not in self.sessions:
            from . import choice

            engine = self.engine
            vocab, elem = engine.config.vocab_size, engine.onnx_element
            model = (choice.greedy_graph(batch, vocab, elem) if kind == "greedy"
                     else choice.sampling_graph(batch, vocab, elem, top_k))
            session = engine.open_helper_session(model.SerializeToString())
            binding = session.io_binding()
            ids = engine.ort.OrtValue.ortvalue_from_shape_and_type([batch], np.int64, engine.device, engine.device_id)
            binding.bind_ortvalue_output("ids", ids)
            extra = {}
            if kind == "sample":
                for name, shape in (("temperature", [1]), ("top_p", [1]), ("uniforms", [batch])):
                    extra[name] = engine.ort.OrtValue.ortvalue_from_shape_and_type(shape, np.float32, engine.device,
                                                                                  engine.device_id)
                    binding.bind_ortvalue_input(name, extra[name])
            self.sessions[key] = [session, binding, ids, extra, None]
        return self.sessions[key]

    def _run(self, entry, logits: DeviceLogits) -> np.ndarray:
        session, binding, ids, _, bound = entry
        if bound != logits.address:  # another step binding's logits: rebind the input, nothing is allocated
            engine = self.engine
            binding.bind_input("logits", engine.device, engine.device_id, engine.element, list(logits.shape),
                               logits.address)
            entry[4] = logits.address
        session.run_with_iobinding(binding, self.engine.new_run_options(None))  # never a capturing session
        return np.array(ids.numpy(), dtype=np.int64)

    def argmax(self, logits: DeviceLogits) -> np.ndarray:
        return self._run(self._session("greedy", logits.shape[0], None), logits)

    def sample(self, logits: DeviceLogits, config, uniforms: np.ndarray) -> np.ndarray:
        entry = self._session("sample", logits.shape[0], config.top_k)
        extra = entry[3]
        extra["temperature"].update_inplace(np.array([config.temperature], np.float32))
        extra["top_p"].update_inplace(np.array([config.top_p], np.float32))
        extra["uniforms"].update_inplace(np.ascontiguousarray(uniforms, dtype=np.float32))
        return self._run(entry, logits)
