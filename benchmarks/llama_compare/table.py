"""The comparison's one table: per precision, context and engine (llama.cpp, and ik_llama.cpp's variants where
asked for), decode tokens/s of ours and of that engine and their ratio, the bytes per second each streamed, prefill
tokens/s of both, and the machine's bandwidth bound, checked against what every engine achieved
(:func:`mla_deploy.bench.bound.check_bound`). Over several rounds (:func:`combine`): each figure is the median of the
rounds', the ratio the median of the rounds' ratios (each taken within one round), with its lowest and highest."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from mla_deploy.bench.bound import bound_check_line, check_bound

from .settings import PRECISIONS, CompareError

HEAD = ("weights", "context", "engine", "ours tok/s", "its tok/s", "ours / its", "rounds' ratios", "ours GB/s",
        "its GB/s", "ours prefill tok/s", "its prefill tok/s", "prefill ratio")
#: the figures of a row that :func:`combine` takes the median of over the rounds
MEDIAN_KEYS = ("ours_tokens_per_s", "llama_tokens_per_s", "ours_gbps", "llama_gbps", "ours_prefill_tokens_per_s",
               "llama_prefill_tokens_per_s")


def parse_llama_bench(text: str, source: str = "llama-bench") -> list[dict]:
    """llama-bench's ``-o json`` output: one entry per test, ``{"test" ("pp512", "tg128"), "n_prompt", "n_gen",
    "n_depth", "tokens_per_s", "tokens_per_s_std", "samples_ts", "model_type", "model_size", "n_threads",
    "build_commit"}``; :class:`CompareError` when ``text`` is not that. ik_llama.cpp's ``-gp P,N`` test
    (``"test": "tgN@ppP"``: N tokens decoded after a P-token prompt, its tokens/s counting the decode only) is a
    decode at depth P, as mainline's ``-n N -d P``."""
    try:
        entries = json.loads(text)
        tests = []
        for e in entries:
            kind = f"pp{e['n_prompt']}" if e["n_prompt"] and not e["n_gen"] else f"tg{e['n_gen']}"
            after = isinstance(e.get("test"), str) and e["test"] == f"tg{e['n_gen']}@pp{e['n_prompt']}"
            tests.append({"test": kind, "n_prompt": int(e["n_prompt"]), "n_gen": int(e["n_gen"]),
                          "n_depth": int(e["n_prompt"] if after else e.get("n_depth", 0)),
                          "tokens_per_s": float(e["avg_ts"]),
                          "tokens_per_s_std": float(e["stddev_ts"]), "samples_ts": e.get("samples_ts", []),
                          "model_type": e.get("model_type"), "model_size": e.get("model_size"),
                          "n_threads": e.get("n_threads"), "build_commit": e.get("build_commit")})
    except (ValueError, TypeError, KeyError) as exc:
        raise CompareError(f"{source} is not llama-bench's JSON output ({type(exc).__name__}: {exc})") from None
    if not isinstance(entries, list) or not tests:
        raise CompareError(f"{source} holds no llama-bench test")
    return tests


def _llama(tests: list[dict], depth: int, decode: bool) -> dict | None:
    return next((t for t in tests if t["n_depth"] == depth and (t["n_gen"] > 0) == decode), None)


def _ours(report: dict, weights: str, kind: str, context: int | None) -> dict | None:
    return next((r for r in report["rows"] if r["weights"] == weights and r["kind"] == kind and r["batch"] == 1
                 and r["context"] == context and r["status"] == "ok" and r["path"] != "transformers"), None)


def rows(report: dict, llama: dict[str, list[dict]], llama_bytes: dict[str, dict[int, int]],
         engine: str = "llama.cpp") -> list[dict]:
    """One row per precision and context.

    Args:
        report: ``mla-deploy bench model``'s bench.json.
        llama: per llama.cpp type (``F32`` ...), :func:`parse_llama_bench`'s tests.
        llama_bytes: per type and context, the bytes a decode step reads (:func:`.gguf.decode_bytes`).
        engine: whose llama-bench ``llama`` is (the table's engine column).
    """
    out = []
    for weights, kind in PRECISIONS.items():
        if kind not in llama:
            continue
        for context in sorted({t["n_depth"] for t in llama[kind] if t["n_gen"]}):
            ours, theirs = _ours(report, weights, "decode", context), _llama(llama[kind], context, True)
            ours_tps = ours["tokens_per_s_per_sequence"] if ours else None
            theirs_tps = theirs["tokens_per_s"] if theirs else None
            prefill = _ours(report, weights, "prefill", None) if context == 0 else None
            their_prefill = _llama(llama[kind], 0, False) if context == 0 else None
            read = llama_bytes.get(kind, {}).get(context)
            out.append({"weights": weights, "llama_type": kind, "context": context, "engine": engine,
                        "ours_tokens_per_s": ours_tps,
                        "llama_tokens_per_s": theirs_tps,
                        "ratio": ours_tps / theirs_tps if ours_tps and theirs_tps else None,
                        "ours_bytes_per_token": ours["bound"]["bytes"] if ours and ours.get("bound") else None,
                        "llama_bytes_per_token": read,
                        "ours_gbps": ours["bound"]["achieved_gbps"] if ours and ours.get("bound") else None,
                        "llama_gbps": read * theirs_tps / 1e9 if read and theirs_tps else None,
                        "ours_prefill_tokens_per_s": prefill["tokens_per_s"] if prefill else None,
                        "llama_prefill_tokens_per_s": their_prefill["tokens_per_s"] if their_prefill else None})
    return out


def _median(values: list) -> float | None:
    """The median of ``values`` that are not None (None when none is)."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _ratio(ours, theirs) -> float | None:
    return ours / theirs if ours and theirs else None


def combine(rounds: list[list[dict]]) -> list[dict]:
    """One row per precision and context from each round's :func:`rows` (the same rows in the same order): the
    median of each figure over the rounds, ``ratio`` (and ``prefill_ratio``) the median of the rounds' own ratios,
    ``ratios`` (and ``prefill_ratios``) those ratios in round order (None where a round lacks one side)."""
    out = []
    for same in zip(*rounds):
        first = same[0]
        assert all((r["weights"], r["context"], r["engine"]) == (first["weights"], first["context"], first["engine"])
                   for r in same)
        row = dict(first, **{key: _median([r[key] for r in same]) for key in MEDIAN_KEYS})
        row["ratios"] = [r["ratio"] for r in same]
        row["ratio"] = _median(row["ratios"])
        row["prefill_ratios"] = [_ratio(r["ours_prefill_tokens_per_s"], r["llama_prefill_tokens_per_s"]) for r in same]
        row["prefill_ratio"] = _median(row["prefill_ratios"])
        out.append(row)
    return out


def bound(reports: list[dict], probes: list[dict], table: list[dict]) -> dict:
    """The bandwidth bound: the best read bandwidth of the probes in every bench.json of ``reports`` and of
    ``probes`` (taken beside llama-bench), checked against the bytes per second of every row of both engines in
    ``table`` (every round's rows, so no single round beats it unseen)."""
    machines = [r.get("machine") or {} for r in reports]
    best = [p["read_gbps"] for p in probes] + [m["read_gbps"]["max"] for m in machines if m.get("read_gbps")]
    if not best:
        return {"read_gbps": None, "check": None}
    kernel = max(probes, key=lambda p: p["read_gbps"])["read_kernel"] if probes else None
    achieved = {}
    for r in table:
        for engine, key in ((f"ours {r['weights']}", "ours_gbps"), (f"{r['engine']} {r['llama_type']}", "llama_gbps")):
            name = f"{engine} decode @ {r['context']}"
            if r[key] and r[key] > achieved.get(name, (0.0, 0.0))[0]:
                achieved[name] = (r[key], 0.0)
    check = check_bound(achieved, max(best), None)
    ours = sum(m["read_gbps"]["n"] for m in machines if m.get("read_gbps"))
    return {"read_gbps": max(best), "probes_ours": ours, "probes_beside_llama_bench": len(probes),
            "kernel_beside_llama_bench": kernel, "check": check}


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _ratios(values: list | None) -> str:
    """The range of the rounds' ratios; "" for a single round, "-" where a round lacks one."""
    if not values or None in values:
        return "-"
    return f"{min(values):.2f}-{max(values):.2f}x" if len(values) > 1 else ""


def cells(table: list[dict]) -> list[tuple[str, ...]]:
    return [(f"{r['weights']} / {r['llama_type']}", str(r["context"]), r["engine"],
             _cell(r["ours_tokens_per_s"], ".1f"),
             _cell(r["llama_tokens_per_s"], ".1f"), _cell(r["ratio"], ".2f") + ("x" if r["ratio"] else ""),
             _ratios(r.get("ratios")), _cell(r["ours_gbps"], ".1f"), _cell(r["llama_gbps"], ".1f"),
             _cell(r["ours_prefill_tokens_per_s"], ".1f") if r["context"] == 0 else "",
             _cell(r["llama_prefill_tokens_per_s"], ".1f") if r["context"] == 0 else "",
             (_cell(r.get("prefill_ratio"), ".2f") + ("x" if r.get("prefill_ratio") else ""))
             if r["context"] == 0 else "") for r in table]


def bound_lines(b: dict) -> list[str]:
    if b.get("read_gbps") is None:
        return ["bandwidth bound: not measured"]
    return [f"bandwidth bound: {b['read_gbps']:.1f} GB/s, the best of the mla-deploy bench's {b['probes_ours']} "
            f"read probes and {b['probes_beside_llama_bench']} taken before each llama-bench run (several kernels "
            f"each, threads pinned, huge pages advised); a decode step reading B bytes takes at least "
            f"B / {b['read_gbps']:.1f} GB/s",
            bound_check_line(b["check"])]


def section_text(title: str, head: tuple[str, ...], rows: list[tuple[str, ...]], notes: str) -> str:
    """A second table of the report (pairs, interleaved bursts) as plain text: its title, the table, its notes."""
    return "\n".join([title, ""] + aligned(head, rows) + ["", notes])


def section_markdown(title: str, head: tuple[str, ...], rows: list[tuple[str, ...]], notes: str) -> str:
    """The same as a Markdown section of compare.md."""
    lines = [f"## {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines + ["", notes, ""])


def aligned(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    """``head`` and ``rows`` as lines of a plain-text table: the first column left-aligned, the others right-aligned,
    a rule under the head."""
    body = [head] + rows
    widths = [max(len(r[i]) for r in body) for i in range(len(head))]
    lines = []
    for i, r in enumerate(body):
        lines.append("  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths)))
                     .rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def text(table: list[dict], b: dict, title: str) -> str:
    """The printed table."""
    return "\n".join([title, ""] + aligned(HEAD, cells(table)) + [""] + bound_lines(b))


def markdown(table: list[dict], b: dict, title: str, commands: list[str]) -> str:
    lines = [f"# {title}", "", "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    lines += ["| " + " | ".join(c or " " for c in r) + " |" for r in cells(table)]
    lines += [""] + [f"* {line}" for line in bound_lines(b)]
    lines += ["", "Each row sets ours beside one engine (its: that engine's figures). Each figure is the median over "
              "the rounds; a ratio is taken within each round (both engines "
              "measured minutes apart), the table's the median of those, the range their lowest and highest.",
              "", "GB/s: the bytes a decode step reads (ours: bench.json's bound bytes; llama.cpp and ik_llama.cpp: "
              "the GGUF file's tensors, k of E routed experts and one embedding row, plus the F16 latent cache, "
              "-rtr's repacked copy counted as the file's) x tokens/s.",
              "", "Commands:", ""] + [f"    {c}" for c in commands] + [""]
    return "\n".join(lines)


def write(out: Path, data: dict, md: str) -> None:
    """compare.json and compare.md into ``out`` (each to a temporary name, then renamed)."""
    for name, content in (("compare.json", json.dumps(data, indent=2) + "\n"), ("compare.md", md)):
        tmp = out / f".{name}.tmp"
        tmp.write_text(content)
        tmp.replace(out / name)
