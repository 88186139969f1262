"""ONNX export of the benched unit (an attention stack's decode step), for ONNX Runtime and TensorRT.

Not part of the exporter's public artifact contract: a bench-only graph built with the same machinery
(:func:`mla_deploy.exporter.onnx_export.trace_to_onnx`, the model classes, the cache policies).

==================== =========================================== ==============================================
tensor               concat                                      static
==================== =========================================== ==============================================
``hidden_states``    float32 [batch_size, 1, D]                  same
``position_ids``     int64 [batch_size, 1]                       same
``write_indices``    (absent)                                    int64 [batch_size]: rows held = write slot
``past_latent.{i}``  [batch_size, past_sequence_length, C]       [batch_size, 1, max_cache_length, C]
``output``           float32 [batch_size, 1, D]                  same
``present_latent.{i}`` [batch_size, total_sequence_length, C]    [batch_size, 1, max_cache_length, C] (in place)
==================== =========================================== ==============================================
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from ..io_spec import BATCH, CAPACITY, PAST, SEQ, TOTAL, TensorSpec, past_name, present_name
from ..model.cache import ConcatCache, StaticCache
from .stack import AttentionStack


class AttentionStackGraph(nn.Module):
    """``(hidden_states, position_ids, [write_indices], *past) -> (output, *present)``."""

    def __init__(self, stack: AttentionStack, cache_mode: str):
        super().__init__()
        self.stack = stack
        self.cache_mode = cache_mode

    def forward(self, hidden_states, position_ids, *rest):
        if self.cache_mode == "static":
            cache, past = StaticCache(rest[0]), list(rest[1:])
        else:
            cache, past = ConcatCache(), list(rest)
        out, presents = self.stack(hidden_states, position_ids, past, cache)
        return (out, *presents)


def stack_io(stack: AttentionStack, cache_mode: str) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The graph's inputs and outputs (fp32)."""
    c, n = stack.config, len(stack.layers)
    inputs = [TensorSpec("hidden_states", "float32", (BATCH, 1, c.hidden_size)),
              TensorSpec("position_ids", "int64", (BATCH, 1))]
    if cache_mode == "static":
        inputs.append(TensorSpec("write_indices", "int64", (BATCH,)))
        cache_in = cache_out = (BATCH, 1, CAPACITY, c.latent_dim)
    else:
        cache_in, cache_out = (BATCH, PAST, c.latent_dim), (BATCH, TOTAL, c.latent_dim)
    inputs += [TensorSpec(past_name(i), "float32", cache_in) for i in range(n)]
    outputs = [TensorSpec("output", "float32", (BATCH, 1, c.hidden_size))]
    outputs += [TensorSpec(present_name(i), "float32", cache_out) for i in range(n)]
    return inputs, outputs


def export_stack(stack: AttentionStack, cache_mode: str, path: str | Path, opset: int = 24) -> Path:
    """Export ``stack``'s decode step (one new token) to ``path`` (weights inside the file)."""
    from torch.export import Dim

    from ..exporter.onnx_export import trace_to_onnx

    c, n = stack.config, len(stack.layers)
    batch = Dim(BATCH, min=1, max=4096)
    hidden = torch.zeros(2, 1, c.hidden_size)
    positions = torch.full((2, 1), 5, dtype=torch.long)
    if cache_mode == "static":
        capacity = Dim(CAPACITY, min=2, max=1 << 22)
        args = (hidden, positions, torch.full((2,), 5, dtype=torch.long),
                *(torch.zeros(2, 1, 8, c.latent_dim) for _ in range(n)))
        shapes = ({0: batch}, {0: batch}, ({0: batch}, *({0: batch, 2: capacity} for _ in range(n))))
    else:
        past = Dim(PAST, min=1, max=1 << 22)
        args = (hidden, positions, *(torch.zeros(2, 5, c.latent_dim) for _ in range(n)))
        shapes = ({0: batch}, {0: batch}, tuple({0: batch, 1: past} for _ in range(n)))
    inputs, outputs = stack_io(stack, cache_mode)
    path = Path(path)
    with torch.no_grad():
        trace_to_onnx(AttentionStackGraph(stack, cache_mode).eval(), args, path, inputs, outputs, shapes,
                      opset, external_data=False)
    return path


def main(job_file: str) -> int:
    """``python -m mla_deploy.bench.graph JOB.json``: export one graph (the driver runs the two side by side)."""
    import json

    from ..errors import MLADeployError
    from .spec import BenchSpec
    from .stack import build_stack

    job = json.loads(Path(job_file).read_text())
    spec = BenchSpec.from_dict(job["spec"])
    try:
        export_stack(build_stack(spec.config, spec.layers, "A_CC", seed=spec.seed), job["mode"], job["path"])
    except MLADeployError as exc:
        print(" ".join(str(exc).split()), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover - run by the driver
    sys.exit(main(sys.argv[1]))
