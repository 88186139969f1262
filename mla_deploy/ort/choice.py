"""Token choice where the logits are: two tiny ONNX graphs (built here with ``onnx.helper``) that turn a step's
``logits [B, V]`` into the next ids ``[B]`` on the engine's provider, so that on a GPU only ``B`` int64 come back
to the host instead of ``B x V`` logits.

* greedy: ``Cast(float32) -> ArgMax(axis 1)``. ONNX's ArgMax keeps the first of equal maxima, as NumPy's does; the
  cast is exact, and needed anyway: ONNX Runtime's CUDA ArgMax has no bfloat16 kernel and its CPU one no float16.
* sampling (:func:`sampling_graph`): the host's :func:`~mla_deploy.generate.sampling.draw` in float32:
  ``logits / temperature``, ``TopK`` (``top_k``, else the whole vocabulary, sorted, ties by lower index as the host's
  stable sort), ``Softmax``, the ``top_p`` cut on the cumulative of the tokens ahead, renormalised, scattered back
  to vocabulary order, ``CumSum``, and the count of cumulative values at or below ``uniform x total`` (NumPy's
  ``searchsorted(side="right")``). The uniforms ``[B]`` come from the host's generator, so a seed gives the same
  draws on the host and on the device; only float32 against float64 rounding can move a draw that falls within
  rounding of a boundary.

``TopK``'s ``k`` and every axis are constants of the graph (ONNX Runtime's CUDA kernels read them from host
memory; an initializer is there without a copy node), so a sampling graph is built per ``(batch, top_k)``.
"""

from __future__ import annotations

import numpy as np

#: ONNX Runtime 1.31 refuses IR versions above 13 (onnx 1.23 writes 14 by default); opset 17 has every op used here
IR_VERSION = 10
OPSET = 17


def _tensor(name: str, elem: int, shape):
    from onnx import helper

    return helper.make_tensor_value_info(name, elem, list(shape))


def _model(nodes, inputs, outputs, initializers=()):
    from onnx import helper

    graph = helper.make_graph(nodes, "token_choice", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    return model


def greedy_graph(batch: int, vocab: int, elem: int):
    """``logits [batch, vocab]`` of ONNX element type ``elem`` -> ``ids [batch]`` int64, the first maximum."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Cast", ["logits"], ["x"], to=TensorProto.FLOAT),
             helper.make_node("ArgMax", ["x"], ["ids"], axis=1, keepdims=0, select_last_index=0)]
    return _model(nodes, [_tensor("logits", elem, (batch, vocab))], [_tensor("ids", TensorProto.INT64, (batch,))])


def sampling_graph(batch: int, vocab: int, elem: int, top_k: int | None):
    """``logits [batch, vocab]`` (element type ``elem``), ``temperature [1]``, ``top_p [1]`` and ``uniforms
    [batch]`` (float32) -> ``ids [batch]`` int64, drawn as :func:`~mla_deploy.generate.sampling.draw` draws."""
    from onnx import TensorProto, helper, numpy_helper

    k = vocab if top_k is None else min(int(top_k), vocab)
    consts = [numpy_helper.from_array(np.array([k], np.int64), "k"),
              numpy_helper.from_array(np.array(1, np.int64), "axis"),
              numpy_helper.from_array(np.array([batch, vocab], np.int64), "shape"),
              numpy_helper.from_array(np.array([vocab - 1], np.int64), "last"),
              numpy_helper.from_array(np.array([1], np.int64), "axes"),
              numpy_helper.from_array(np.array(vocab - 1, np.float32), "top_index")]
    n = helper.make_node
    nodes = [
        n("Cast", ["logits"], ["x"], to=TensorProto.FLOAT),
        n("Div", ["x", "temperature"], ["scaled"]),
        n("TopK", ["scaled", "k"], ["values", "order"], axis=1, largest=1, sorted=1),
        n("Softmax", ["values"], ["kept"], axis=1),
        # the top_p cut: a token stays while the probability of the tokens ahead of it is below top_p (the first
        # always stays: nothing is ahead of it and top_p > 0)
        n("CumSum", ["kept", "axis"], ["through"]),
        n("Sub", ["through", "kept"], ["before"]),
        n("Less", ["before", "top_p"], ["keep"]),
        n("Cast", ["keep"], ["keep_f"], to=TensorProto.FLOAT),
        n("Mul", ["kept", "keep_f"], ["cut"]),
        n("ReduceSum", ["cut", "axes"], ["cut_total"], keepdims=1),
        n("Div", ["cut", "cut_total"], ["probs"]),
        # back to vocabulary order, where the host takes its cumulative
        n("ConstantOfShape", ["shape"], ["zeros"], value=numpy_helper.from_array(np.array([0.0], np.float32))),
        n("ScatterElements", ["zeros", "order", "probs"], ["spread"], axis=1),
        n("CumSum", ["spread", "axis"], ["cumulative"]),
        n("Gather", ["cumulative", "last"], ["total"], axis=1),
        n("Unsqueeze", ["uniforms", "axes"], ["u"]),
        n("Mul", ["u", "total"], ["target"]),
        n("LessOrEqual", ["cumulative", "target"], ["passed"]),
        # counted in float32 (exact below 2^24 tokens): the integer ReduceSum and Min have fewer CUDA kernels
        n("Cast", ["passed"], ["passed_f"], to=TensorProto.FLOAT),
        n("ReduceSum", ["passed_f", "axes"], ["count"], keepdims=0),
        n("Min", ["count", "top_index"], ["index"]),
        n("Cast", ["index"], ["ids"], to=TensorProto.INT64),
    ]
    inputs = [_tensor("logits", elem, (batch, vocab)), _tensor("temperature", TensorProto.FLOAT, (1,)),
              _tensor("top_p", TensorProto.FLOAT, (1,)), _tensor("uniforms", TensorProto.FLOAT, (batch,))]
    return _model(nodes, inputs, [_tensor("ids", TensorProto.INT64, (batch,))], consts)
