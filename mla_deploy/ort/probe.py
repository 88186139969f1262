"""The check that a compiled operator library works with the ONNX Runtime that will load it, run in a child process
(``python -m mla_deploy.ort.probe LIBRARY``) by :func:`mla_deploy.ort.operators.check_library`.

``csrc/cpu_ops.c`` reaches ONNX Runtime's C API through positions in its ``OrtApi`` table written by hand: no
package on the index ships ONNX Runtime's C header (not the ``onnxruntime``/``onnxruntime-gpu`` wheels, not
``onnxruntime-node``). The table only grows at its end, so positions that are right for one version are right for
every later one; a wrong position (an edit of the source) calls another function of the table, which crashes or
computes garbage. So before an engine records a library, a child process registers it and runs each of its
operator kinds once, through both paths that reach the C API differently: ``BlockwiseMatMul`` (attributes, inputs,
outputs, shapes, ``ParallelFor``) beside ONNX Runtime's own ``MatMulNBits`` on the same weights, and
``FloatMatMul`` with few rows (its own loop) and many (ONNX Runtime's kernel through ``CreateOp``/``InvokeOp``)
beside NumPy. A crash stays in the child; the parent turns it into one line.

Exit status 0: every result agreed; 1: a result differed (the line on stdout says which); a signal: it crashed.
"""

from __future__ import annotations

import sys
from pathlib import Path

#: BlockwiseMatMul's shape: 3 blocks of 32 over 16 rows, int4
K, N = 96, 16
#: FloatMatMul computes up to 8 rows itself and hands more to ONNX Runtime's kernel: one call of each
FEW_ROWS, MANY_ROWS = 3, 20


def _model(nodes, inputs, initializers, domain: str):
    from onnx import TensorProto, helper

    graph = helper.make_graph(nodes, "probe", [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["T", K])
                                               for n in inputs],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["T", N])
                               for node in nodes for o in node.output], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(domain, 1),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10  # what ONNX Runtime 1.31 reads
    return model.SerializeToString()


def _differs(ours, theirs, what: str, rtol: float = 1e-4) -> str | None:
    import numpy as np

    scale = float(np.abs(theirs).max()) or 1.0
    error = float(np.abs(ours - theirs).max()) / scale
    return f"{what} differs from the reference by {error:.2g} of its scale" if not error <= rtol else None


def run(library: str) -> str | None:
    """Each operator kind of ``library`` once, against its reference; None when all agree, else the first
    difference."""
    import numpy as np
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    from .operators import register
    from .swaps import DOMAIN, FLOAT_LINEAR_OP_TYPE, LINEAR_OP_TYPE

    rng = np.random.default_rng(0)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    register(options, Path(library))  # as an engine's session registers it: the C API version is checked first
    weight = rng.integers(0, 256, size=(N, K // 32, 16), dtype=np.uint8)
    scales = (rng.random(N * K // 32, dtype=np.float32) * 0.02 + 0.005).astype(np.float16).astype(np.float32)
    quantized = [numpy_helper.from_array(weight, "b"), numpy_helper.from_array(scales, "s")]
    attrs = {"K": K, "N": N, "bits": 4, "block_size": 32}
    ours = helper.make_node(LINEAR_OP_TYPE, ["a", "b", "s"], ["ours"], domain=DOMAIN, **attrs)
    theirs = helper.make_node("MatMulNBits", ["a", "b", "s"], ["theirs"], domain="com.microsoft", accuracy_level=4,
                              **attrs)
    session = ort.InferenceSession(_model([ours, theirs], ["a"], quantized, DOMAIN), options,
                                   providers=["CPUExecutionProvider"])
    a = rng.standard_normal((FEW_ROWS, K), dtype=np.float32)
    got, want = session.run(None, {"a": a})
    found = _differs(got, want, f"{LINEAR_OP_TYPE} (beside MatMulNBits)")
    if found:
        return found
    w = rng.standard_normal((N, K), dtype=np.float32)  # FloatMatMul holds the weight transposed, [N, K]
    node = helper.make_node(FLOAT_LINEAR_OP_TYPE, ["a", "w"], ["y"], domain=DOMAIN)
    session = ort.InferenceSession(_model([node], ["a"], [numpy_helper.from_array(w, "w")], DOMAIN), options,
                                   providers=["CPUExecutionProvider"])
    for rows in (FEW_ROWS, MANY_ROWS):
        a = rng.standard_normal((rows, K), dtype=np.float32)
        found = _differs(session.run(None, {"a": a})[0], a @ w.T, f"{FLOAT_LINEAR_OP_TYPE} over {rows} rows")
        if found:
            return found
    return None


def main(argv: list[str]) -> int:
    try:
        found = run(argv[0])
    except Exception as exc:  # ONNX Runtime's own error types: the first line says what failed
        found = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    if found:
        print(found, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
