"""Which operators ONNX Runtime's CUDA provider has a kernel for, in which element types: where a graph's nodes would be
placed, read on a machine without a GPU.

A node whose type has no CUDA kernel is placed on the CPU provider (with copies around it), which rules out a CUDA
graph and, for ``QMoE`` in fp32, silently runs the experts on the CPU. :data:`CUDA_KERNELS` is the registry for the
operators mla-deploy's graphs hold, as data; :func:`cuda_kernel_misses` reads a graph against it.

Source: ONNX Runtime's ``docs/OperatorKernels.md``, "Operators implemented by CUDAExecutionProvider" (generated from
the registered kernels; microsoft/onnxruntime at 001d12d), for opsets 13 to 24 as the graphs use them, and for
``QMoE``/``MoE`` onnxruntime-cuda-facts.md (``REGISTER_KERNEL_TYPED`` in contrib_ops/cuda/moe). That file is main's,
not pinned to 1.31.1; the registry of the installed wheel on a GPU machine (``get_all_opkernel_def()``, filtered to
``CUDAExecutionProvider``) is what confirms it. Only the element types mla-deploy's graphs use are listed.
"""

from __future__ import annotations

from typing import Any

from ..quant import MATMULNBITS

F32, F16, BF16 = "FLOAT", "FLOAT16", "BFLOAT16"
I32, I64, BOOL, U8, I8, I4 = "INT32", "INT64", "BOOL", "UINT8", "INT8", "INT4"
FLOATS = frozenset({F32, F16, BF16})
#: float32 and float16, no bfloat16 kernel
NO_BF16 = frozenset({F32, F16})
#: every type a data-movement op (Reshape, Concat, Gather, ...) is registered for, of those used here
ANY = frozenset({F32, F16, BF16, I32, I64, BOOL, U8, I8})
ARITH = frozenset({F32, F16, BF16, I32, I64})

#: ``(domain, op_type) -> {input index: element types with a CUDA kernel}``: the input that carries the kernel's
#: type constraint (``Where``'s values, not its condition; ``DequantizeLinear``'s integers and scales)
CUDA_KERNELS: dict[tuple[str, str], dict[int, frozenset]] = {
    ("", "Add"): {0: ARITH}, ("", "Sub"): {0: ARITH}, ("", "Mul"): {0: ARITH}, ("", "Div"): {0: ARITH},
    ("", "Pow"): {0: ARITH}, ("", "Neg"): {0: ARITH}, ("", "Max"): {0: ARITH}, ("", "Min"): {0: ARITH},
    ("", "Sqrt"): {0: FLOATS}, ("", "Sigmoid"): {0: FLOATS}, ("", "Softmax"): {0: FLOATS},
    ("", "Log"): {0: NO_BF16}, ("", "Exp"): {0: FLOATS}, ("", "Cos"): {0: NO_BF16}, ("", "Sin"): {0: NO_BF16},
    ("", "MatMul"): {0: FLOATS}, ("", "Gemm"): {0: FLOATS},
    ("", "ReduceSum"): {0: ARITH}, ("", "ReduceMean"): {0: frozenset({F32, F16, I32})},
    ("", "ReduceMax"): {0: frozenset({F32, F16, I32, I64})},
    ("", "TopK"): {0: frozenset({F32, F16, I32, I64})},
    ("", "Less"): {0: frozenset({F32, F16, I32, I64})}, ("", "LessOrEqual"): {0: frozenset({F32, F16, I32, I64})},
    ("", "Greater"): {0: frozenset({F32, F16, I32, I64})}, ("", "Equal"): {0: frozenset({F32, F16, I32, I64, BOOL})},
    ("", "GreaterOrEqual"): {0: frozenset({F32, F16, I32, I64})},
    ("", "Not"): {0: frozenset({BOOL})}, ("", "And"): {0: frozenset({BOOL})}, ("", "Or"): {0: frozenset({BOOL})},
    ("", "Where"): {0: frozenset({BOOL}), 1: frozenset({F32, F16, BF16, I32, I64, U8})},
    ("", "Cast"): {0: ANY}, ("", "Reshape"): {0: ANY}, ("", "Transpose"): {0: ANY}, ("", "Concat"): {0: ANY},
    ("", "Split"): {0: ANY}, ("", "Slice"): {0: ANY}, ("", "Squeeze"): {0: ANY}, ("", "Unsqueeze"): {0: ANY},
    ("", "Expand"): {0: ANY}, ("", "Gather"): {0: ANY}, ("", "GatherElements"): {0: ANY},
    ("", "ScatterElements"): {0: ANY}, ("", "Shape"): {0: ANY}, ("", "Identity"): {0: ANY},
    ("", "ConstantOfShape"): {0: frozenset({I64})}, ("", "Range"): {0: frozenset({F32, I32, I64})},
    ("", "CumSum"): {0: frozenset({F32, F16, I32, I64})}, ("", "Tile"): {0: ARITH},
    ("", "TensorScatter"): {0: ANY},
    ("", "DequantizeLinear"): {0: frozenset({I4, I8, U8, "UINT4"}), 1: NO_BF16},
    ("", "SimplifiedLayerNormalization"): {0: FLOATS},
    ("com.microsoft", MATMULNBITS.op_type): {0: FLOATS, 1: frozenset({U8})},
    ("com.microsoft", "MoE"): {0: FLOATS},
    # fp16/bf16 only, scales in the activations' type (fp32 lands on the CPU provider: onnxruntime issue #29035)
    ("com.microsoft", "QMoE"): {0: frozenset({F16, BF16}), 2: frozenset({U8}), 3: frozenset({F16, BF16})},
    ("com.microsoft", "SkipSimplifiedLayerNormalization"): {0: FLOATS},
}


def cuda_kernel_misses(model: Any) -> list[str]:
    """The nodes of ``model`` (an ``onnx_ir.Model``, or an ``onnx.ModelProto`` with its value types inferred; weights
    not needed) that ONNX Runtime's CUDA provider has no kernel for (:data:`CUDA_KERNELS`), nested graphs included:
    ``["QMoE node_MoE_3 (input 0 is FLOAT)", "NonZero node_7 (no CUDA kernel listed)"]``; empty when every node
    has one."""
    import onnx_ir as ir

    if not isinstance(model, ir.Model):
        model = ir.from_proto(model)
    found = []
    for node in model.graph.all_nodes():
        domain = "" if node.domain in ("", "ai.onnx") else node.domain
        kernel = CUDA_KERNELS.get((domain, node.op_type))
        name = f"{node.op_type} {node.name or node.outputs[0].name}"
        if kernel is None:
            found.append(f"{name} (no CUDA kernel listed)")
            continue
        for index, types in kernel.items():
            value = node.inputs[index] if index < len(node.inputs) else None
            dtype = value.dtype.name if value is not None and value.dtype is not None else None
            if value is not None and dtype not in types:
                found.append(f"{name} (input {index} is {dtype})")
    return found
