"""The validation report: ``report.json`` (every figure), ``report.md`` (a pull-request summary) and
``report.html`` (:mod:`.report_html`), beside Polygraphy's ``run_results.json`` and ``inputs.json`` of the run.
The files are written into a hidden folder and moved into place together (:func:`write_reports`).

``report.json`` layout::

    {"format": "mla-deploy-validation", "format_version": 1, "passed": bool,
     "artifact": {"path", "name", "fingerprint", "precision", "cache_mode", "layers", "graphs": {role: sha256}},
     "environment": {"versions": {...}, "providers": {runner: provider}, "platform": ...},
     "trajectory": {"batch", "prompt_lengths", "decode_steps", "seed", "source", ...},
     "comparison": {"reference": "torch", "check_error_stat": "elemwise",
                    "tolerances": {output: {"atol", "rtol"}}},
     "runners": {name: {"passed", "outputs": {output: {"passed", "max_abs", "max_rel", "mean_abs", "min_cosine",
                                                        "steps": [StepFigures...]}},
                        "top1": [{"step", "agree", "positions", "rate"}...]}},
     "summary": {"compared", "failed", "steps"}, "worst": {...} | null,
     "quantization": {...}}   # quantized weights only: :func:`.quantization.quantization_report`

``passed`` holds for quantized weights only when both the graphs' comparison (``runners``, against a reference
carrying the same dequantized weights) and the quantization's cost (``quantization``) pass.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .. import host
from ..artifact import Manifest
from ..artifact.files import remove_stale, temp_name
from .metrics import StepFigures, error_figures, severity, step_masks, top1_agreement
from .trajectory import step_role

FORMAT = "mla-deploy-validation"
FORMAT_VERSION = 1
RESULTS_FILE = "run_results.json"
INPUTS_FILE = "inputs.json"
REPORT_JSON, REPORT_HTML, REPORT_MD = "report.json", "report.html", "report.md"
REPORT_FILES = (REPORT_JSON, REPORT_HTML, REPORT_MD)


def environment(providers: dict[str, str]) -> dict[str, Any]:
    """Versions of what ran the validation and the providers each runner actually used."""
    import importlib.metadata as md

    versions = {"python": platform.python_version()}
    for dist in ("mla-deploy", "numpy", "torch", "onnx", "onnxruntime", "onnxruntime-gpu", "polygraphy",
                 "matplotlib", "tensorrt"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            continue
    return {"versions": versions, "providers": dict(providers), "platform": platform.platform(),
            "machine": host.machine()}


@dataclass(frozen=True)
class Comparison:
    """What a report compares: the reference runner, the runners compared with it, the outputs (``logits``, then
    ``present_latent.{i}``), their tolerances (``{"": default, output: Tolerance}``) and Polygraphy's statistic."""

    reference: str
    others: tuple[str, ...]
    names: tuple[str, ...]
    tolerances: dict
    check_error_stat: str


@dataclass(frozen=True)
class RunRecord:
    """One trajectory's run: Polygraphy's ``RunResults``, the feeds of each step (None: unknown, figures over whole
    tensors), the trajectory's description and where the results came from (``run`` or a saved file)."""

    run_results: Any
    feeds: list[dict] | None
    trajectory: dict
    source: str


def build_report(root: Path, manifest: Manifest, run: RunRecord, accuracy, compared: Comparison,
                 env: dict) -> dict[str, Any]:
    """Every figure of a comparison as plain data (see the module docstring)."""
    from . import compat

    ref_steps = compat.iteration_outputs(run.run_results, compared.reference)
    feeds = run.feeds if run.feeds is not None and len(run.feeds) == len(ref_steps) else None  # else another run's
    masks = step_masks(feeds, len(ref_steps))
    candidates: list = []
    runners = {runner: _runner_section(run.run_results, accuracy, compared, runner, masks, candidates)
               for runner in compared.others}
    tolerances = compared.tolerances
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "passed": all(r["passed"] for r in runners.values()),
        "artifact": {"path": str(root), "name": manifest.name, "fingerprint": manifest.fingerprint,
                     "precision": manifest.precision, "cache_mode": manifest.layout.mode,
                     "layers": len(compared.names) - 1,
                     "graphs": {role: {"file": g.file, "form": g.form, "sha256": g.sha256}
                                for role, g in manifest.graphs.items()}},
        "environment": env,
        "trajectory": {**run.trajectory, "source": run.source, "valid_masks": feeds is not None},
        "comparison": {"reference": compared.reference, "runners": list(compared.others),
                       "check_error_stat": compared.check_error_stat,
                       "tolerances": {k: {"atol": t.atol, "rtol": t.rtol} for k, t in tolerances.items() if k}},
        "runners": runners,
        "summary": {"steps": len(ref_steps), "compared": len(candidates),
                    "failed": sum(1 for c in candidates if c[0])},
        "worst": _worst(candidates, compared.reference),
    }


def _runner_section(run_results, accuracy, compared: Comparison, runner: str, masks: list,
                    candidates: list) -> dict[str, Any]:
    """One runner's figures against the reference, per output and step; appends each output-step to
    ``candidates`` as ``(failed, severity, runner, output, StepFigures, Tolerance)`` for :func:`_worst`."""
    from . import compat

    reference = compared.reference
    verdicts = compat.pair_results(accuracy, (runner, reference))
    out_steps = compat.iteration_outputs(run_results, runner)
    ref_steps = compat.iteration_outputs(run_results, reference)
    outputs: dict[str, Any] = {}
    for name in compared.names:
        tol = compared.tolerances.get(name, compared.tolerances[""])
        figures = []
        for step, (verdict, out, ref, (token_mask, row_mask)) in enumerate(zip(verdicts, out_steps, ref_steps, masks)):
            mask = token_mask if name == "logits" else row_mask
            poly = compat.output_figures(verdict[name]) if name in verdict else {"passed": False}
            fig = error_figures(out[name], ref[name], mask if _fits(mask, out[name]) else None)
            passed = bool(poly["passed"]) and not fig["nonfinite"]  # NaN never passes, whatever the stat
            figures.append(StepFigures(step=step, role=step_role(step), passed=passed, polygraphy=poly, **fig))
            candidates.append((not figures[-1].passed, severity(fig, tol.atol), runner, name, figures[-1], tol))
        outputs[name] = _output_summary(figures)
    top1 = [{"step": k, "role": step_role(k), **top1_agreement(o["logits"], r["logits"], masks[k][0])}
            for k, (o, r) in enumerate(zip(out_steps, ref_steps))]
    return {"passed": all(o["passed"] for o in outputs.values()), "outputs": outputs, "top1": top1,
            "top1_rate": _rate(top1)}


def _output_summary(figures: list) -> dict[str, Any]:
    """One output's figures over the steps: verdict, extremes, failing steps, and each step's figures."""
    return {
        "passed": all(f.passed for f in figures),
        "max_abs": _extreme(max, [f.max_abs for f in figures], 0.0),
        "max_rel": _extreme(max, [f.max_rel for f in figures], 0.0),
        "mean_abs": (sum(f.mean_abs for f in figures) / len(figures)) if figures else 0.0,
        "min_cosine": _extreme(min, [f.cosine for f in figures], 1.0),
        "failed_steps": [f.step for f in figures if not f.passed],
        "nonfinite": sum(f.nonfinite for f in figures),
        "steps": [f.to_dict() for f in figures],
    }


def _worst(candidates: list, reference: str) -> dict[str, Any] | None:
    """The output-step farthest from its tolerance (a failing one first); None when nothing was compared."""
    if not candidates:
        return None
    failed, sev, runner, name, fig, tol = max(candidates, key=lambda c: (c[0], c[1]))
    return {"runner": runner, "reference": reference, "output": name, "step": fig.step, "role": fig.role,
            "max_abs": fig.max_abs, "max_rel": fig.max_rel, "mean_abs": fig.mean_abs, "cosine": fig.cosine,
            "atol": tol.atol, "rtol": tol.rtol, "passed": not failed, "severity": sev, "nonfinite": fig.nonfinite}


def _extreme(pick, values: list[float], default: float) -> float:
    """``pick`` (max or min) of ``values``; NaN when any is NaN (Python's max would depend on the order)."""
    if any(v != v for v in values):
        return float("nan")
    return pick(values, default=default)


def _fits(mask, array) -> bool:
    return mask is not None and tuple(mask.shape) == tuple(array.shape[:2])


def _rate(top1: list[dict]) -> float:
    positions = sum(t["positions"] for t in top1)
    return sum(t["agree"] for t in top1) / positions if positions else 1.0


def write_reports(out: Path, report: dict, run_results=None, feeds: list[dict] | None = None) -> dict[str, Path]:
    """Write ``run_results.json`` and ``inputs.json`` (when given) and the three reports into ``out``, all or none:
    they are written into a hidden folder in ``out`` first and moved into place together, with SIGINT, SIGTERM and
    SIGHUP held back for the moves (a signal then arrives after the last one). On any failure, an interrupt
    included, nothing in ``out`` changed (and ``out`` is removed again when this call made it).

    Returns: ``{file name: path}`` of what was written.
    """
    out = Path(out)
    missing = [p for p in (out, *out.parents) if not p.exists()]  # created here; removed again if nothing is written
    out.mkdir(parents=True, exist_ok=True)
    remove_stale(out / "reports")
    stage = temp_name(out / "reports")
    try:
        stage.mkdir()
        names = _write_all(stage, report, run_results, feeds)
        with _signals_held():
            for name in names:
                os.replace(stage / name, out / name)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        for folder in missing:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty
        raise
    shutil.rmtree(stage, ignore_errors=True)
    return {name: out / name for name in names}


def _write_all(folder: Path, report: dict, run_results, feeds) -> list[str]:
    """Write the files of :func:`write_reports` into ``folder``; their names."""
    from . import compat
    from .report_html import render_html

    names = []
    with compat.quiet():
        if run_results is not None:
            compat.save_run_results(run_results, folder / RESULTS_FILE)
            names.append(RESULTS_FILE)
        if feeds is not None:
            compat.save_feed_dicts(feeds, folder / INPUTS_FILE)
            names.append(INPUTS_FILE)
    report = {**report, "files": {**{k: k for k in names}, **{k: k for k in REPORT_FILES}}}
    for name, text in ((REPORT_JSON, json.dumps(report, indent=2, default=_json_default) + "\n"),
                       (REPORT_MD, render_markdown(report)), (REPORT_HTML, render_html(report))):
        (folder / name).write_bytes(text.encode("utf-8"))
        names.append(name)
    return names


@contextlib.contextmanager
def _signals_held():
    """Hold SIGINT, SIGTERM and SIGHUP back in this thread until the block ends (where the platform can)."""
    import signal

    held = {getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)}
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _json_default(value):
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def render_markdown(report: dict) -> str:
    """A short summary for a pull request: verdict, worst output, one table row per output and runner."""
    art, cmp_ = report["artifact"], report["comparison"]
    verdict = "PASS" if report["passed"] else "FAIL"
    env = report["environment"]
    lines = [f"### mla-deploy validation: **{verdict}**", "",
             f"`{art['name']}` ({art['precision']}, {art['cache_mode']} cache, {art['layers']} layers, "
             f"fingerprint `{art['fingerprint']}`) vs the PyTorch original ({cmp_['reference']}"
             f"{', with the same dequantized weights' if report.get('quantization') else ''}); "
             f"{report['summary']['steps']} steps (prefill + {report['summary']['steps'] - 1} decode), "
             f"{cmp_['check_error_stat']} check.", ""]
    w = report.get("worst")
    if w:
        state = "worst" if w["passed"] else "**worst failure**"
        if w.get("nonfinite"):
            lines += [f"{state}: `{w['output']}` at step {w['step']} ({w['role']}), {w['runner']}: **{w['nonfinite']} "
                      f"NaN/Inf values** (in the output or the reference)", ""]
        else:
            lines += [f"{state}: `{w['output']}` at step {w['step']} ({w['role']}), {w['runner']}: max abs "
                      f"{w['max_abs']:.3e} (atol {w['atol']:.1e}), max rel {w['max_rel']:.3e} "
                      f"(rtol {w['rtol']:.1e})", ""]
    stat = cmp_["check_error_stat"]
    rule = ("an element fails only if its absolute error exceeds atol **and** its absolute error exceeds "
            "rtol x |reference|, so a max rel above rtol can still pass" if stat == "elemwise" else
            f"an output fails only if the {stat} absolute error exceeds atol **and** the {stat} relative error "
            f"exceeds rtol")
    lines += [f"Tolerance rule (Polygraphy, {stat}): {rule}; any NaN or Inf fails.", ""]
    lines += ["| runner | output | max abs | mean abs | max rel | min cosine | atol / rtol | result |",
              "|---|---|---|---|---|---|---|---|"]
    for runner, data in report["runners"].items():
        for name, out in data["outputs"].items():
            tol = cmp_["tolerances"].get(name, {})
            result = "pass" if out["passed"] else f"**fail** (steps {_steps(out['failed_steps'])})"
            lines.append(f"| {runner} | `{name}` | {out['max_abs']:.2e} | {out['mean_abs']:.2e} | "
                         f"{out['max_rel']:.2e} | {out['min_cosine']:.8f} | {tol.get('atol', 0):.0e} / "
                         f"{tol.get('rtol', 0):.0e} | {result} |")
    lines.append("")
    for runner, data in report["runners"].items():
        lines.append(f"top-1 agreement {runner} vs {cmp_['reference']}: {data['top1_rate'] * 100:.1f}% of "
                     f"{sum(t['positions'] for t in data['top1'])} positions")
    if report.get("quantization"):
        lines += [""] + _quantization_markdown(report["quantization"])
    versions = env.get("versions", {})
    shown = ", ".join(f"{k} {v}" for k, v in versions.items() if k in ("torch", "onnxruntime", "onnxruntime-gpu",
                                                                         "polygraphy", "mla-deploy"))
    providers = ", ".join(f"{k}: {v}" for k, v in env.get("providers", {}).items())
    lines += ["", f"<sub>{shown}; providers: {providers or 'not recorded'}</sub>", ""]
    return "\n".join(lines)


def _quantization_markdown(q: dict) -> list[str]:
    """The quantization's cost: what it compares, a table of figures against thresholds, the verdict."""
    t = q["thresholds"]
    steps = f"prefill + {q['decode_steps']} decode steps" + (" (clamped to the static cache)" if q["clamped"] else "")
    return [f"#### Quantization: **{'PASS' if q['passed'] else 'FAIL'}**", "",
            f"{q['weights']} weights in blocks of {q['block_size']} ({q['tensors']} tensors): `{q['runner']}` (as "
            f"deployed: {q['compute']}) vs `{q['reference']}` (the unquantized original), logits of "
            f"{q['positions']} positions ({steps}). The graphs themselves are compared above against a reference "
            f"carrying the same dequantized weights.", "",
            "| figure | value | threshold |", "|---|---|---|",
            f"| top-1 agreement | {q['top1'] * 100:.2f}% ({q['top1_agree']}/{q['positions']}) | "
            f">= {t['min_top1'] * 100:.1f}% |",
            f"| mean logits cosine | {q['mean_cosine']:.6f} | >= {t['min_mean_cosine']} |",
            f"| worst logits cosine | {q['min_cosine']:.6f} | |",
            f"| max abs error | {q['max_abs']:.3e} ({q['max_abs_relative'] * 100:.2f}% of max abs logit "
            f"{q['max_abs_reference']:.3g}) | |", ""] + ([f"fails: {'; '.join(q['failures'])}", ""] if q["failures"]
                                                          else [])


def _steps(steps: list[int], limit: int = 6) -> str:
    shown = ", ".join(map(str, steps[:limit]))
    return shown + (f", ... ({len(steps)} total)" if len(steps) > limit else "")
