"""Helpers of the quantized-validation tests: export a checkpoint with quantized weights, and plant mistakes in the
exported graph (an artifact that stays internally consistent, but computes with wrong weights)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from validate_helpers import rerecord


def export_checkpoint(checkpoint: Path, out: Path, weights: str, block_size: int = 32, **export) -> Path:
    """``mla-deploy export --hf CHECKPOINT --out OUT --weights WEIGHTS`` through the Python API (``export``: other
    ``[export]`` settings)."""
    from mla_deploy.checkpoint import CheckpointTensors
    from mla_deploy.config import from_hf_config
    from mla_deploy.exporter import export_recipe
    from mla_deploy.recipe import Recipe

    recipe = Recipe(name=checkpoint.name, model=from_hf_config(checkpoint), source=str(checkpoint))
    recipe = recipe.replace(export=dataclasses.replace(recipe.export, weights=weights, block_size=block_size, **export))
    source = CheckpointTensors(checkpoint)
    export_recipe(recipe, out, weights=source.weights_source(), source=source)
    return out


def edit_graph(artifact: Path, edit) -> None:
    """Load ``model.onnx`` (the weights inside it), call ``edit(model)``, save it and record its new hashes."""
    import onnx

    path = artifact / "model.onnx"
    model = onnx.load(str(path))
    edit(model)
    onnx.save(model, str(path))
    for role in json.loads((artifact / "manifest.json").read_text())["graphs"]:
        rerecord(artifact, role)


def initializers(model) -> dict:
    return {init.name: init for init in model.graph.initializer}


def _matmulnbits(model) -> dict:
    """``{scale initializer name: (N, blocks)}`` of every ``MatMulNBits`` node."""
    out = {}
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: a.i for a in node.attribute}
            out[node.input[2]] = (attrs["N"], -(-attrs["K"] // attrs["block_size"]))
    return out


def double_one_scale(name: str, block: int = 0, column: int = 0):
    """An edit: the scale of one block (``block`` of output feature ``column``) of the weight ``name`` times 2
    (``qdq``: ``scale [blocks, N]``; ``matmulnbits``: ``scale [N * blocks]``)."""
    def edit(model) -> None:
        from onnx import numpy_helper

        init = initializers(model)[f"{name}.scale"]
        scale = numpy_helper.to_array(init).copy()
        if scale.ndim == 1:
            scale[column * _matmulnbits(model)[init.name][1] + block] *= 2
        else:
            scale[block, column] *= 2
        init.CopyFrom(numpy_helper.from_array(scale, init.name))

    return edit


def scales_along_n(model) -> None:
    """An edit: every ``MatMulNBits``' scales ``[N * blocks]`` read as if laid out ``[blocks, N]``, i.e. along the
    output features: a valid graph with each block's scale taken from the wrong place."""
    from onnx import numpy_helper

    inits = initializers(model)
    for name, (n, blocks) in _matmulnbits(model).items():
        init = inits[name]
        scale = numpy_helper.to_array(init).reshape(n, blocks)
        init.CopyFrom(numpy_helper.from_array(scale.T.reshape(-1).copy(), name))


def blocks_along_n(model) -> None:
    """An edit: every int8 ``DequantizeLinear`` re-quantized with its blocks along the output features ``N``
    (``axis=1``, scales ``[K, ceil(N/B)]``) instead of the input features ``K``: a valid graph whose weights are the
    dequantized ones quantized a second time, the wrong way."""
    import numpy as np
    import onnx
    import torch
    from onnx import numpy_helper

    from mla_deploy.quant import WeightQuantization, dequantize, quantize

    inits = initializers(model)
    for node in model.graph.node:
        if node.op_type != "DequantizeLinear":
            continue
        attrs = {a.name: a for a in node.attribute}
        block = attrs["block_size"].i
        scheme = WeightQuantization("int8", block)
        q_init, s_init = inits[node.input[0]], inits[node.input[1]]
        assert q_init.data_type == onnx.TensorProto.INT8 and attrs["axis"].i == 0
        q = torch.from_numpy(numpy_helper.to_array(q_init).astype(np.int8))
        scale = torch.from_numpy(numpy_helper.to_array(s_init).astype(np.float32))
        weight = dequantize(q, scale, scheme)  # [K, N]
        q_n, scale_n = quantize(weight.T, scheme)  # blocks along N: [N, K], [ceil(N/B), K]
        q_init.CopyFrom(numpy_helper.from_array(q_n.T.contiguous().numpy(), q_init.name))
        dtype = numpy_helper.to_array(s_init).dtype
        s_init.CopyFrom(numpy_helper.from_array(scale_n.T.contiguous().numpy().astype(dtype), s_init.name))
        attrs["axis"].i = 1
