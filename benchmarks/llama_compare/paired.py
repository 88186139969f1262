"""Paired decode (``--pairs N``): after the rounds, our decode and llama.cpp's measured back to back, ``N`` times per
precision and context, with a read-bandwidth probe before, between and after each pair.

Why: this machine's read bandwidth moves between states (about 36 and 64 GB/s with 2 threads on the development
machine) that last seconds to minutes (``benchmarks/bandwidth_states.py``), and a round runs each engine's whole bench
minutes apart, so a round's ratio can set one engine's fast state against the other's slow one. A pair takes under
a minute, most of it untimed loading and prompts. A pair whose three probes agree within :data:`STEADY` ran both engines at one bandwidth: the median ratio
of those pairs compares the engines at equal bandwidth, and each engine's bytes per second in them, against the
bandwidth probed beside it, says how near that state's limit each one ran.

Ours: the rounds' export of the precision (``mla-deploy bench model``'s, :meth:`.Settings.ours_artifact`), opened in
a worker process of its own per pair (:mod:`.paired_worker`, with the huge-page setting of mla-deploy's command
line; it faults the weights in and warms the engine untimed), a prompt of ``context`` random tokens (1 at context 0),
then ``generate`` decode steps of random tokens, timed. llama.cpp: ``llama-bench -r 1 -p 0 -n generate -d context
-lm none`` in a fresh process per pair (its ``tg`` test: random tokens after an untimed prompt of ``context`` tokens;
it reads the weights into memory and warms the model first, untimed). Each engine starts afresh in each pair because
one held open beside the other does not fit: on 4 layers of V2-Lite in float, our engine's 8.6 GB mapped and
llama-bench's 8.5 GB read into memory (with the page cache of its file) passed this machine's 24 GiB, and a worker
held open across pairs had its weights evicted between windows (7-13 tokens/s where the round's bench gave 15). The
order alternates: ours first in even pairs, llama.cpp first in odd ones.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from . import paired_worker
from .settings import PRECISIONS, CompareError, Settings
from .table import parse_llama_bench, section_markdown, section_text

#: a pair is steady when its three probes' highest is at most this much above their lowest (the development
#: machine's two states are 1.8x apart; one state's probes spread about 10%)
STEADY = 0.15


def llama_argv(s: Settings, gguf: Path, context: int) -> tuple[str, ...]:
    """One pair's llama-bench: ``generate`` tokens after ``context``, one repetition, JSON on standard output."""
    return (str(s.tool("llama-bench")), "-m", str(gguf), "-t", str(s.threads), "-r", "1", "-p", "0", "-n",
            str(s.generate), "-d", str(context), "-lm", "none", "-o", "json")


def llama_window(s: Settings, gguf: Path, context: int) -> float:
    """llama.cpp's decode tokens/s in one pair (:func:`llama_argv`); :class:`CompareError` when it fails."""
    argv = llama_argv(s, gguf, context)
    try:
        proc = subprocess.run(argv, capture_output=True, text=True)
    except OSError as exc:
        raise CompareError(f"paired llama-bench: cannot run {argv[0]}: {exc.strerror}") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise CompareError(f"paired llama-bench failed (exit {proc.returncode}): {last}")
    tests = [t for t in parse_llama_bench(proc.stdout, "paired llama-bench") if t["n_gen"]]
    if not tests:
        raise CompareError("paired llama-bench reported no generation test")
    return tests[0]["tokens_per_s"]


def worker_environment() -> dict:
    """The environment of our worker processes: mla-deploy's huge-page setting (as its command line sets it) and
    this package on the import path."""
    from mla_deploy.ort.huge_pages import environment_with_huge_pages

    environ = environment_with_huge_pages(os.environ) or dict(os.environ)
    here = str(Path(__file__).resolve().parent.parent)
    environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, environ.get("PYTHONPATH")) if p)
    return environ


def ours_window(artifact: Path, threads: int, capacity: int, context: int, steps: int, seed: int) -> float:
    """Our decode tokens/s in one pair: a :mod:`.paired_worker` process of its own (mla-deploy's huge-page setting)
    opens ``artifact`` with a cache of ``capacity`` rows, warms it, and times ``steps`` steps after ``context``
    tokens; :class:`CompareError` in one line when it cannot."""
    argv = [sys.executable, "-m", "llama_compare.paired_worker", *map(str, (artifact, threads, capacity, context,
                                                                            steps, seed))]
    proc = subprocess.run(argv, capture_output=True, text=True, env=worker_environment())
    lines = proc.stdout.strip().splitlines()
    reply = json.loads(lines[-1]) if lines else {}
    if "tokens_per_s" not in reply:
        why = reply.get("error") or (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise CompareError(f"the paired worker on {artifact} (exit {proc.returncode}): {why}")
    return float(reply["tokens_per_s"])


def steady(probes: list[float], tolerance: float = STEADY) -> bool:
    """Whether a pair's probes (GB/s) agree: the highest at most ``tolerance`` above the lowest."""
    return max(probes) <= (1 + tolerance) * min(probes)


def summarize(pairs: list[dict], tolerance: float = STEADY) -> dict:
    """The steady pairs (:func:`steady`) of one precision and context.

    Args:
        pairs: ``{"probes" [3 GB/s], "ours_tokens_per_s", "llama_tokens_per_s", "ours_bytes", "llama_bytes"}``
            each (bytes: what a decode step reads, None where unknown).
    Returns: ``{"pairs", "steady", "ratio" (median of the steady pairs' ratios), "ratios" (theirs, in order),
        "ours_tokens_per_s", "llama_tokens_per_s" (medians over them), "probe_gbps" ([lowest, highest] of their
        probes' means), "ours_of_probe", "llama_of_probe" (medians of the probes' mean over the engine's bytes per
        second, in each steady pair: 1.0 at the probed bandwidth)}``; the medians None where no pair was steady."""
    kept = [p for p in pairs if steady(p["probes"], tolerance)]
    out = {"pairs": len(pairs), "steady": len(kept), "ratios": [p["ours_tokens_per_s"] / p["llama_tokens_per_s"]
                                                               for p in kept]}
    out["ratio"] = statistics.median(out["ratios"]) if kept else None
    for side in ("ours", "llama"):
        out[f"{side}_tokens_per_s"] = statistics.median(p[f"{side}_tokens_per_s"] for p in kept) if kept else None
        of_probe = [statistics.fmean(p["probes"]) * 1e9 / (p[f"{side}_bytes"] * p[f"{side}_tokens_per_s"])
                    for p in kept if p.get(f"{side}_bytes")]
        out[f"{side}_of_probe"] = statistics.median(of_probe) if of_probe else None
    means = [statistics.fmean(p["probes"]) for p in kept]
    out["probe_gbps"] = [min(means), max(means)] if kept else None
    return out


def run(s: Settings, key: str, rows: list[dict], probe, echo) -> list[dict]:
    """``s.pairs`` pairs per precision and context (the table's ``rows`` give each side's bytes per decode step);
    ``probe()``: one read-bandwidth probe (``{"read_gbps", ...}``). Returns one entry per precision and context:
    ``{"weights", "llama_type", "context", "pairs": [...], **summarize(...)}``."""
    # a cache for the longest window: at context 0 the prompt is still one token (a run of --context 0 alone had
    # asked for -n rows and failed on its first pair)
    out, capacity = [], max(paired_worker.rows_for(c, s.generate) for c in s.contexts)

    for weights in s.precisions:
        kind = PRECISIONS[weights]
        gguf = s.gguf(key, kind)
        for context in s.contexts:
            row = next((r for r in rows if r["weights"] == weights and r["context"] == context), {})
            pairs = []
            for i in range(s.pairs):
                sides = [("ours", lambda: ours_window(s.ours_artifact(weights), s.threads, capacity, context,
                                                      s.generate, i)),
                         ("llama", lambda: llama_window(s, gguf, context))]
                if i % 2:
                    sides.reverse()
                probes, speed = [probe()["read_gbps"]], {}
                for side, measure in sides:
                    speed[side] = measure()
                    probes.append(probe()["read_gbps"])
                pair = {"order": [side for side, _ in sides], "probes": probes,
                        "ours_tokens_per_s": speed["ours"], "llama_tokens_per_s": speed["llama"],
                        "ours_bytes": row.get("ours_bytes_per_token"), "llama_bytes": row.get("llama_bytes_per_token")}
                pair["steady"] = steady(probes)
                pairs.append(pair)
                echo(f"[compare] pair {i + 1}/{s.pairs} {weights} @ {context}: ours {speed['ours']:.1f}, llama.cpp "
                     f"{speed['llama']:.1f} tok/s ({speed['ours'] / speed['llama']:.2f}x), probes "
                     f"{'/'.join(f'{p:.1f}' for p in probes)} GB/s{'' if pair['steady'] else ' (moved)'}")
            out.append({"weights": weights, "llama_type": kind, "context": context, "pairs": pairs,
                        **summarize(pairs)})
    return out


HEAD = ("weights", "context", "steady pairs", "ours tok/s", "llama.cpp tok/s", "ours / llama.cpp", "pairs' ratios",
        "probed GB/s", "ours x probe", "llama.cpp x probe")


def _cell(value, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, fmt) + suffix


def _span(values, fmt: str, suffix: str = "") -> str:
    """``low-high`` (one value where they are equal), "-" for none."""
    if not values:
        return "-"
    low, high = format(min(values), fmt), format(max(values), fmt)
    return (low if low == high else f"{low}-{high}") + suffix


def cells(paired: list[dict]) -> list[tuple[str, ...]]:
    return [(f"{p['weights']} / {p['llama_type']}", str(p["context"]), f"{p['steady']} of {p['pairs']}",
             _cell(p["ours_tokens_per_s"], ".1f"), _cell(p["llama_tokens_per_s"], ".1f"), _cell(p["ratio"], ".2f", "x"),
             _span(p["ratios"], ".2f", "x"), _span(p["probe_gbps"], ".1f"),
             _cell(p["ours_of_probe"], ".2f", "x"), _cell(p["llama_of_probe"], ".2f", "x")) for p in paired]


TITLE = (f"Paired decode: both engines back to back, a read probe before, between and after; a pair is steady when "
         f"its probes agree within {STEADY:.0%}")
NOTES = ("Figures are medians over the steady pairs; a ratio is taken within each pair. `x probe`: the probed "
         "bandwidth (the mean of the pair's probes) over the bytes per second the engine streamed: 1.00x is the "
         "bandwidth measured beside it.")


def text(paired: list[dict]) -> str:
    return section_text(TITLE, HEAD, cells(paired), NOTES)


def markdown(paired: list[dict]) -> str:
    return section_markdown(TITLE, HEAD, cells(paired), NOTES)
