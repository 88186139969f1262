"""ONNX export of the benched unit (an attention stack's decode step), for ONNX Runtime and TensorRT.

Not part of the exporter's public artifact contract: a bench-only graph built with the same machinery
(:func:`mla_deploy.exporter.trace_to_onnx` and ``cached_dynamic_shapes``, the cache layout's I/O, example
state and cache policy). Its I/O
is the layout's (:meth:`~mla_deploy.cache_layout.CacheLayout.io`) with the stack's own head:

==================== =========================================== ==============================================
tensor               concat                                      static
==================== =========================================== ==============================================
``hidden_states``    float32 [batch_size, sequence_length, D]    same (the bench feeds sequence_length 1)
``position_ids``     int64 [batch_size, sequence_length]         same
control input        ``attention_mask`` int64 [batch_size,       ``write_indices`` int64 [batch_size]: rows
                     total_sequence_length] (all ones here)      held = write slot
``past_latent.{i}``  [batch_size, past_sequence_length, C]       [batch_size, 1, max_cache_length, C]
``output``           float32 [batch_size, sequence_length, D]    same
``present_latent.{i}`` [batch_size, total_sequence_length, C]    [batch_size, 1, max_cache_length, C] (in place)
==================== =========================================== ==============================================
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from ...cache_layout import CacheLayout, get_layout
from ...config import MLAConfig
from ...io_spec import BATCH, SEQ, TensorSpec
from ...model import AttentionStack

#: example sizes the graph is traced at (every dynamic axis >= 2: an axis traced at 1 is frozen)
_TRACE_BATCH, _TRACE_STEPS, _TRACE_PAST, _TRACE_CAPACITY = 2, 2, 5, 8


def stack_io(config: MLAConfig, layers: int, layout: CacheLayout) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The graph's inputs and outputs (fp32): ``hidden_states [B, S, D]``, ``position_ids [B, S]``, the layout's
    control input and ``layers`` caches in; ``output [B, S, D]`` and the present caches out.

    The bench feeds ``S = 1`` (TensorRT's decode profile pins it). The axis is symbolic, as in the exporter's
    decode graph, because a graph fixed at ``S = 1`` does not trace with the concat layout's mask: torch.export
    then demands the mask axis be declared as ``past + 1``.
    """
    d = config.hidden_size
    head_inputs = [TensorSpec("hidden_states", "float32", (BATCH, SEQ, d)),
                   TensorSpec("position_ids", "int64", (BATCH, SEQ))]
    head_outputs = [TensorSpec("output", "float32", (BATCH, SEQ, d))]
    return layout.io(config, "fp32", head_inputs=head_inputs, head_outputs=head_outputs, layers=layers)


def export_stack(stack: AttentionStack, layout: CacheLayout | str, path: str | Path, opset: int = 24) -> Path:
    """Export ``stack``'s step (the bench runs one new token) with ``layout``'s cache to ``path`` (weights inside
    the file).

    Raises:
        ExportError: the export or its checks failed.
    """
    from ...exporter import DecoderGraph, cached_dynamic_shapes, trace_to_onnx

    layout = get_layout(layout)
    c, n = stack.config, len(stack.layers)
    head_axes = [{0: BATCH, 1: SEQ}, {0: BATCH, 1: SEQ}]  # hidden_states, position_ids
    shapes = cached_dynamic_shapes(layout, head_axes, n)
    control, caches = layout.example_state(_TRACE_BATCH, _TRACE_PAST, _TRACE_STEPS, c.latent_dim, n,
                                           _TRACE_CAPACITY, torch.float32)
    hidden = torch.zeros(_TRACE_BATCH, _TRACE_STEPS, c.hidden_size)
    positions = torch.arange(_TRACE_PAST, _TRACE_PAST + _TRACE_STEPS).expand(_TRACE_BATCH, -1).contiguous()
    inputs, outputs = stack_io(c, n, layout)
    path = Path(path)
    with torch.no_grad():
        trace_to_onnx(DecoderGraph(stack, layout).eval(), (hidden, positions, control, *caches), path,
                      inputs, outputs, shapes, opset)
    return path


def main(job_file: str) -> int:
    """``python -m mla_deploy.bench.attention.graph JOB.json``: export one graph (the driver runs the two side by
    side)."""
    import json

    from ...errors import MLADeployError
    from .spec import BenchSpec
    from ...model import build_stack

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
