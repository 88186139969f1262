"""What the attention bench shows and writes: the printed table, bench.md and bench.png."""

from __future__ import annotations

from pathlib import Path

from ..reporting import format_bytes, format_ms, machine_line

TABLE_HEAD = ("path", "T", "B", "median ms", "spread", "tok/s", "x naive", "cache/token", "cache total",
              "peak mem", "bound ms", "achieved/bound")


def table_rows(report: dict) -> list[tuple]:
    out = []
    for r in report["rows"]:
        if r["status"] != "ok":
            out.append((r["path"], r["context"], r["batch"], r["status"], "", "", "",
                        format_bytes(r["cache_bytes_per_token"]),
                        format_bytes(r["cache_bytes_total"]), "", "", r.get("detail") or ""))
            continue
        lat, roof = r["latency_ms"], r.get("roofline")
        out.append((r["path"], r["context"], r["batch"], f"{lat['median']:.2f}", f"{lat['pass_spread']:.0%}",
                    f"{r['tokens_per_s']:.1f}", f"{r['speedup_vs_naive']:.1f}x" if r.get("speedup_vs_naive") else "-",
                    format_bytes(r["cache_bytes_per_token"]), format_bytes(r["cache_bytes_total"]),
                    format_bytes(r["peak_memory_bytes"]),
                    f"{format_ms(roof['bound_ms'])} {roof['bound'][:3]}" if roof else "-",
                    f"{roof['achieved_over_bound']:.2f}x" if roof else "-"))
    return out


def format_table(report: dict) -> str:
    """The plain-text table the command prints, plus the machine line, unavailable paths and the targets."""
    rows = [TABLE_HEAD] + [tuple(str(x) for x in r) for r in table_rows(report)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(TABLE_HEAD))]
    lines = [machine_line(report), report["unit"], ""]
    for i, r in enumerate(rows):
        lines.append("  ".join(x.rjust(w) if 0 < j < len(r) - 1 else x.ljust(w) for j, (x, w) in enumerate(zip(r, widths))).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    for path, info in report["paths"].items():
        if not info["available"]:
            lines.append(f"{path}: not available ({info['reason']})")
    lines.append("achieved/bound: measured step time / roofline bound (1.00x = at the bound); "
                 "spread: (max - min pass median) / median")
    if report["targets"]:
        lines.append("targets (defined for DeepSeek-V2-Lite attention shapes, CPU, fp32):")
        for t in report["targets"]:
            lines.append(f"  [{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['value']:.2f} "
                         f"({t['kind']} {t['threshold']})")
    return "\n".join(lines)


def markdown(report: dict) -> str:
    """bench.md: the protocol, the table per batch size, the unavailable paths, the targets."""
    p = report["protocol"]
    lines = [f"# mla-deploy bench attention: {report['model']['name']}", "",
             f"Unit: {report['unit']}.", "", f"Machine: {machine_line(report)}.", "",
             f"Protocol: {p['threads']} threads, {p['warmup']} warm-up calls, up to {p['repeat']} timed calls "
             f"(at most {p['max_seconds_per_point']:g} s) per point and pass, {p['passes']} pass(es); {p['order']}; "
             f"{p['latency']}. ORT: {p['ort']}. Static capacity {p['static_capacity']}. {p['roofline']}.", ""]
    if report.get("command"):
        lines += [f"Command: `{report['command']}`", ""]
    head = ("path", "T", "B", "median ms", "p10-p90 ms", "pass medians ms", "tok/s", "x naive", "static/concat",
            "cache/token", "cache total", "peak mem", "bound ms", "bound/achieved", "achieved/bound", "max abs diff")
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["rows"]:
        if r["status"] != "ok":
            cells = [r["path"], r["context"], r["batch"], f"**{r['status']}**: {r.get('detail') or ''}"] + [""] * 5 + \
                    [format_bytes(r["cache_bytes_per_token"]), format_bytes(r["cache_bytes_total"])] + [""] * 5
        else:
            lat, roof = r["latency_ms"], r.get("roofline")
            cells = [r["path"], r["context"], r["batch"], f"{lat['median']:.2f}", f"{lat['p10']:.2f}-{lat['p90']:.2f}",
                     " / ".join(f"{m:.2f}" for m in lat["pass_medians"]), f"{r['tokens_per_s']:.1f}",
                     f"{r['speedup_vs_naive']:.1f}x" if r.get("speedup_vs_naive") else "-",
                     f"{r['static_speedup_over_concat']:.2f}x" if r.get("static_speedup_over_concat") else "-",
                     format_bytes(r["cache_bytes_per_token"]), format_bytes(r["cache_bytes_total"]),
                    format_bytes(r["peak_memory_bytes"]),
                     f"{format_ms(roof['bound_ms'])} ({roof['bound']})" if roof else "-",
                     f"{roof['bound_over_achieved']:.2f}" if roof else "-",
                     f"{roof['achieved_over_bound']:.2f}x" if roof else "-",
                     f"{r['max_abs_diff']:.1e} vs {r['reference_path']}" if r.get("max_abs_diff") is not None else "-"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines.append("")
    for path, info in report["paths"].items():
        line = f"* `{path}`: {info['label']}"
        if not info["available"]:
            line += f" — **not available**: {info['reason']}"
        elif info.get("ort_copy_warnings"):
            line += f" — ONNX Runtime logged {info['ort_copy_warnings']} cache-copy warning(s)"
        lines.append(line)
    if report["targets"]:
        lines += ["", "## Targets (defined for DeepSeek-V2-Lite attention shapes, CPU, fp32)", ""]
        for t in report["targets"]:
            lines.append(f"* {'met' if t['met'] else '**missed**'}: {t['target']}: {t['value']:.2f} {t['unit']} "
                         f"(target {t['kind']} {t['threshold']})")
    lines += ["", f"Versions: {', '.join(f'{k} {v}' for k, v in report['versions'].items() if v)}.", ""]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """bench.png: latency (log-log) per batch size, and achieved/bound of each path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in report["rows"]}) or [1]
    fig, axes = plt.subplots(2, len(batches), figsize=(5.5 * len(batches), 8), squeeze=False)
    for col, batch in enumerate(batches):
        for name in report["paths"]:
            rows = sorted((r for r in report["rows"] if r["path"] == name and r["batch"] == batch and r["status"] == "ok"),
                          key=lambda r: r["context"])
            if not rows:
                continue
            x = [r["context"] for r in rows]
            axes[0][col].plot(x, [r["latency_ms"]["median"] for r in rows], marker="o", label=name)
            roof = [(r["context"], r["roofline"]["achieved_over_bound"]) for r in rows if r.get("roofline")]
            if roof:
                axes[1][col].plot(*zip(*roof), marker="o", label=name)
        bound = sorted({(r["context"], r["roofline"]["bound_ms"]) for r in report["rows"]
                        if r["batch"] == batch and r["status"] == "ok" and r.get("roofline")})
        if bound:
            axes[0][col].plot(*zip(*bound), "k--", label="roofline bound")
        axes[0][col].set(xscale="log", yscale="log", xlabel="context T", ylabel="decode step, ms",
                         title=f"batch {batch}")
        if report["targets"]:  # the 1.5x target is defined for DeepSeek-V2-Lite shapes only
            axes[1][col].axhline(1.5, color="grey", linestyle=":", label="1.5x target")
        axes[1][col].set(xscale="log", yscale="log", xlabel="context T", ylabel="achieved / roofline bound")
        for ax in axes[:, col]:
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    fig.suptitle(f"{report['model']['name']}, {report['model']['layers_benched']} attention layer(s), "
                 f"{report['protocol']['threads']} threads", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
