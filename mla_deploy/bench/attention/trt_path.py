"""The TensorRT row: the bench's static absorbed graph built into an engine and timed on the GPU.

Included only where ``tensorrt`` imports and a CUDA GPU is visible and the engine builds; otherwise the report
says "not available" and why. Timed with CUDA events around ``execute_async_v3`` (the cache stays on the GPU,
bound as past and present: in place when the engine aliases them, TensorRT >= 10.15). The CPU roofline of the
other rows does not apply to this row.

The optimisation profile comes from the graph's I/O (:func:`~.graph.stack_io`) and the cache layout's axis
ranges, like an artifact's (:func:`mla_deploy.trt.profiles.input_shapes`); the buffers and the control input
come from the layout (:func:`~.inputs.point_state`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...cache_layout import CacheLayout, get_layout
from ...io_spec import CAPACITY, TensorSpec, past_name, present_name
from .inputs import PointInputs, point_state


def availability() -> tuple[bool, str | None]:
    """``(True, None)`` when tensorrt imports and a CUDA GPU is visible, else ``(False, reason)``."""
    from ...errors import RuntimeMissingError
    from ...trt import require_tensorrt

    try:
        require_tensorrt()
    except RuntimeMissingError as exc:
        return False, str(exc)
    return True, None


def engine_profile(inputs: list[TensorSpec], layout: CacheLayout, max_batch: int, max_slots: int) -> dict:
    """The engine's one optimisation profile: ``{input name: (min, opt, max) shapes}``, in graph input order.

    Args:
        inputs: the graph's inputs (:func:`~.graph.stack_io`).
        layout: the graph's cache layout.
        max_batch: batch ``[1, max_batch]`` (opt: half).
        max_slots: the largest cache: a fixed-capacity layout's capacity ranges over ``[2, max_slots]`` (one
            engine serves every point's ``T + margin``, where an artifact's engine has one fixed capacity); a
            growing layout's past over ``[1, max_slots]``.
    """
    from ...recipe import BuildSettings
    from ...trt.profiles import input_shapes

    opt_b, opt_c = max(1, max_batch // 2), max(2, max_slots // 2)
    build = BuildSettings(batch=(1, opt_b, max_batch), prompt_length=(1, 1, 1), past_length=(1, opt_c, max_slots))
    ranges = layout.axis_ranges("decode", build, max_slots)
    if layout.has_capacity:
        ranges[CAPACITY] = (2, opt_c, max_slots)
    return {t.name: input_shapes(t.shape, ranges, t.name) for t in inputs}


def build_engine(onnx_path: str | Path, engine_path: str | Path, spec, layout: CacheLayout | str) -> Path:
    """Build an fp32 engine of the bench graph exported with ``layout``, one profile (:func:`engine_profile`):
    batch up to ``max(spec.batches)``, cache up to ``max(spec.contexts) + spec.static_margin``. Returns the path."""
    from polygraphy.backend.trt import CreateConfig, EngineBytesFromNetwork, NetworkFromOnnxPath

    from ...trt import require_tensorrt
    from ...trt.build import precision_flags
    from ...trt.profiles import polygraphy_profile
    from .graph import stack_io

    trt, _ = require_tensorrt()
    layout = get_layout(layout)
    inputs, _ = stack_io(spec.config, spec.layers, layout)
    profile = engine_profile(inputs, layout, max(spec.batches), max(spec.contexts) + spec.static_margin)
    flags = precision_flags("fp32", trt.__version__)
    network = NetworkFromOnnxPath(str(onnx_path), strongly_typed=flags["strongly_typed"])
    serialized = EngineBytesFromNetwork(network, CreateConfig(profiles=[polygraphy_profile(profile)]))()
    Path(engine_path).write_bytes(bytes(serialized))
    return Path(engine_path)


class TrtPath:
    """The ``trt`` path. Args: engine: the engine file; layout: the cache layout its graph was exported with;
    margin: fixed-capacity layouts hold ``T + margin`` slots."""

    def __init__(self, engine: str, layout: CacheLayout | str, margin: int):
        import tensorrt as trt
        import torch

        self.trt, self.torch, self.margin = trt, torch, margin
        self.layout = get_layout(layout)
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine(Path(engine).read_bytes())
        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream()
        self.context.set_optimization_profile_async(0, self.stream.cuda_stream)
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.aliased = {}
        if hasattr(self.engine, "get_aliased_input_tensor"):
            self.aliased = {n: self.engine.get_aliased_input_tensor(n) for n in outputs
                            if self.engine.get_aliased_input_tensor(n)}
        self.provider = f"TensorRT {trt.__version__} on {torch.cuda.get_device_name(0)}"

    def setup(self, inputs: PointInputs) -> None:
        torch, layout = self.torch, self.layout
        b, t = inputs.batch, inputs.context
        dev = "cuda"
        state = point_state(layout, inputs, self.margin,
                            lambda shape: torch.zeros(shape, dtype=torch.float32, device=dev),
                            lambda rows: rows.to(dev).contiguous())
        control = layout.control_input(state, np.ones((b, 1), dtype=np.int64))
        self.tensors = {"hidden_states": inputs.hidden.to(dev).contiguous(),
                        "position_ids": inputs.positions.to(dev).contiguous(),
                        layout.control: torch.from_numpy(control).to(dev)}
        self.outputs = {"output": torch.empty_like(self.tensors["hidden_states"])}
        self.in_place = layout.in_place
        for i, buf in enumerate(state.caches):
            self.tensors[past_name(i)] = buf
            if layout.in_place and self.aliased.get(present_name(i)) == past_name(i):
                self.outputs[present_name(i)] = buf
            else:  # no aliasing: a separate present (TensorRT copies the cache)
                self.in_place = False
                shape = buf.shape if layout.in_place else layout.cache_shape(b, t + 1, buf.shape[-1])
                self.outputs[present_name(i)] = torch.empty(shape, dtype=torch.float32, device=dev)
        for name, tensor in self.tensors.items():
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
        for name, tensor in self.outputs.items():
            self.context.set_tensor_address(name, tensor.data_ptr())
        self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def step(self) -> None:
        self.start.record(self.stream)
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError("TensorRT failed to execute the bench engine")
        self.end.record(self.stream)
        self.end.synchronize()

    def device_seconds(self) -> float:
        """GPU time of the last step (CUDA events)."""
        return self.start.elapsed_time(self.end) / 1e3

    def output(self) -> np.ndarray:
        return self.outputs["output"].float().cpu().numpy()

    def checks(self) -> dict:
        return {"in_place": self.in_place, "aliased_outputs": dict(self.aliased)}

    def teardown(self) -> None:
        self.tensors = self.outputs = None
        self.torch.cuda.empty_cache()
