"""Merge the workers' records into rows and derive the roofline, the ratios and the targets (bench.json's content)."""

from __future__ import annotations

import datetime
import statistics
import time
from pathlib import Path

import numpy as np

from ..bound import roofline
from ...host import describe
from ..reporting import bound_rates, machine_summary, versions
from .roofline import cache_bytes_per_token, implemented_flops, step_cost
from .spec import NAIVE_PATHS, PATH_LABELS, BenchSpec, fixed_capacity

FORMAT = "mla-deploy-bench"
UNIT = ("decode step (one new token per sequence) of {layers} MLA attention sub-layer(s) chained with residuals "
        "(x <- x + attn_i(x); no norms, MLP/MoE, embedding or lm_head): DeepSeek attention shapes of {name}")
REFERENCE_ORDER = ("torch-cd", "torch-absorbed", "ort-concat", "ort-static", "hf-eager", "hf-sdpa", "trt")
TARGETS = {"naive_b1": 60.0, "naive_b8": 100.0, "static_16k": 1.2, "static_1k": 1.0, "roofline": 1.5}
#: the model and points the targets are defined on (DeepSeek-V2-Lite attention shapes, CPU, fp32)
TARGET_MODEL = "deepseek-v2-lite"
TARGET_CONTEXTS, TARGET_BATCHES = (1024, 4096, 16384), (1, 8)
#: the packages whose versions the report records
VERSIONS = ("torch", "onnxruntime", "transformers", "onnx", "numpy", "tensorrt")


def _pct(values, q):
    return float(np.percentile(np.asarray(values), q))


def _machine(spec: BenchSpec, runs: list[dict], described: dict | None) -> dict:
    probes = [p for run in runs for p in run["probes"]]
    return machine_summary(described or describe(), spec.threads, probes,
                           "at the start and the end of every worker process")


def _row(spec: BenchSpec, path: str, context: int, batch: int, records: list[dict], machine: dict) -> dict:
    per_token = cache_bytes_per_token(spec.config, path) * spec.layers
    held = context + spec.static_margin if fixed_capacity(path) else context
    row = {"path": path, "context": context, "batch": batch, "label": PATH_LABELS[path],
           "cache_bytes_per_token": per_token, "cache_bytes_total": per_token * batch * held,
           "cache_rows_held": held}
    ok = [r for r in records if r.get("status") == "ok"]
    if not ok:
        first = records[0] if records else {"status": "error", "detail": "no record"}
        row.update(status=first["status"], detail=first.get("detail"),
                   memory_estimate_bytes=first.get("memory_estimate_bytes"))
        return row
    failed = [f"{r.get('status')}: {r.get('detail')}" for r in records if r.get("status") != "ok"]
    if failed:
        row["failed_passes"] = failed
    times = [t for r in ok for t in r["times_s"]]
    pass_medians = [statistics.median(r["times_s"]) for r in ok]
    median = statistics.median(times)
    row.update(status="ok", detail=None, calls=len(times), passes=len(ok),
               latency_ms={"median": median * 1e3, "p10": _pct(times, 10) * 1e3, "p90": _pct(times, 90) * 1e3,
                           "min": min(times) * 1e3, "pass_medians": [m * 1e3 for m in pass_medians],
                           "pass_spread": (max(pass_medians) - min(pass_medians)) / median},
               tokens_per_s=batch / median,
               peak_memory_bytes=max(r.get("peak_memory_bytes") or 0 for r in ok),
               peak_memory_is_per_point=all(r.get("peak_is_per_point") for r in ok),
               memory_estimate_bytes=ok[0].get("memory_estimate_bytes"),
               checks={k: v for r in ok for k, v in (r.get("checks") or {}).items()})
    row["roofline"] = _roofline(spec, path, context, batch, median, machine)
    return row


def _roofline(spec: BenchSpec, path: str, context: int, batch: int, median: float, machine: dict) -> dict | None:
    """The bound of the point at the run's measured rates, and where the median step time (s) stands against it
    (None for TensorRT, whose step runs on another device, or when no probe ran)."""
    rates = bound_rates(machine)
    if rates is None or path == "trt":
        return None
    c, layers = spec.config, spec.layers
    cost = step_cost(c, layers, context, batch)
    bound = roofline(cost["bytes"], cost["flops"], *rates)
    achieved = median * 1e3 / bound["bound_ms"]
    return {**cost, **bound, "bound_over_achieved": 1 / achieved, "achieved_over_bound": achieved,
            "implemented_flops": implemented_flops(c, path, layers, context, batch, context + spec.static_margin)}


def _compare_outputs(rows: list[dict], outputs: Path) -> None:
    by_point: dict[tuple, dict] = {}
    for row in rows:
        f = outputs / f"{row['path']}_T{row['context']}_B{row['batch']}.npy"
        if row["status"] == "ok" and f.is_file():
            by_point.setdefault((row["context"], row["batch"]), {})[row["path"]] = np.load(f)
    for row in rows:
        found = by_point.get((row["context"], row["batch"]), {})
        ref = next((p for p in REFERENCE_ORDER if p in found), None)
        if row["status"] != "ok" or row["path"] not in found or ref is None:
            row["max_abs_diff"], row["reference_path"] = None, None
            continue
        row["reference_path"] = ref
        row["max_abs_diff"] = float(np.abs(found[row["path"]].astype(np.float64) - found[ref]).max())
        row["output_max_abs"] = float(np.abs(found[ref]).max())


def _ratios(rows: list[dict]) -> None:
    index = {(r["path"], r["context"], r["batch"]): r for r in rows}
    for row in rows:
        key = (row["context"], row["batch"])
        naive = [index.get((p, *key)) for p in NAIVE_PATHS]
        naive = [n for n in naive if n and n["status"] == "ok"]
        row["naive_path"] = row["speedup_vs_naive"] = None
        if naive and row["status"] == "ok":
            best = min(naive, key=lambda n: n["latency_ms"]["median"])
            row["naive_path"] = best["path"]
            row["speedup_vs_naive"] = best["latency_ms"]["median"] / row["latency_ms"]["median"]
        row["static_speedup_over_concat"] = None
        concat = index.get(("ort-concat", *key))
        if row["path"] == "ort-static" and row["status"] == "ok" and concat and concat["status"] == "ok":
            row["static_speedup_over_concat"] = concat["latency_ms"]["median"] / row["latency_ms"]["median"]


def _targets(rows: list[dict]) -> list[dict]:
    """The project's decode targets for DeepSeek-V2-Lite, evaluated on the points this run has (CPU, this run's
    thread count, fp32); other models have none."""
    index = {(r["path"], r["context"], r["batch"]): r for r in rows if r["status"] == "ok"}
    out = []
    for batch, key in ((1, "naive_b1"), (8, "naive_b8")):
        for path in ("ort-static", "ort-concat"):
            row = index.get((path, 4096, batch))
            if row and row.get("speedup_vs_naive"):
                out.append({"target": f"{path} vs the faster transformers path at T=4096, B={batch}",
                            "value": row["speedup_vs_naive"], "threshold": TARGETS[key], "kind": ">=",
                            "met": row["speedup_vs_naive"] >= TARGETS[key], "unit": "x faster"})
    for context, key in ((16384, "static_16k"), (1024, "static_1k")):
        for batch in TARGET_BATCHES:
            row = index.get(("ort-static", context, batch))
            if row and row.get("static_speedup_over_concat"):
                v = row["static_speedup_over_concat"]
                out.append({"target": f"ort-static vs ort-concat at T={context}, B={batch}", "value": v,
                            "threshold": TARGETS[key], "kind": ">=", "met": v >= TARGETS[key],
                            "unit": "x faster (concat time / static time)"})
    for row in rows:
        if row["context"] not in TARGET_CONTEXTS or row["batch"] not in TARGET_BATCHES:
            continue
        if row["path"].startswith("ort-") and row["status"] == "ok" and row.get("roofline"):
            v = row["roofline"]["achieved_over_bound"]
            out.append({"target": f"{row['path']} at T={row['context']}, B={row['batch']} within 1.5x of the roofline bound",
                        "value": v, "threshold": TARGETS["roofline"], "kind": "<=", "met": v <= TARGETS["roofline"],
                        "unit": "achieved time / bound time"})
    return out


#: how the bench measures, for the report (``{...}``: the spec's values)
PROTOCOL = {
    "order": "one process per variant and pass; odd passes reverse the variants and the points",
    "latency": "median of all timed calls of all passes; pass_spread = (max - min pass median) / median",
    "inputs": "hidden ~ N(0,1) [B,1,D], latent rows ~ N(0,1) [B,T,C] per layer, position T; identical in every "
              "process (seeded by the point)",
    "ort": "intra_op_num_threads = threads, sequential, ORT_ENABLE_ALL, session.intra_op.allow_spinning = 0, "
           "IO binding",
    "ratios": "speedup_vs_naive = faster of hf-eager/hf-sdpa (same point, same run) / this row; "
              "static_speedup_over_concat = ort-concat / ort-static",
    "roofline": "bound = max(bytes / read bandwidth, FLOPs / GEMM rate), both the best probe of this run; bytes = weights "
                "+ latent cache, FLOPs = projections + scores (C wide) + weighted sum (r wide) over T+1 rows; "
                "bound_over_achieved = fraction of the roofline reached, achieved_over_bound = how many times "
                "slower than the bound",
}


def _rows(spec: BenchSpec, status: dict, runs: list[dict], machine: dict) -> list[dict]:
    """One row per available path and point, from every pass's records of it."""
    grouped: dict[tuple, list] = {}
    for run in runs:
        for rec in run["records"]:
            grouped.setdefault((run["path"], rec["context"], rec["batch"]), []).append(rec)
    return [_row(spec, path, context, batch, grouped.get((path, context, batch), []), machine)
            for path in spec.paths if status[path]["available"] for context, batch in sorted(spec.points)]


def _paths(spec: BenchSpec, status: dict, runs: list[dict]) -> dict:
    paths = {}
    for path in spec.paths:
        info = [r["info"] for r in runs if r["path"] == path]
        paths[path] = {"label": PATH_LABELS[path], **status[path],
                       "provider": next((i["provider"] for i in info if i.get("provider")), None),
                       "worker_restarts": sum(i["restarts"] for i in info),
                       "ort_copy_warnings": sum(i["stderr_copy_warnings"] for i in info)}
    return paths


def _model(spec: BenchSpec) -> dict:
    c = spec.config
    return {"name": c.name, "source": spec.source, "hidden_size": c.hidden_size,
            "num_attention_heads": c.num_attention_heads, "kv_lora_rank": c.kv_lora_rank,
            "qk_rope_head_dim": c.qk_rope_head_dim, "latent_dim": c.latent_dim, "layers_benched": spec.layers}


def build_report(spec: BenchSpec, status: dict, runs: list[dict], outputs: Path, started: float,
                 command: str | None, described: dict | None = None) -> dict:
    """The report dict (what bench.json holds); ``described``: :func:`mla_deploy.host.describe` taken at the start."""
    machine = _machine(spec, runs, described)
    rows = _rows(spec, status, runs, machine)
    _compare_outputs(rows, outputs)
    _ratios(rows)
    protocol = {"threads": spec.threads, "warmup": spec.warmup, "repeat": spec.repeat, "passes": spec.passes,
                "max_seconds_per_point": spec.max_seconds, "dtype": "float32",
                "static_capacity": f"T + {spec.static_margin}", **PROTOCOL}
    return {
        "format": FORMAT, "format_version": 1, "command": command,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "wall_seconds": round(time.time() - started, 1),
        "unit": UNIT.format(layers=spec.layers, name=spec.config.name), "model": _model(spec),
        "protocol": protocol, "spec": spec.to_dict(), "machine": machine, "paths": _paths(spec, status, runs),
        "rows": rows, "targets": _targets(rows) if spec.config.name == TARGET_MODEL else [],
        "versions": versions(VERSIONS),
    }
