"""The routed experts' graph forms: the one place that knows what ``[export] experts`` / ``--experts`` mean.

* ``fused``: one ONNX Runtime ``com.microsoft`` operator per MoE layer, ``MoE`` for float weights and ``QMoE`` for
  int8/int4 (:func:`mla_deploy.exporter.moe_onnx.moe_experts_fused_onnx`). ONNX Runtime only (TensorRT cannot parse
  it). Its layout follows the precision (:data:`FUSED_LAYOUTS`): ``cpu`` for fp32 (ONNX Runtime's CPU kernels and
  the CPU engine's operators), ``cuda`` for fp16/bf16 (the only activation types ONNX Runtime's CUDA ``QMoE``
  registers; the routing hand-off computed in float32 and cast, the quantized weights marked raw);
* ``branches``: one static branch of standard ONNX ops per expert
  (:func:`mla_deploy.exporter.moe_onnx.moe_experts_onnx`), which TensorRT builds;
* ``auto`` (the default): ``fused`` unless the settings are TensorRT's (the TensorRT decode plugin, quantized
  weights in the ``qdq`` format) or ``QMoE`` cannot hold the quantized experts (:func:`resolve`).

Manifests written before the choice existed hold the branch form (:data:`LEGACY`). This module is cheap to import
(no torch, no onnx), so the recipe and the command line take their choices from it.
"""

from __future__ import annotations

from .errors import ArtifactError, ConfigError

FUSED, BRANCHES, AUTO = "fused", "branches", "auto"
#: the forms a graph holds
FORMS = (FUSED, BRANCHES)
#: ``--experts`` / ``[export] experts``: a form, or ``auto``
EXPERT_FORMS = (AUTO, *FORMS)
DEFAULT = AUTO
#: the form of a manifest's graph entry that does not say (written before the choice existed)
LEGACY = BRANCHES
#: the fused form's layouts (:mod:`mla_deploy.exporter.moe_onnx`, :data:`mla_deploy.quant.formats.QMOE_LAYOUTS`)
CPU_LAYOUT, CUDA_LAYOUT = "cpu", "cuda"
#: the fused form's layout for each export precision: ONNX Runtime 1.31's CUDA ``QMoE`` registers float16 and
#: bfloat16 kernels only (an fp32 node would be placed on the CPU provider); the CPU engine computes fp32 (its CPU
#: provider has no bf16 kernels)
FUSED_LAYOUTS = {"fp32": CPU_LAYOUT, "fp16": CUDA_LAYOUT, "bf16": CUDA_LAYOUT}
#: the precisions the fused form is exported in
FUSED_PRECISIONS = tuple(FUSED_LAYOUTS)


def fused_layout(precision: str) -> str:
    """The fused form's layout in an export of ``precision`` (:data:`FUSED_LAYOUTS`). Raises: ConfigError."""
    if precision not in FUSED_LAYOUTS:
        raise ConfigError(f"the fused experts have no layout for precision {precision!r}")
    return FUSED_LAYOUTS[precision]


def resolve(form: str, precision: str, plugin: bool, tensorrt_weights: bool, blocks: str | None = None) -> str:
    """The form a graph is exported in: ``form``, or for ``auto`` the fused form unless the settings ask for
    TensorRT (``plugin``: its decode plugin; ``tensorrt_weights``: weights quantized in a format written for it,
    ``qdq``), or ``blocks`` says why the quantization blocks do not fit ``QMoE``.

    Args:
        blocks: None, or why ``QMoE`` cannot hold the experts quantized (its blocks must divide both the hidden and
            the expert width; on CUDA, so must 64): ``hidden_size 64 and moe_intermediate_size 32 are not multiples
            of 64``.
    Raises:
        ConfigError: see :func:`check`; or ``fused`` asked for with ``blocks`` given.
    """
    check(form, precision, "[export] experts")
    if form == FUSED and blocks:
        raise ConfigError(f"[export] experts = \"{FUSED}\": ONNX Runtime's QMoE needs whole blocks, and {blocks}; "
                          f"use {BRANCHES} or another block size")
    if form != AUTO:
        return form
    for_tensorrt = plugin or tensorrt_weights
    return FUSED if not for_tensorrt and not blocks else BRANCHES


def check(form: str, precision: str, where: str) -> None:
    """Refuse an unknown form, or the fused form in a precision its kernels do not run.

    Raises:
        ConfigError: one line naming ``where`` (``[export] experts``).
    """
    if form not in EXPERT_FORMS:
        raise ConfigError(f"{where} must be {', '.join(EXPERT_FORMS)}, got {form!r}")
    if form == FUSED and precision not in FUSED_PRECISIONS:
        raise ConfigError(f"{where} = \"{FUSED}\" needs precision {' or '.join(FUSED_PRECISIONS)} (ONNX Runtime's "
                          f"MoE/QMoE kernels), got {precision}; use {BRANCHES}")


def require_tensorrt(form: str, where: str, moe: bool = True) -> None:
    """Refuse a graph whose experts TensorRT cannot parse (a dense model, ``moe`` False, holds no experts whatever
    its entry records).

    Raises:
        ArtifactError: ``where``'s experts are fused ONNX Runtime operators; re-export with ``--experts branches``.
    """
    if form == FUSED and moe:
        raise ArtifactError(f"{where}'s routed experts are ONNX Runtime MoE/QMoE operators, which TensorRT cannot "
                            f"parse; re-export with --experts {BRANCHES}")


#: the ONNX Runtime operators of the fused form, ``(domain, op_type)``
FUSED_OPS = (("com.microsoft", "MoE"), ("com.microsoft", "QMoE"))


def disagreement(recorded: str, model, moe: bool) -> str | None:
    """Why the ONNX ``ModelProto`` ``model`` (weights not needed) does not hold the experts form ``recorded`` (a
    manifest's graph entry), or None: fused operators in a graph recorded as branches, or none in a graph of a MoE
    model (``moe``) recorded as fused (a dense model holds neither, whatever its entry says). Whether its ``QMoE``
    nodes are in the layout of the export's precision is :func:`mla_deploy.quant.formats.layout_disagreement`'s."""
    fused = any((node.domain, node.op_type) in FUSED_OPS for node in model.graph.node)
    if fused and recorded != FUSED:
        return f"it holds MoE/QMoE operators where the manifest records {recorded} experts"
    if moe and recorded == FUSED and not fused:
        return "the manifest records fused experts and it holds no MoE/QMoE operator"
    return None
