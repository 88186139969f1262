"""The exported absorbed graph (:mod:`.graph`) in ONNX Runtime, run as :class:`~mla_deploy.runtime.ort_engine.OrtEngine`
runs it: ``session.intra_op.allow_spinning = 0``, every input and output bound through IO binding.

* ``concat``: the past ``[B, T, C]`` and a preallocated present ``[B, T+1, C]`` (ONNX ``Concat`` writes into it).
* ``static``: one ``[B, 1, T + margin, C]`` buffer per layer, wrapped (not copied) in an ``OrtValue`` and bound
  as both ``past_latent.i`` and ``present_latent.i``, so ``TensorScatter`` writes row T in place. After the first
  step the worker checks that the row landed in that very buffer and that the rows before it are unchanged.
"""

from __future__ import annotations

import numpy as np

from ..errors import RuntimeMissingError
from ..io_spec import past_name, present_name
from .inputs import PointInputs

#: ONNX Runtime logs "TensorScatter: in-place optimization not activated, copying ..." when it copies the cache
COPY_WARNING = "in-place optimization not activated"


def make_session(path: str, threads: int, log_severity: int = 2):
    """An ONNX Runtime CPU session: ``threads`` intra-op threads, sequential, no spinning, all graph optimisations."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise RuntimeMissingError("onnxruntime is not installed (pip install onnxruntime-gpu)") from exc
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = log_severity  # 2: warnings reach stderr (the copy warning above)
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


class OrtRunner:
    """Args: graph: the exported ``.onnx``; mode: ``concat`` or ``static``; threads; margin: static capacity - T."""

    def __init__(self, graph: str, mode: str, threads: int, margin: int):
        import onnxruntime as ort

        self.ort = ort
        self.mode, self.margin = mode, margin
        self.session = make_session(graph, threads)
        self.run_options = ort.RunOptions()
        self.run_options.log_severity_level = 2
        if self.session.get_providers()[0] != "CPUExecutionProvider":  # pragma: no cover
            raise RuntimeMissingError(f"ONNX Runtime runs {self.session.get_providers()[0]}, not the CPU provider")
        self.provider = self.session.get_providers()[0]

    def setup(self, inputs: PointInputs) -> None:
        ort = self.ort
        b, t = inputs.batch, inputs.context
        self.context = t
        self.x = np.ascontiguousarray(inputs.hidden.numpy())
        self.out = np.zeros_like(self.x)
        io = self.session.io_binding()
        io.bind_cpu_input("hidden_states", self.x)
        io.bind_cpu_input("position_ids", inputs.positions.numpy())
        self.buffers, self.values, self.samples = [], [], []
        if self.mode == "static":
            io.bind_cpu_input("write_indices", np.full(b, t, dtype=np.int64))
            for i, rows in enumerate(inputs.latent):
                buf = np.zeros((b, 1, t + self.margin, rows.shape[-1]), dtype=np.float32)
                buf[:, 0, :t] = rows.numpy()
                self.samples.append(buf[:, 0, :t:max(1, t // 64)].copy())  # sampled past rows, checked after a step
                value = ort.OrtValue.ortvalue_from_numpy(buf)  # wraps buf's memory
                io.bind_ortvalue_input(past_name(i), value)
                io.bind_ortvalue_output(present_name(i), value)  # the same buffer: updated in place
                self.buffers.append(buf)
                self.values.append(value)
        else:
            for i, rows in enumerate(inputs.latent):
                past = np.ascontiguousarray(rows.numpy())
                present = np.empty((b, t + 1, past.shape[-1]), dtype=np.float32)
                pv, qv = ort.OrtValue.ortvalue_from_numpy(past), ort.OrtValue.ortvalue_from_numpy(present)
                io.bind_ortvalue_input(past_name(i), pv)
                io.bind_ortvalue_output(present_name(i), qv)
                self.buffers.append((past, present))
                self.values.append((pv, qv))
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
        t = self.context
        if self.mode == "static":
            same = all(v.data_ptr() == buf.ctypes.data for v, buf in zip(self.values, self.buffers))
            row_written = all(bool(np.any(buf[:, 0, t] != 0)) for buf in self.buffers)
            untouched = all(not np.any(buf[:, 0, t + 1:]) for buf in self.buffers)
            kept = all(np.array_equal(buf[:, 0, :t:max(1, t // 64)], sample)
                       for buf, sample in zip(self.buffers, self.samples))
            return {"in_place": bool(same and row_written and untouched and kept), "same_buffer_in_and_out": same,
                    "row_T_written_into_bound_buffer": row_written, "rows_after_T_untouched": untouched,
                    "past_rows_unchanged": kept}
        exact = all(np.array_equal(present[:, :t], past) for past, present in self.buffers)
        return {"present_written_into_bound_buffer": bool(exact)}

    def output(self) -> np.ndarray:
        return self.out.copy()

    def checks(self) -> dict:
        return dict(self._checks or {})

    def teardown(self) -> None:
        self.io = self.buffers = self.values = self.samples = self.out_value = None
