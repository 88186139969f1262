"""The exported absorbed graph (:mod:`.graph`) in ONNX Runtime, in a session as
:class:`~mla_deploy.ort.engine.OrtEngine` opens it (``open_session``: ``session.intra_op.allow_spinning = 0``,
sequential execution, every graph optimisation), every input and output bound through IO binding.

The cache layout decides the buffers (:func:`~.inputs.point_state`) and the control input:

* a growing layout (concat): the past ``[B, T, C]`` and a preallocated present ``[B, T+1, C]`` (ONNX ``Concat``
  writes into it); the ``attention_mask`` is all ones.
* an in-place layout (static): one ``[B, 1, T + margin, C]`` buffer per layer, wrapped (not copied) in an
  ``OrtValue`` and bound as both ``past_latent.i`` and ``present_latent.i``, so ``TensorScatter`` writes row T in
  place. After the first step the path checks that the row landed in that very buffer and that the rows before
  it are unchanged.
"""

from __future__ import annotations

import numpy as np

from ...cache_layout import CacheLayout, get_layout
from ...io_spec import past_name, present_name
from .inputs import PointInputs, held_rows, point_state

#: ONNX Runtime logs "TensorScatter: in-place optimization not activated, copying ..." when it copies the cache
COPY_WARNING = "in-place optimization not activated"
#: ONNX Runtime's log severity in the bench: 2 lets warnings (the copy warning above) reach stderr
LOG_SEVERITY = 2


class OrtPath:
    """The ``ort-*`` paths. Args: graph: the exported ``.onnx``; layout: its cache layout (or mode name);
    threads: intra-op threads; margin: fixed-capacity layouts hold ``T + margin`` slots."""

    def __init__(self, graph: str, layout: CacheLayout | str, threads: int, margin: int):
        from ...ort.engine import open_session, require_onnxruntime

        self.ort = ort = require_onnxruntime()
        self.layout, self.margin = get_layout(layout), margin
        self.session = open_session(graph, "cpu", threads, LOG_SEVERITY)
        self.run_options = ort.RunOptions()
        self.run_options.log_severity_level = LOG_SEVERITY
        self.provider = self.session.get_providers()[0]

    def setup(self, inputs: PointInputs) -> None:
        ort, layout = self.ort, self.layout
        b, t = inputs.batch, inputs.context
        self.context = t
        self.x = np.ascontiguousarray(inputs.hidden.numpy())
        self.out = np.zeros_like(self.x)
        self.state = point_state(layout, inputs, self.margin, lambda shape: np.zeros(shape, dtype=np.float32),
                                 lambda rows: np.ascontiguousarray(rows.numpy()))
        new = np.ones((b, 1), dtype=np.int64)  # one real token per sequence
        io = self.session.io_binding()
        io.bind_cpu_input("hidden_states", self.x)
        io.bind_cpu_input("position_ids", inputs.positions.numpy())
        io.bind_cpu_input(layout.control, layout.control_input(self.state, new))
        stride = max(1, t // 64)
        self.buffers, self.presents, self.values = [], [], []
        self.samples = [held_rows(layout, past, t)[:, ::stride].copy() for past in self.state.caches]
        for i, past in enumerate(self.state.caches):
            value = ort.OrtValue.ortvalue_from_numpy(past)  # wraps past's memory
            present, out_value = past, value  # in place: the same buffer is the present
            if not layout.in_place:
                present = np.empty(layout.cache_shape(b, t + 1, past.shape[-1]), dtype=np.float32)
                out_value = ort.OrtValue.ortvalue_from_numpy(present)
            io.bind_ortvalue_input(past_name(i), value)
            io.bind_ortvalue_output(present_name(i), out_value)
            self.buffers.append(past)
            self.presents.append(present)
            self.values.append((value, out_value))
        self.out_value = ort.OrtValue.ortvalue_from_numpy(self.out)
        io.bind_ortvalue_output("output", self.out_value)
        self.io = io
        self._checks = None

    def step(self) -> None:
        self.session.run_with_iobinding(self.io, self.run_options)
        if self._checks is None:
            self._checks = self._check_first_step()

    def _check_first_step(self) -> dict:
        """After the first step: did the cache rows land where they should, without a copy of the cache?"""
        layout, t = self.layout, self.context
        if not layout.in_place:
            exact = all(np.array_equal(held_rows(layout, present, t + 1)[:, :t], held_rows(layout, past, t))
                        for past, present in zip(self.buffers, self.presents))
            return {"present_written_into_bound_buffer": bool(exact)}
        slots = [held_rows(layout, buf, buf.shape[-2]) for buf in self.buffers]  # every slot, [B, T + margin, C]
        same = all(out.data_ptr() == buf.ctypes.data for (_, out), buf in zip(self.values, self.buffers))
        row_written = all(bool(np.any(rows[:, t] != 0)) for rows in slots)
        untouched = all(not np.any(rows[:, t + 1:]) for rows in slots)
        kept = all(np.array_equal(rows[:, :t:max(1, t // 64)], sample) for rows, sample in zip(slots, self.samples))
        return {"in_place": bool(same and row_written and untouched and kept), "same_buffer_in_and_out": same,
                "row_T_written_into_bound_buffer": row_written, "rows_after_T_untouched": untouched,
                "past_rows_unchanged": kept}

    def output(self) -> np.ndarray:
        return self.out.copy()

    def checks(self) -> dict:
        return dict(self._checks or {})

    def teardown(self) -> None:
        self.io = self.buffers = self.presents = self.values = self.samples = self.out_value = self.state = None
