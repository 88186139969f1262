"""What a quantized artifact's weights cost: the artifact as deployed against the unquantized original.

Validating an artifact with quantized weights is two comparisons over one trajectory:

(a) the graph: ONNX Runtime multiplying in float32 with the dequantized weights (``quantized_compute="fp32"``,
    runner :data:`EXACT`) against the PyTorch model carrying the same dequantized weights (``torch``), at the
    precision's tolerance, through Polygraphy's comparator like any artifact: it proves the graph right;
(b) the quantization: ONNX Runtime as deployed (int8 activations, runner :data:`DEPLOYED`) against the unquantized
    original (:data:`ORIGINAL`), judged by :func:`quantization_figures` against the recipe's
    ``[validate.quantization.<scheme>]`` thresholds (:class:`~mla_deploy.recipe.QuantizationThreshold`).

The trajectory of a quantized artifact has at least ``[validate] quantization_steps`` decode steps
(:func:`trajectory_steps`). :func:`cost_check` gives what (b) adds to a validation: nothing for float weights
(:class:`NoCost`), the runners, steps and report section of :class:`QuantizationCost` for quantized ones.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..errors import CacheCapacityError
from ..quant import EXACT_COMPUTE, FAST_COMPUTE

#: runner names: (a)'s ONNX Runtime runner, and (b)'s pair
EXACT, DEPLOYED, ORIGINAL = "onnxrt-fp32", "onnxrt-int8", "torch-unquantized"


def trajectory_steps(requested: int, minimum: int, longest_prompt: int, capacity: int | None) -> tuple[int, bool]:
    """The decode steps of a quantized artifact's trajectory: ``max(requested, minimum)``, clamped to what a static
    cache of ``capacity`` rows holds after the longest prompt (never below ``requested``).

    Returns: ``(steps, clamped)``.
    Raises:
        CacheCapacityError: not even the longest prompt fits (the requested steps are refused by the trajectory).
    """
    steps = max(requested, minimum)
    if capacity is None or longest_prompt + steps <= capacity:
        return steps, False
    room = capacity - longest_prompt
    if room < 0:
        raise CacheCapacityError(f"a {longest_prompt}-token prompt exceeds the static cache capacity {capacity}")
    return max(requested, room), True


def quantization_figures(out_steps: Sequence[dict], ref_steps: Sequence[dict],
                         token_masks: Sequence[np.ndarray | None]) -> dict[str, Any]:
    """Logits of the deployed artifact against the unquantized original, over every real token of a trajectory.

    Args:
        out_steps, ref_steps: per step, the runners' outputs (``logits [B, S, V]``).
        token_masks: per step, ``[B, S]`` True for a real token (None: every position).
    Returns:
        ``positions``; ``max_abs`` and ``max_abs_relative`` (over the largest ``|reference|``); the cosine
        similarity of each position's logits with the reference's, ``min_cosine`` and ``mean_cosine``; ``top1``
        (the fraction of positions with the reference's argmax) and ``top1_agree``; ``nonfinite`` (NaN/Inf among
        them: their cosine is NaN and they never agree); ``steps``: per step ``{step, positions, agree, max_abs,
        min_cosine}``.
    """
    steps, rows_out, rows_ref = [], [], []
    for k, (out, ref, mask) in enumerate(zip(out_steps, ref_steps, token_masks)):
        o = np.asarray(out["logits"], dtype=np.float64)
        r = np.asarray(ref["logits"], dtype=np.float64)
        keep = np.ones(o.shape[:2], dtype=bool) if mask is None or mask.shape != o.shape[:2] else mask.astype(bool)
        o, r = o[keep], r[keep]  # [positions, V]
        cos, agree, finite = _rows(o, r)
        steps.append({"step": k, "positions": int(len(o)), "agree": int(agree.sum()),
                      "max_abs": _max(np.abs(o - r).max(axis=-1) if len(o) else np.zeros(0), finite),
                      "min_cosine": float(cos.min()) if len(cos) else 1.0})
        rows_out.append(o)
        rows_ref.append(r)
    o, r = np.concatenate(rows_out), np.concatenate(rows_ref)
    cos, agree, finite = _rows(o, r)
    max_abs = _max(np.abs(o - r).max(axis=-1), finite)
    largest = _max(np.abs(r).max(axis=-1), finite)
    return {"positions": int(len(o)), "max_abs": max_abs, "max_abs_reference": largest,
            "max_abs_relative": _ratio(max_abs, largest),
            "min_cosine": float(cos.min()) if len(cos) else 1.0,
            "mean_cosine": float(cos.mean()) if len(cos) else 1.0,
            "top1": float(agree.mean()) if len(agree) else 1.0, "top1_agree": int(agree.sum()),
            "nonfinite": int((~finite).sum()), "steps": steps}


def _rows(out: np.ndarray, ref: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per position (``[P, V]`` rows): cosine similarity (NaN for a row with NaN/Inf; 1 for two zero rows), argmax
    agreement (never for a non-finite row) and finiteness."""
    finite = np.isfinite(out).all(-1) & np.isfinite(ref).all(-1)
    o, r = np.where(finite[:, None], out, 0.0), np.where(finite[:, None], ref, 0.0)
    norms = np.linalg.norm(o, axis=-1) * np.linalg.norm(r, axis=-1)
    same = (o == r).all(-1)
    cos = np.where(norms > 0, (o * r).sum(-1) / np.where(norms > 0, norms, 1.0), np.where(same, 1.0, 0.0))
    cos = np.where(finite, cos, np.nan)
    agree = (o.argmax(-1) == r.argmax(-1)) & finite if o.shape[-1] else finite
    return cos, agree, finite


def _max(values: np.ndarray, finite: np.ndarray) -> float:
    """The largest value, NaN when a row is not finite."""
    if not finite.all():
        return float("nan")
    return float(values.max()) if len(values) else 0.0


def _ratio(error: float, scale: float) -> float:
    """``error / scale``: NaN when either is NaN, 0 for no error, inf for an error against an all-zero reference."""
    if error != error or scale != scale:
        return float("nan")
    if scale > 0:
        return error / scale
    return float("inf") if error > 0 else 0.0


def judge(figures: dict[str, Any], threshold) -> list[str]:
    """What fails a :class:`~mla_deploy.recipe.QuantizationThreshold`: one phrase per failed bound (empty: passes;
    NaN figures always fail)."""
    failures = []
    if figures["nonfinite"]:
        failures.append(f"{figures['nonfinite']} positions hold NaN/Inf logits")
    if not figures["top1"] >= threshold.min_top1:
        failures.append(f"top-1 agreement {figures['top1'] * 100:.1f}% < {threshold.min_top1 * 100:.1f}%")
    if not figures["nonfinite"] and not figures["mean_cosine"] >= threshold.min_mean_cosine:
        failures.append(f"mean logits cosine {figures['mean_cosine']:.5f} < {threshold.min_mean_cosine}")
    return failures


def quantization_report(run_results, feeds: Sequence[dict] | None, manifest, settings,
                        trajectory: dict) -> dict[str, Any]:
    """The ``quantization`` section of ``report.json``: the scheme, the runners, the figures
    (:func:`quantization_figures`), the thresholds and the verdict.

    Args:
        run_results: Polygraphy ``RunResults`` holding :data:`DEPLOYED` and :data:`ORIGINAL`.
        feeds: the trajectory's feed dicts (which positions are real tokens; None: every position).
        manifest: the artifact's :class:`~mla_deploy.artifact.Manifest` (quantized).
        settings: its :class:`~mla_deploy.recipe.ValidateSettings`.
        trajectory: the report's trajectory record (``decode_steps``, ``quantization_steps_clamped``).
    """
    from . import compat
    from .metrics import step_masks

    quantization = manifest.quantization
    threshold = settings.quantization[quantization.weights]
    out, ref = compat.iteration_outputs(run_results, DEPLOYED), compat.iteration_outputs(run_results, ORIGINAL)
    masks = step_masks(feeds if feeds is not None and len(feeds) == len(ref) else None, len(ref))
    figures = quantization_figures(out, ref, [token for token, _ in masks])
    failures = judge(figures, threshold)
    return {"weights": quantization.weights, "block_size": quantization.block_size, "tensors": quantization.key_count,
            "runner": DEPLOYED, "reference": ORIGINAL, "compute": "int8 activations (ONNX Runtime MatMulNBits)",
            "decode_steps": len(figures["steps"]) - 1, "minimum_steps": settings.quantization_steps,
            "clamped": bool(trajectory.get("quantization_steps_clamped", False)),
            "thresholds": {"min_top1": threshold.min_top1, "min_mean_cosine": threshold.min_mean_cosine},
            **figures, "passed": not failures, "failures": failures}


def summary_line(section: dict[str, Any]) -> str:
    """One line: the quantization's verdict and figures (see :func:`quantization_report`)."""
    s = section
    head = (f"quantization ({s['weights']} weights, blocks of {s['block_size']}) "
            f"{'within its thresholds' if s['passed'] else 'exceeds its thresholds: ' + '; '.join(s['failures'])}")
    steps = f"prefill + {s['decode_steps']} decode steps" + (" (clamped to the static cache)" if s["clamped"] else "")
    return (f"{head}: {s['runner']} vs {s['reference']} over {s['positions']} positions ({steps}): top-1 agreement "
            f"{s['top1'] * 100:.1f}% (min {s['thresholds']['min_top1'] * 100:.1f}%), logits cosine mean "
            f"{s['mean_cosine']:.5f} (min {s['thresholds']['min_mean_cosine']}), worst {s['min_cosine']:.5f}, "
            f"max abs error {s['max_abs']:.3e} ({s['max_abs_relative'] * 100:.2f}% of max |logit| {s['max_abs_reference']:.3g})")


class NoCost:
    """What (b) adds to the validation of float weights: nothing (the graphs against PyTorch, as any artifact).

    Attributes:
        runners: the runners (b) compares (``(DEPLOYED, ORIGINAL)``; none here).
        exact: keyword arguments of the ONNX Runtime runner of (a) (:class:`~mla_deploy.validate.runners.OrtRunner`).
    """

    runners: tuple[str, ...] = ()
    exact: dict[str, str] = {}

    def decode_steps(self, requested: int, settings, longest_prompt: int, capacity: int | None) -> tuple[int, bool]:
        """The trajectory's decode steps (see :func:`trajectory_steps`) and whether a static cache clamped them."""
        return requested, False

    def runners_for(self, root, manifest, provider: str, threads: int | None, use_engine: bool = True,
                    cuda=None) -> list:
        """The runners (b) adds: ONNX Runtime as deployed (its CPU engine when ``use_engine`` and it has one), the
        unquantized PyTorch original."""
        return []

    def record(self, trajectory: dict, clamped: bool) -> dict:
        """The report's trajectory record."""
        return trajectory

    def judged(self, report: dict, run_results, feeds, manifest, settings) -> dict:
        """``report`` with (b)'s section (:func:`quantization_report`) and verdict."""
        return report


class QuantizationCost(NoCost):
    """(b) for quantized weights: :data:`DEPLOYED` against :data:`ORIGINAL` over at least ``[validate]
    quantization_steps`` decode steps; (a) runs ONNX Runtime in exact fp32 products (:data:`EXACT`)."""

    runners = (DEPLOYED, ORIGINAL)
    exact = {"name": EXACT, "quantized_compute": EXACT_COMPUTE}

    def decode_steps(self, requested, settings, longest_prompt, capacity):
        if requested < 0:  # refused by the trajectory, as for any artifact
            return requested, False
        return trajectory_steps(requested, settings.quantization_steps, longest_prompt, capacity)

    def runners_for(self, root, manifest, provider, threads, use_engine=True, cuda=None):
        from .runners import OrtRunner, TorchRunner

        return [OrtRunner(root, provider=provider, threads=threads, name=DEPLOYED, quantized_compute=FAST_COMPUTE,
                          use_engine=use_engine, cuda=cuda),
                TorchRunner.from_artifact(root, manifest, ORIGINAL, quantized=False)]

    def record(self, trajectory, clamped):
        return {**trajectory, "quantization_steps_clamped": clamped}

    def judged(self, report, run_results, feeds, manifest, settings):
        section = quantization_report(run_results, feeds, manifest, settings, report["trajectory"])
        return {**report, "passed": bool(report["passed"]) and section["passed"], "quantization": section}


def cost_check(manifest) -> NoCost:
    """What (b) adds to the validation of the artifact of ``manifest``."""
    return QuantizationCost() if manifest.quantization.quantized else NoCost()
