"""``report.html``: one self-contained page (inline CSS, plots as base64 PNG made with matplotlib, the optional
``report`` extra: without it the page has the tables and a note instead of the plots).

Sections: the verdict and worst output; the artifact and environment; the plots (logits error and each layer's
latent cache error across the steps, prefill at step 0); top-1 token agreement; for quantized weights, the
quantization's cost against the unquantized original; one table per output with max/mean absolute and relative
error and cosine similarity per step.
"""

from __future__ import annotations

import base64
import html
import io
import math
from typing import Any

FLOOR = 1e-12  # an exact match is drawn at this height on the log-scale plots

CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1100px;color:#1f2328;
padding:0 16px}
h1{font-size:22px;margin:0 0 8px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #d0d7de;padding-bottom:4px}
h3{font-size:15px;margin:18px 0 6px}
.verdict{display:inline-block;padding:6px 14px;border-radius:6px;font-weight:700;font-size:18px;color:#fff}
.pass{background:#1a7f37}.fail{background:#cf222e}
table{border-collapse:collapse;font-size:13px;margin:6px 0 12px}
th,td{border:1px solid #d0d7de;padding:3px 8px;text-align:right}th{background:#f6f8fa}
td.l,th.l{text-align:left}tr.bad td{background:#ffebe9}
.ok{color:#1a7f37;font-weight:600}.ko{color:#cf222e;font-weight:700}
code{background:#f6f8fa;padding:1px 4px;border-radius:4px}
.muted{color:#656d76;font-size:12px}img{max-width:100%;border:1px solid #d0d7de;border-radius:6px}
"""


def render_html(report: dict[str, Any]) -> str:
    """The page for a report dict built by :func:`mla_deploy.validate.report.build_report`."""
    e = html.escape
    art, cmp_, env = report["artifact"], report["comparison"], report["environment"]
    passed = report["passed"]
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
             f"<title>mla-deploy validation: {e(str(art['name']))} {'PASS' if passed else 'FAIL'}</title>"
             f"<style>{CSS}</style></head><body>",
             f"<h1>mla-deploy validation of <code>{e(str(art['name']))}</code></h1>",
             f"<p><span class='verdict {'pass' if passed else 'fail'}'>{'PASS' if passed else 'FAIL'}</span> "
             f"&nbsp;{e(_summary_line(report))}</p>"]
    parts.append("<h2>Artifact and environment</h2>" + _kv_table([
        ("artifact", art["path"]), ("precision", art["precision"]), ("cache mode", art["cache_mode"]),
        ("layers", art["layers"]), ("fingerprint", art["fingerprint"]),
        ("graphs", ", ".join(f"{r}: {g.get('form')} ({str(g.get('sha256'))[:12]})" for r, g in art["graphs"].items())),
        ("trajectory", _trajectory_line(report["trajectory"])),
        ("reference", cmp_["reference"]), ("compared", ", ".join(cmp_["runners"])),
        ("providers", ", ".join(f"{k}: {v}" for k, v in env.get("providers", {}).items()) or "not recorded"),
        ("check", f"{cmp_['check_error_stat']} (an element fails when it exceeds both atol and rtol)"),
        ("tolerances", "; ".join(f"{k}: atol {v['atol']:.1e}, rtol {v['rtol']:.1e}" for k, v in cmp_["tolerances"].items())),
        ("versions", ", ".join(f"{k} {v}" for k, v in env.get("versions", {}).items())),
        ("platform", env.get("platform", "")),
    ]))
    parts.append("<h2>Error across steps</h2><p class='muted'>Step 0 is the prefill; steps 1.. are teacher-forced "
                 "decode steps. Errors are over real tokens and cache rows only; a cache's error at a step covers every "
                 f"row it holds after that step (earlier rows included); an exact match is drawn at {FLOOR:.0e}.</p>")
    try:
        import matplotlib  # noqa: F401  (the optional "report" extra)
    except ImportError:
        parts.append("<p class='ko'>matplotlib is not installed: no plots (pip install 'mla-deploy[report]'); "
                     "the tables below hold every figure.</p>")
    else:
        parts.append(_img(_logits_plot(report), "logits error across steps"))
        parts.append(_img(_cache_plot(report), "latent cache error per layer across steps"))
    parts.append("<h2>Top-1 token agreement</h2>" + _top1_table(report))
    if report.get("quantization"):
        parts.append(_quantization_section(report["quantization"]))
    parts.append("<h2>Per output</h2>")
    for runner, data in report["runners"].items():
        for name, out in data["outputs"].items():
            tol = cmp_["tolerances"].get(name, {})
            status = "<span class='ok'>pass</span>" if out["passed"] else "<span class='ko'>FAIL</span>"
            parts.append(f"<h3><code>{e(name)}</code> &mdash; {e(runner)} vs {e(cmp_['reference'])} &mdash; {status} "
                         f"<span class='muted'>(atol {tol.get('atol', 0):.1e}, rtol {tol.get('rtol', 0):.1e})</span></h3>")
            parts.append(_steps_table(out["steps"]))
    parts.append("<p class='muted'>Generated by mla-deploy validate; figures in report.json.</p></body></html>")
    return "\n".join(parts)


def _summary_line(report: dict) -> str:
    w, s = report.get("worst"), report["summary"]
    head = f"{s['compared'] - s['failed']} of {s['compared']} output-steps within tolerance."
    if not w:
        return head
    kind = "Worst" if w["passed"] else "Worst failure"
    q = report.get("quantization")
    cost = f" Quantization: {'within' if q['passed'] else 'exceeds'} its thresholds." if q else ""
    return (f"{head} {kind}: {w['output']} at step {w['step']} ({w['role']}), {w['runner']}: "
            f"max abs {w['max_abs']:.3e} (atol {w['atol']:.1e}), max rel {w['max_rel']:.3e} (rtol {w['rtol']:.1e})."
            + cost)


def _trajectory_line(t: dict) -> str:
    if "batch" not in t:
        return f"loaded from {t.get('source')}"
    return (f"batch {t['batch']}, prompt lengths {t.get('prompt_lengths')}, {t.get('decode_steps')} decode steps, "
            f"seed {t.get('seed')} ({'run' if t.get('source') == 'run' else 'loaded from ' + str(t.get('source'))})")


def _kv_table(rows) -> str:
    body = "".join(f"<tr><th class='l'>{html.escape(str(k))}</th><td class='l'>{html.escape(str(v))}</td></tr>"
                   for k, v in rows)
    return f"<table>{body}</table>"


def _steps_table(steps: list[dict]) -> str:
    head = ("<tr><th>step</th><th class='l'>role</th><th>max abs</th><th>mean abs</th><th>max rel</th>"
            "<th>mean rel</th><th>cosine</th><th>entries</th><th class='l'>result</th></tr>")
    rows = []
    for s in steps:
        result = "<span class='ok'>pass</span>" if s["passed"] else "<span class='ko'>FAIL</span>"
        rows.append(f"<tr class='{'' if s['passed'] else 'bad'}'><td>{s['step']}</td><td class='l'>{s['role']}</td>"
                    f"<td>{s['max_abs']:.3e}</td><td>{s['mean_abs']:.3e}</td><td>{s['max_rel']:.3e}</td>"
                    f"<td>{s['mean_rel']:.3e}</td><td>{s['cosine']:.9f}</td><td>{s['count']}</td>"
                    f"<td class='l'>{result}</td></tr>")
    return f"<table>{head}{''.join(rows)}</table>"


def _top1_table(report: dict) -> str:
    parts = []
    for runner, data in report["runners"].items():
        head = "<tr><th class='l'>step</th>" + "".join(f"<th>{t['step']}</th>" for t in data["top1"]) + "<th>all</th></tr>"
        row = (f"<tr><td class='l'>{html.escape(runner)} = {html.escape(report['comparison']['reference'])}</td>"
               + "".join(f"<td>{t['agree']}/{t['positions']}</td>" for t in data["top1"])
               + f"<td><b>{data['top1_rate'] * 100:.1f}%</b></td></tr>")
        parts.append(f"<table>{head}{row}</table>")
    return "".join(parts)


def _quantization_section(q: dict) -> str:
    """The quantization's cost: figures against thresholds, then top-1 agreement and worst cosine per step."""
    e = html.escape
    t = q["thresholds"]
    verdict = "<span class='ok'>pass</span>" if q["passed"] else "<span class='ko'>FAIL</span>"
    steps = f"prefill + {q['decode_steps']} decode steps" + (" (clamped to the static cache)" if q["clamped"] else "")
    head = (f"<h2>Quantization &mdash; {verdict}</h2><p>{e(q['weights'])} weights in blocks of {q['block_size']} "
            f"({q['tensors']} tensors): <code>{e(q['runner'])}</code> (as deployed: {e(q['compute'])}) vs "
            f"<code>{e(q['reference'])}</code> (the unquantized original), logits of {q['positions']} positions "
            f"({steps}). The comparison above uses a reference carrying the same dequantized weights.</p>")
    rows = _kv_table([
        ("top-1 agreement", f"{q['top1'] * 100:.2f}% ({q['top1_agree']}/{q['positions']}), at least "
                            f"{t['min_top1'] * 100:.1f}%"),
        ("mean logits cosine", f"{q['mean_cosine']:.6f}, at least {t['min_mean_cosine']}"),
        ("worst logits cosine", f"{q['min_cosine']:.6f}"),
        ("max abs error", f"{q['max_abs']:.3e} ({q['max_abs_relative'] * 100:.2f}% of max |logit| "
                          f"{q['max_abs_reference']:.3g})"),
        ("result", "pass" if q["passed"] else "; ".join(q["failures"])),
    ])
    per_step = ("<table><tr><th>step</th><th>top-1</th><th>worst cosine</th><th>max abs</th></tr>"
                + "".join(f"<tr><td>{s['step']}</td><td>{s['agree']}/{s['positions']}</td>"
                          f"<td>{s['min_cosine']:.6f}</td><td>{s['max_abs']:.3e}</td></tr>" for s in q["steps"])
                + "</table>")
    return head + rows + per_step


def _img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f"<p><img alt='{html.escape(alt)}' src='data:image/png;base64,{data}'></p>"


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


def _floor(values):
    return [v if (v > FLOOR or math.isnan(v)) else FLOOR for v in values]


def _style_axis(ax, steps: int, atol: float | None) -> None:
    ax.set_yscale("log")
    ax.set_xlabel("step (0 = prefill)")
    ax.set_xticks(range(steps) if steps <= 24 else range(0, steps, max(1, steps // 12)))
    if atol:
        ax.axhline(atol, color="#cf222e", linestyle="--", linewidth=1, label=f"atol {atol:.0e}")
    ax.grid(True, which="major", alpha=0.3)


def _logits_plot(report: dict) -> bytes:
    fig = _figure(10, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    atol = report["comparison"]["tolerances"].get("logits", {}).get("atol")
    steps = report["summary"]["steps"]
    for runner, data in report["runners"].items():
        figs = data["outputs"]["logits"]["steps"]
        x = [f["step"] for f in figs]
        ax.plot(x, _floor([f["max_abs"] for f in figs]), marker="o", label=f"{runner}: max abs")
        ax.plot(x, _floor([f["mean_abs"] for f in figs]), marker=".", linestyle=":", label=f"{runner}: mean abs")
    _style_axis(ax, steps, atol)
    ax.set_ylabel("absolute error")
    ax.set_title("logits: error vs the PyTorch reference")
    ax.legend(fontsize=8, loc="best")
    return _png(fig)


def _cache_plot(report: dict) -> bytes:
    """One line per layer (max abs error of its latent cache rows); a heatmap when there are many layers."""
    runners = list(report["runners"].items())
    steps = report["summary"]["steps"]
    fig = _figure(10, 3.6 * len(runners))
    for index, (runner, data) in enumerate(runners, start=1):
        ax = fig.add_subplot(len(runners), 1, index)
        layers = [(n, o) for n, o in data["outputs"].items() if n != "logits"]
        atol = report["comparison"]["tolerances"].get(layers[0][0], {}).get("atol") if layers else None
        if len(layers) <= 12:
            for name, out in layers:
                figs = out["steps"]
                ax.plot([f["step"] for f in figs], _floor([f["max_abs"] for f in figs]), marker="o",
                        markersize=3, label=name)
            _style_axis(ax, steps, atol)
            ax.set_ylabel("max absolute error")
            ax.legend(fontsize=8, loc="best", ncol=2)
        else:
            import numpy as np

            grid = np.array([[max(f["max_abs"], FLOOR) for f in out["steps"]] for _, out in layers])
            image = ax.imshow(np.log10(grid), aspect="auto", cmap="viridis", interpolation="nearest")
            fig.colorbar(image, ax=ax, label="log10 max abs error")
            ax.set_ylabel("layer")
            ax.set_xlabel("step (0 = prefill)")
        ax.set_title(f"latent cache present_latent.{{i}}: {runner} vs {report['comparison']['reference']}")
    return _png(fig)
