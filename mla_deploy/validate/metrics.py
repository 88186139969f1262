"""Error figures of one runner against the reference, per output per step, over the valid entries only.

Polygraphy's comparator gives the pass/fail verdict (and its own max errors); the figures here are computed
over real tokens and real cache rows, so zero padding never dilutes a mean or a cosine similarity. Relative
error is ``|out - ref| / |ref|`` with exact zeros of ``ref`` replaced by 2.2e-16, as Polygraphy does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

EPS = 2.220446049250313e-16


@dataclass
class StepFigures:
    """One output at one step.

    Attributes:
        step: 0 = prefill, k = decode step k.
        role: ``prefill`` or ``decode``.
        passed: Polygraphy's verdict for this output and step.
        max_abs, mean_abs, max_rel, mean_rel: over the valid entries.
        cosine: cosine similarity of the valid entries (1.0 when both are all zero).
        count: number of valid entries compared.
        polygraphy: the comparator's own figures (over the whole canonical tensors).
        nonfinite: NaN or Inf entries among the valid entries of the output or the reference (any fails the step).
    """

    step: int
    role: str
    passed: bool
    max_abs: float
    mean_abs: float
    max_rel: float
    mean_rel: float
    cosine: float
    count: int
    polygraphy: dict
    nonfinite: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def error_figures(out: np.ndarray, ref: np.ndarray, mask: np.ndarray | None) -> dict[str, float]:
    """``max_abs, mean_abs, max_rel, mean_rel, cosine, count, nonfinite`` of ``out`` against ``ref``; a NaN or
    Inf in either makes the error figures NaN (never a clean-looking number).

    Args:
        out, ref: same shape, e.g. ``[B, S, V]`` or ``[B, T, C]``.
        mask: boolean over the leading axes (``[B, S]`` / ``[B, T]``), True for real entries; None: all.
    """
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        raise ValueError(f"shapes differ: {out.shape} vs {ref.shape}")
    if mask is not None:
        mask = np.asarray(mask, dtype=bool)
        out, ref = out[mask], ref[mask]
    out, ref = out.reshape(-1), ref.reshape(-1)
    if out.size == 0:
        return {"max_abs": 0.0, "mean_abs": 0.0, "max_rel": 0.0, "mean_rel": 0.0, "cosine": 1.0, "count": 0,
                "nonfinite": 0}
    nonfinite = int((~np.isfinite(out)).sum() + (~np.isfinite(ref)).sum())
    if nonfinite:
        nan = float("nan")
        return {"max_abs": nan, "mean_abs": nan, "max_rel": nan, "mean_rel": nan, "cosine": nan,
                "count": int(out.size), "nonfinite": nonfinite}
    absdiff = np.abs(out - ref)
    denom = np.abs(ref)
    reldiff = absdiff / np.where(denom == 0, EPS, denom)
    norms = np.linalg.norm(out) * np.linalg.norm(ref)
    if norms > 0:
        cosine = float(np.dot(out, ref) / norms)
    else:
        cosine = 1.0 if not absdiff.any() else 0.0
    return {"max_abs": float(absdiff.max()), "mean_abs": float(absdiff.mean()), "max_rel": float(reldiff.max()),
            "mean_rel": float(reldiff.mean()), "cosine": cosine, "count": int(out.size), "nonfinite": 0}


def step_masks(feeds: Sequence[dict] | None, steps: int) -> list[tuple[np.ndarray | None, np.ndarray | None]]:
    """Per step, the valid-token mask ``[B, S]`` and valid-row mask ``[B, T]`` (``None, None`` without inputs)."""
    if feeds is None:
        return [(None, None)] * steps
    masks = []
    lengths = None
    for feed in feeds:
        valid = np.asarray(feed["valid"]) != 0
        if int(np.asarray(feed["step"]).reshape(-1)[0]) == 0 or lengths is None:
            lengths = np.zeros(valid.shape[0], dtype=np.int64)
        lengths = lengths + valid.sum(axis=1)
        rows = np.arange(int(lengths.max(initial=0)))[None, :] < lengths[:, None]
        masks.append((valid, rows))
    return masks


def top1_agreement(out_logits: np.ndarray, ref_logits: np.ndarray, mask: np.ndarray | None) -> dict[str, Any]:
    """How often the argmax token of ``out`` equals the reference's, over the valid positions; a position whose
    logits hold a NaN or Inf on either side never agrees.

    Returns: ``{"agree": n, "positions": m, "rate": n / m}``.
    """
    out_logits, ref_logits = np.asarray(out_logits), np.asarray(ref_logits)
    finite = np.isfinite(out_logits).all(-1) & np.isfinite(ref_logits).all(-1)
    same = (out_logits.argmax(-1) == ref_logits.argmax(-1)) & finite
    if mask is not None:
        same = same[np.asarray(mask, dtype=bool)]
    n, m = int(same.sum()), int(same.size)
    return {"agree": n, "positions": m, "rate": (n / m) if m else 1.0}


def severity(fig: dict[str, Any], atol: float) -> float:
    """``max_abs / atol`` (NaN errors count as infinitely bad): how the worst output is chosen."""
    value = fig["max_abs"]
    if value != value:  # NaN
        return float("inf")
    if atol <= 0:
        return float("inf") if value > 0 else 0.0
    return float(value / atol)
