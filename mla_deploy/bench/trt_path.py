"""The TensorRT row: the bench's static absorbed graph built into an engine and timed on the GPU.

Included only where ``tensorrt`` imports and a CUDA GPU is visible and the engine builds; otherwise the report
says "not available" and why. Timed with CUDA events around ``execute_async_v3`` (the cache stays on the GPU,
bound as past and present: in place when the engine aliases them, TensorRT >= 10.15). The CPU roofline of the
other rows does not apply to this row.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..io_spec import past_name, present_name
from .inputs import PointInputs


def availability() -> tuple[bool, str | None]:
    """``(True, None)`` when tensorrt imports and a CUDA GPU is visible, else ``(False, reason)``."""
    try:
        import tensorrt  # noqa: F401
    except Exception as exc:  # ImportError, or OSError when its libraries cannot load
        return False, f"tensorrt is not importable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    try:
        import torch

        if not torch.cuda.is_available():
            return False, "tensorrt imports but no CUDA GPU is visible"
    except ImportError:  # pragma: no cover - torch is a dependency
        return False, "torch is missing"
    return True, None


def build_engine(onnx_path: str | Path, engine_path: str | Path, max_batch: int, max_capacity: int) -> Path:
    """Build an fp32 engine of the static bench graph, one profile: batch ``[1, max_batch]``, capacity
    ``[2, max_capacity]``. Returns the engine path."""
    import tensorrt as trt
    from polygraphy.backend.trt import CreateConfig, EngineBytesFromNetwork, NetworkFromOnnxPath, Profile

    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    profile = Profile()
    opt_b, opt_c = max(1, max_batch // 2), max(2, max_capacity // 2)
    for value in model.graph.input:
        dims = [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
        lo = [1 if d == "batch_size" else 2 if d == "max_cache_length" else d for d in dims]
        opt = [opt_b if d == "batch_size" else opt_c if d == "max_cache_length" else d for d in dims]
        hi = [max_batch if d == "batch_size" else max_capacity if d == "max_cache_length" else d for d in dims]
        profile.add(value.name, min=lo, opt=opt, max=hi)
    network = NetworkFromOnnxPath(str(onnx_path), strongly_typed=int(trt.__version__.split(".")[0]) >= 11)
    serialized = EngineBytesFromNetwork(network, CreateConfig(profiles=[profile]))()
    Path(engine_path).write_bytes(bytes(serialized))
    return Path(engine_path)


class TrtRunner:
    """Args: engine: the engine file; margin: static capacity - T."""

    def __init__(self, engine: str, margin: int):
        import tensorrt as trt
        import torch

        self.trt, self.torch, self.margin = trt, torch, margin
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
        torch = self.torch
        b, t = inputs.batch, inputs.context
        dev = "cuda"
        self.tensors = {"hidden_states": inputs.hidden.to(dev).contiguous(),
                        "position_ids": inputs.positions.to(dev).contiguous(),
                        "write_indices": torch.full((b,), t, dtype=torch.int64, device=dev)}
        self.outputs = {"output": torch.empty_like(self.tensors["hidden_states"])}
        self.in_place = True
        for i, rows in enumerate(inputs.latent):
            buf = torch.zeros((b, 1, t + self.margin, rows.shape[-1]), dtype=torch.float32, device=dev)
            buf[:, 0, :t] = rows.to(dev)
            self.tensors[past_name(i)] = buf
            if self.aliased.get(present_name(i)) == past_name(i):
                self.outputs[present_name(i)] = buf
            else:  # no aliasing: a separate present (TensorRT copies the cache)
                self.in_place = False
                self.outputs[present_name(i)] = torch.empty_like(buf)
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
