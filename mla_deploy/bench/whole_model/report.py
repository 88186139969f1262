"""The whole-model bench's report: rows per path and point with their bound (bench.json), bench.md and the
printed table.

Decode rows give ms per token (one decode step: one new token for every sequence), tokens/s per sequence
(1000 / ms) and for the batch (B * 1000 / ms); prefill rows the prompt's time and tokens/s (B * L * 1000 / ms).
Each artifact ``ours`` ran (``ours``: fp32 weights; ``ours-int8``, ``ours-int4``: quantized) has its rows, with
its speed-up over transformers and over the float artifact's row. The bound of a step (:mod:`.cost`)
counts the bytes the artifact stores (quantized integers and scales for the quantized tensors), the experts the
step really routes to (the reference's router hooks; or the uniform-routing expectation, said so) and the rows
it really attends to. The batch-1 rows are also given as llama.cpp's ``llama-bench`` reports them: ``pp{L}``
(prompt tokens/s) and ``tg{n} @ d{T}`` (generated tokens/s after a context of T), mean +- standard deviation of
the per-call rates.
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Mapping

import numpy as np

from ...quant import plan
from ...weight_bytes import manifest_weight_groups, weight_groups
from ..bound import bound_check_line, check_bound, roofline
from ..reporting import GEMM_PROBES, bound_rates, format_bytes, format_ms, machine_line, machine_summary, versions
from .cost import CHUNK_BYTES, expected_distinct_experts, step_cost
from .spec import PREFILL, TRANSFORMERS, WholeModelSpec, parse_point, path_label, points, prompt_ids

FORMAT = "mla-deploy-bench-whole-model"
#: the packages whose versions the report records
VERSIONS = ("torch", "onnxruntime", "transformers", "numpy")


def _latency(times: list[float]) -> dict:
    ms = np.asarray(times) * 1e3
    return {"median": float(np.median(ms)), "p10": float(np.percentile(ms, 10)), "p90": float(np.percentile(ms, 90)),
            "min": float(ms.min()), "n": len(times)}


def _machine(spec: WholeModelSpec, probes: list[dict], described: dict) -> dict:
    return machine_summary(described, spec.threads, probes,
                           "in a process of its own before each timed path and at the end")


class _Bounds:
    """The bound of each point's steps, from the routing records (or the uniform expectation)."""

    def __init__(self, spec: WholeModelSpec, config, groups, routing: dict, routing_records: dict, machine: dict,
                 arithmetic: str = "fp32"):
        self.spec, self.config, self.groups = spec, config, groups
        self.method, self.records = routing["method"], routing_records
        self.rates = bound_rates(machine, arithmetic)  # a quantized artifact's products run on int8 activations

    def _experts(self, key: str, step: int | None, tokens: int) -> tuple[list[float], str]:
        n = len(self.groups.moe_layers)
        if not n:
            return [], "none"
        record = self.records.get(key)
        if self.method == "measured" and record and record.get("status") == "ok":
            return list(record["distinct_experts"][0 if step is None else step]), "measured"
        return [expected_distinct_experts(self.groups.n_experts, self.groups.top_k, tokens)] * n, "uniform"

    def decode(self, key: str, batch: int, record: dict) -> dict | None:
        """The bound of every timed step of ``record`` (rows held from the record, ids from its fed tokens)."""
        if self.rates is None:
            return None
        tokens = np.asarray(record["tokens"])[:, self.spec.warmup:]
        costs, methods = [], set()
        for i, held in enumerate(record["cache_rows"]):
            experts, method = self._experts(key, i, batch)
            methods.add(method)
            costs.append(step_cost(self.config, self.groups, batch, 1, held, experts, len(np.unique(tokens[:, i]))))
        return self._summary(costs, methods, record["times_s"])

    def prefill(self, key: str, batch: int, record: dict) -> dict | None:
        if self.rates is None:
            return None
        ids = prompt_ids(self.config.vocab_size, batch, self.spec.prompt_length, self.spec.seed, PREFILL)
        experts, method = self._experts(key, None, ids.size)
        cost = step_cost(self.config, self.groups, batch, self.spec.prompt_length, 0, experts, len(np.unique(ids)))
        return self._summary([cost], {method}, record["times_s"])

    def _summary(self, costs: list[dict], methods: set, times: list[float]) -> dict:
        seconds = statistics.median(times)
        experts = [c["expert_bytes"] / self.groups.expert_bytes if self.groups.expert_bytes else 0 for c in costs]
        out = {key: statistics.median(c[key] for c in costs) for key in ("bytes", "weight_bytes", "expert_bytes",
                                                                           "cache_bytes", "flops")}
        # the bound of the median step (its bytes and FLOPs), so that bound_ms is max(t_mem_ms, t_flop_ms) exactly:
        # a median of per-step maxima differs from the max of the medians when the rates sit near the crossover
        bound = roofline(out["bytes"], out["flops"], *self.rates)
        out.update({"t_mem_ms": bound["t_mem_ms"], "t_flop_ms": bound["t_flop_ms"], "bound_ms": bound["bound_ms"],
                    "bound": bound["bound"],
                    "achieved_over_bound": seconds * 1e3 / bound["bound_ms"],
                    "routed_experts": " + ".join(sorted(methods)),
                    "distinct_experts_per_step": statistics.mean(experts),
                    "distinct_experts_per_moe_layer": (statistics.mean(experts) / len(self.groups.moe_layers)
                                                       if self.groups.moe_layers else 0.0),
                    "steps": len(costs)})
        out.update(achieved_gbps=out["bytes"] / seconds / 1e9, achieved_gflops=out["flops"] / seconds / 1e9)
        return out


def _llama_bench(spec: WholeModelSpec, kind: str, context: int | None, times: list[float]) -> dict:
    """A batch-1 point as llama-bench names and rates it: ``pp{L}`` or ``tg{n} @ d{T}``, tokens/s mean and
    standard deviation over the timed calls (llama-bench: over its repetitions)."""
    tokens = spec.prompt_length if kind == "prefill" else 1
    rates = tokens / np.asarray(times)
    test = f"pp{spec.prompt_length}" if kind == "prefill" else f"tg{spec.repeat} @ d{context}"
    return {"test": test, "tokens_per_s_mean": float(rates.mean()), "tokens_per_s_std": float(rates.std(ddof=1))
            if len(rates) > 1 else 0.0}


def _row(spec: WholeModelSpec, path: str, key: str, record: dict | None, bounds: _Bounds) -> dict:
    kind, batch, context = parse_point(key)
    row = {"path": path, "weights": bounds.groups.weights, "point": key, "kind": kind, "batch": batch,
           "context": context, "prompt_length": spec.prompt_length if kind == "prefill" else None}
    if record is None or record.get("status") != "ok":
        record = record or {"status": "error", "detail": "no record (the process stopped before this point)"}
        row.update(status=record["status"], detail=record.get("detail"))
        return row
    latency = _latency(record["times_s"])
    ms = latency["median"]
    row.update(status="ok", detail=None, latency_ms=latency, peak_rss_bytes=record.get("peak_rss_bytes"),
               peak_is_per_point=record.get("peak_is_per_point"), point_seconds=record.get("seconds"))
    if kind == "decode":
        row.update(ms_per_token=ms, tokens_per_s_per_sequence=1e3 / ms, tokens_per_s_batch=batch * 1e3 / ms,
                   fill_seconds=record.get("fill_seconds"),
                   cache_rows_timed=[min(record["cache_rows"]), max(record["cache_rows"])],
                   bound=bounds.decode(key, batch, record))
    else:
        row.update(tokens_per_s=batch * spec.prompt_length * 1e3 / ms, bound=bounds.prefill(key, batch, record))
    if batch == 1:
        row["llama_bench"] = _llama_bench(spec, kind, context, record["times_s"])
    return row


def _compare(rows: list[dict], records: dict, routed: dict, primary: str) -> None:
    """Speed-ups of each ``ours`` artifact over transformers and over the float artifact (``ours``), and whether
    the paths fed the same greedy tokens (each artifact against its reference; transformers against ``primary``)."""
    index = {(r["path"], r["point"]): r for r in rows}
    for row in rows:
        if row["path"] == TRANSFORMERS or row["status"] != "ok":
            continue
        key = row["point"]
        for other, field in ((TRANSFORMERS, "speedup_vs_transformers"), ("ours", "speedup_vs_float")):
            theirs = index.get((other, key))
            if theirs and theirs["status"] == "ok" and other != row["path"]:
                row[field] = theirs["latency_ms"]["median"] / row["latency_ms"]["median"]
        if row["kind"] != "decode":
            continue
        check = routed.get(row["path"], {}).get(key)
        if check and check.get("status") == "ok" and check.get("replayed"):
            row["tokens_agree_with_reference"] = check["tokens_agreeing"] / check["tokens_compared"]
        theirs = index.get((TRANSFORMERS, key))
        if row["path"] == primary and theirs and theirs["status"] == "ok":
            ours, other = records[primary][key]["tokens"], records[TRANSFORMERS][key]["tokens"]
            theirs["tokens_agree_with_ours"] = float((np.asarray(other) == np.asarray(ours)).mean())
            theirs["tokens_compared_with"] = primary


def _arithmetic(prepared) -> dict[str, str]:
    """``{path: the arithmetic of its artifact's products}`` (:attr:`mla_deploy.quant.Quantization.arithmetic`);
    a path without an artifact (transformers) computes in fp32."""
    return {v.path: v.manifest.quantization.arithmetic for v in prepared.variants}


def bound_check(machine: dict, rows: list[dict], arithmetic: Mapping[str, str] | None = None) -> dict | None:
    """:func:`~..bound.check_bound` over the rows with a bound: did any measured step stream more bytes (or
    compute more FLOPs) per second than the machine's best probe? Each path's rows are checked against the GEMM
    rate of its products' ``arithmetic`` (``{path: "fp32" | "int8"}``, :func:`~..reporting.bound_rates`; fp32 where
    a path is not named), in one check per arithmetic; the first that fails is the answer (``int8_gemm_gops``: the
    int8 rate, where int8 steps were checked). None when no probe ran."""
    if bound_rates(machine) is None:
        return None
    kind = {r["path"]: (arithmetic or {}).get(r["path"], "fp32") for r in rows}
    checks = {}
    for each in sorted(set(kind.values()) | {"fp32"}):
        achieved = {f"{r['path']} {r['point']}": (r["bound"]["achieved_gbps"], r["bound"]["achieved_gflops"])
                    for r in rows if r["status"] == "ok" and r.get("bound") and kind[r["path"]] == each}
        checks[each] = check_bound(achieved, *bound_rates(machine, each))
    rates = {"read_gbps": checks["fp32"]["read_gbps"],
             **{GEMM_PROBES[each]: check["gemm_gflops"] for each, check in checks.items()}}
    failed = [c for c in checks.values() if not c["holds"]]
    if failed:
        return {**failed[0], **rates}
    return {**max(checks.values(), key=lambda c: c["fastest_gbps"] or 0.0), **rates}


def _weights_protocol(variants) -> str:
    """The protocol's weights: fp32, or what the quantized artifacts hold and how they run."""
    quantized = [v.manifest.quantization for v in variants if v.manifest.quantization.quantized]
    if not quantized:
        return "fp32"
    return (f"ours: fp32 weights; ours-int8, ours-int4: symmetric int8/int4 MatMul weights in blocks of "
            f"{quantized[0].block_size} input features, one scale each (a float16 value, stored as fp32 in the artifact "
            f"and as float16 by a CPU engine, whose bytes the bound then counts; export --weights/--block-size; "
            f"{quantized[0].kept_float()} stay fp32), run with int8 activations (OrtEngine's default: "
            f"ONNX Runtime's MatMulNBits, or the CPU engine's operators); x float = the ours row's median time / "
            f"this row's")


def _path_info(path: str, status: dict, result: dict | None, groups, artifact: str | None) -> dict:
    info = {"label": path_label(path), **status, "artifact": artifact, "weights": groups.to_dict()}
    if result is None:
        return info
    peaks = [r.get("peak_rss_bytes") for r in result["records"].values()] + [result.get("peak_rss_after_load_bytes")]
    peaks = [p for p in peaks if p]
    info.update(load_seconds=result.get("load_seconds"), peak_rss_bytes=max(peaks) if peaks else None,
                peak_rss_after_load_bytes=result.get("peak_rss_after_load_bytes"), runtime=result.get("info"),
                restarts=result.get("restarts", 0), failure=result.get("failure"))
    if result.get("failure"):
        info.update(available=False, reason=result["failure"])
    return info


#: how the bench measures, for the report (the parts that do not depend on the run's options)
PROTOCOL = {
    "llama_bench": ("batch-1 points as llama.cpp's llama-bench reports them (-p L -n n -d T -b 1 -t threads): "
                    "pp{L} = prompt tokens/s, tg{n} @ d{T} = generated tokens/s after a context of T; mean "
                    "+- standard deviation of the per-call rates (llama-bench: of its repetitions)"),
    "processes": "machine probes, ours, the routing reference and transformers each in a process of its own, "
                 "one after the other",
    "transformers_bound": ("a transformers row's bound takes its own cache rows and token ids and the "
                           "routed-expert counts of ours' tokens at the same point (tokens_agree_with_ours: "
                           "how often its greedy tokens were ours')"),
    "ours_cache": ("a fixed-capacity (static) cache is made exactly as large as the point needs (its "
                   "steps attend to every slot); the context is filled with prefill steps in chunks whose "
                   f"logits and scores stay under {CHUNK_BYTES >> 20} MiB (fill_seconds)"),
    "ort": "OrtEngine(threads=threads): intra_op_num_threads = threads, spinning on",
    "torch": "torch.set_num_threads(threads), one interop thread, OMP/MKL threads = threads",
    "memory": "peak RSS (VmHWM) of the path's process; per point: reset before the point, so it counts the "
              "resident weights and whatever earlier points left resident (allocator arenas); the decode "
              "points run first, smallest first, the prefills last",
    "bound": ("bound = max(bytes / read bandwidth, FLOPs / GEMM rate), both the best probe of this run; bytes = "
              "attention, dense MLP, shared-expert, router, norm and lm_head weights + the routed experts of "
              "the step (per MoE layer, the union over the batch, and over the prompt for a prefill) + one "
              "embedding row per distinct token id + the latent cache held, each tensor as the artifact stores it (a "
              "quantized one: its integers and scales; transformers: fp32); FLOPs = 2 x tokens x (those "
              "matrices, k experts per token) + absorbed attention over the rows attended + the lm_head of "
              "one token per sequence, over the fp32 GEMM rate (over the int8 GEMM rate for the quantized artifacts, "
              "whose products ONNX Runtime computes with int8 activations, where torch measured one and it is the "
              "faster); "
              "achieved_over_bound = median time / median bound; achieved_gbps (achieved_gflops) = the bytes "
              "(FLOPs) over the median time, checked against the bound's rates (bound_check)"),
}


def _rows(spec: WholeModelSpec, prepared, status: dict, routing: dict, results: dict, routed: dict,
          machine: dict) -> tuple[dict, list[dict]]:
    """Each path's information and the rows of the available ones, with their bounds and comparisons."""
    config, primary = prepared.manifest.config, prepared.primary.path
    groups = {v.path: manifest_weight_groups(v.manifest, bool(((results.get(v.path) or {}).get("info") or {}).get(
        "scales_half"))) for v in prepared.variants}  # the bytes the engine that ran reads
    groups[TRANSFORMERS] = weight_groups(config, 4)  # transformers runs the checkpoint in fp32
    artifacts = {v.path: str(v.artifact) for v in prepared.variants}
    records = {path: r.get("records", {}) for path, r in routed.items()}
    arithmetic = _arithmetic(prepared)
    bounds = {path: _Bounds(spec, config, g, routing, records.get(path if path in artifacts else primary, {}), machine,
                            arithmetic.get(path, "fp32"))
              for path, g in groups.items()}
    paths = {path: _path_info(path, status[path], results.get(path), groups[path], artifacts.get(path))
             for path in groups}
    rows = [_row(spec, path, key, results[path]["records"].get(key), bounds[path])
            for path in paths if path in results and paths[path]["available"] for key in points(spec)]
    _compare(rows, {p: r["records"] for p, r in results.items()}, records, primary)
    return paths, rows


def _routing(routing: dict, routed: dict, rows: list[dict]) -> dict:
    """The report's ``routing``: how routed experts were counted, the reference that counted them, and a note
    when some points fell back to the uniform expectation."""
    routing = dict(routing, reference=next((r["info"] for r in routed.values() if r.get("info")), None))
    if routing["method"] == "measured" and any(r.get("bound") and r["bound"]["routed_experts"] != "measured"
                                               for r in rows if r["status"] == "ok"):
        failed = [f"{path}: {r['failure']}" for path, r in routed.items() if r.get("failure")]
        routing["note"] = ("some points fell back to the uniform expectation (their reference run failed"
                           + (f"; {'; '.join(failed)}" if failed else "") + ")")
    return routing


def _model(spec: WholeModelSpec, config, weights: dict) -> dict:
    return {"name": config.name, "source": spec.source, "location": spec.location, "layers": spec.layers,
            "num_hidden_layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
            "num_attention_heads": config.num_attention_heads, "latent_dim": config.latent_dim,
            "vocab_size": config.vocab_size, "n_routed_experts": config.n_routed_experts,
            "num_experts_per_tok": config.num_experts_per_tok if config.is_moe else None, "weights": weights}


def build_report(spec: WholeModelSpec, prepared, status: dict, routing: dict, results: dict, routed: dict,
                 probes: list[dict], described: dict, started: float, command: str | None) -> dict:
    """bench.json's content (see the module docstring).

    Args:
        results: per path (``ours``, ``ours-int8``, ..., ``transformers``), :func:`~.driver.run_role`'s result.
        routed: per ``ours`` path, the result of the routing reference of its artifact."""
    manifest = prepared.manifest
    config = manifest.config
    machine = _machine(spec, probes, described)
    paths, rows = _rows(spec, prepared, status, routing, results, routed, machine)
    return {
        "format": FORMAT, "format_version": 1, "command": command,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "wall_seconds": round(time.time() - started, 1),
        "unit": (f"the whole model {config.name}: {config.num_hidden_layers} decoder layer(s), embedding and lm_head; "
                 f"decode steps (one new token per sequence, greedy) after a context, and the prefill of a "
                 f"{spec.prompt_length}-token prompt"),
        "model": _model(spec, config, paths[prepared.primary.path]["weights"]),
        "artifact": {"path": str(prepared.artifact), "precision": manifest.precision,
                     "cache_mode": manifest.layout.mode, "max_cache_length": manifest.capacity,
                     "weights": manifest.weights.to_dict()},
        "checkpoint": str(prepared.checkpoint) if prepared.checkpoint else None,
        "preparation": {"notes": prepared.notes, "seconds": prepared.seconds},
        "protocol": {
            "threads": spec.threads, "warmup": spec.warmup, "repeat": spec.repeat, "dtype": "float32",
            "weights": _weights_protocol(prepared.variants),
            "decode": (f"a prompt of max(T, 1) random tokens per sequence fills the cache (ours: prefill steps in "
                       f"chunks; transformers: its generate's own prefill), then {spec.warmup} untimed and "
                       f"{spec.repeat} timed greedy decode steps; ms per token = median step time; ours times "
                       f"OrtEngine.step('decode') plus the host argmax, transformers the interval between the "
                       f"tokens its generate streams"),
            "prefill": (f"{spec.prompt_length} random tokens per sequence into an empty cache, {spec.warmup} untimed "
                        f"and {spec.repeat} timed calls, median; ours: OrtEngine.step('prefill') plus the host "
                        f"argmax, transformers: generate(max_new_tokens=1)"),
            **PROTOCOL,
        },
        "routing": _routing(routing, routed, rows), "machine": machine,
        "bound_check": bound_check(machine, rows, _arithmetic(prepared)),
        "paths": paths, "rows": rows,
        "versions": versions(VERSIONS),
    }


# text -------------------------------------------------------------------------------------------------------------


def _bound_cells(row: dict) -> tuple[str, str, str]:
    b = row.get("bound")
    if not b:
        return "-", "-", "-"
    experts = f"{b['distinct_experts_per_moe_layer']:.1f}" if b["routed_experts"] != "none" else "-"
    if b["routed_experts"] == "uniform":
        experts += " (uniform)"
    return f"{format_ms(b['bound_ms'])} {b['bound'][:3]}", f"{b['achieved_over_bound']:.2f}x", experts


def _ratio(row: dict, key: str) -> str:
    return f"{row[key]:.2f}x" if row.get(key) else "-"


def _read(row: dict) -> str:
    return format_bytes(row["bound"]["bytes"]) if row.get("bound") else "-"


DECODE_HEAD = ("path", "T", "B", "ms/token", "p10-p90 ms", "tok/s per seq", "tok/s batch", "x transformers",
               "x float", "peak RSS", "read/step", "bound ms", "achieved/bound", "experts/MoE layer")
PREFILL_HEAD = ("path", "B", "prompt", "ms", "p10-p90 ms", "tok/s", "x transformers", "x float", "peak RSS",
                "read/step", "bound ms", "achieved/bound", "experts/MoE layer")
LLAMA_BENCH_HEAD = ("path", "weights", "size", "params", "backend", "threads", "test", "t/s")


def _ordered(report: dict, kind: str) -> list[dict]:
    """The rows of ``kind`` by point, then in the order of the paths (the artifacts, then transformers)."""
    order = {path: i for i, path in enumerate(report["paths"])}
    rows = [r for r in report["rows"] if r["kind"] == kind]
    return sorted(rows, key=lambda r: (r["context"] or 0, r["batch"], order.get(r["path"], len(order))))


def decode_rows(report: dict) -> list[tuple]:
    out = []
    for r in _ordered(report, "decode"):
        if r["status"] != "ok":
            out.append((r["path"], r["context"], r["batch"], f"{r['status']}: {r.get('detail') or ''}")
                       + ("",) * (len(DECODE_HEAD) - 4))
            continue
        lat = r["latency_ms"]
        out.append((r["path"], r["context"], r["batch"], f"{r['ms_per_token']:.2f}", f"{lat['p10']:.2f}-{lat['p90']:.2f}",
                    f"{r['tokens_per_s_per_sequence']:.1f}", f"{r['tokens_per_s_batch']:.1f}",
                    _ratio(r, "speedup_vs_transformers"), _ratio(r, "speedup_vs_float"),
                    format_bytes(r["peak_rss_bytes"]), _read(r), *_bound_cells(r)))
    return out


def prefill_rows(report: dict) -> list[tuple]:
    out = []
    for r in _ordered(report, "prefill"):
        if r["status"] != "ok":
            out.append((r["path"], r["batch"], r["prompt_length"], f"{r['status']}: {r.get('detail') or ''}")
                       + ("",) * (len(PREFILL_HEAD) - 4))
            continue
        lat = r["latency_ms"]
        out.append((r["path"], r["batch"], r["prompt_length"], f"{lat['median']:.2f}",
                    f"{lat['p10']:.2f}-{lat['p90']:.2f}", f"{r['tokens_per_s']:.1f}",
                    _ratio(r, "speedup_vs_transformers"), _ratio(r, "speedup_vs_float"),
                    format_bytes(r["peak_rss_bytes"]), _read(r), *_bound_cells(r)))
    return out


def llama_bench_rows(report: dict) -> list[tuple]:
    """The batch-1 rows as llama-bench's table gives them (size: the weights as stored; params: all of them)."""
    out = []
    threads = report["protocol"]["threads"]
    for r in _ordered(report, "prefill") + _ordered(report, "decode"):
        if r["status"] != "ok" or "llama_bench" not in r:
            continue
        weights = report["paths"][r["path"]]["weights"]
        backend = "torch CPU" if r["path"] == TRANSFORMERS else "ORT CPU"
        lb = r["llama_bench"]
        params = weights["total_params"]
        out.append((r["path"], plan(r["weights"]).stored_type("fp32"),
                    format_bytes(weights["total_bytes"]),
                    f"{params / 1e9:.2f} B" if params >= 1e8 else f"{params / 1e6:.2f} M", backend, threads,
                    lb["test"], f"{lb['tokens_per_s_mean']:.2f} ± {lb['tokens_per_s_std']:.2f}"))
    return out


def _llama_bench_title(report: dict) -> str:
    p = report["protocol"]
    return (f"of {report['model']['name']} as llama-bench reports them (batch 1, {p['threads']} thread(s); "
            f"ppL = prompt tokens/s of an L-token prompt, tg{p['repeat']} @ dT = generated tokens/s after a context "
            f"of T; "
            f"mean ± std of the per-call rates)")


def _text_table(head: tuple, rows: list[tuple]) -> list[str]:
    cells = [head] + [tuple(str(x) for x in r) for r in rows]
    widths = [max(len(r[i]) for r in cells if i < len(r)) for i in range(len(head))]
    lines = []
    for i, r in enumerate(cells):
        lines.append("  ".join(x.ljust(w) if j == 0 else x.rjust(w) for j, (x, w) in enumerate(zip(r, widths))).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def _routing_line(report: dict) -> str:
    routing = report["routing"]
    if routing["method"] == "uniform":
        return (f"routed experts: NOT MEASURED, the expected number under uniform routing is used "
                f"({routing['reason']})")
    if routing["method"] == "measured":
        return ("routed experts: measured with router hooks on the PyTorch reference of each artifact's weights, on "
                "the tokens that artifact fed"
                + (f"; {routing['note']}" if routing.get("note") else ""))
    return f"routed experts: none ({routing['reason']})"


def _agreement_line(report: dict) -> str | None:
    """How often the paths chose the same greedy tokens (the same weights computing the same function): each
    artifact against the PyTorch reference of its own weights, transformers against the float artifact."""
    parts = []
    for path in report["paths"]:
        key = "tokens_agree_with_ours" if path == TRANSFORMERS else "tokens_agree_with_reference"
        rows = [r for r in report["rows"] if r["path"] == path and r.get(key) is not None]
        if rows:
            against = rows[0].get("tokens_compared_with", "ours") if path == TRANSFORMERS else "its reference"
            parts.append(f"{path} = {against} on {min(r[key] for r in rows):.0%} of the decode tokens (worst point)")
    return f"greedy tokens: {'; '.join(parts)}" if parts else None


def _notes(report: dict) -> list[str]:
    lines = []
    for path, info in report["paths"].items():
        if not info["available"]:
            lines.append(f"{path}: not available ({info['reason']})")
        elif info.get("peak_rss_bytes"):
            runtime = info.get("runtime") or {}
            how = "; ".join(v for v in (runtime.get("graphs"), runtime.get("huge_pages"), runtime.get("mapped_weights")) if v)
            lines.append(f"{path}: loaded in {info['load_seconds']:.1f} s{f' ({how})' if how else ''}; peak RSS "
                         f"{format_bytes(info['peak_rss_bytes'])}")
    return lines + [_routing_line(report)] + [line for line in [_agreement_line(report)] if line]


def format_table(report: dict) -> str:
    """What the command prints: the machine, the decode and prefill tables, the paths and the routing."""
    lines = [machine_line(report), report["unit"], "", "decode (one new token per sequence per step):"]
    lines += _text_table(DECODE_HEAD, decode_rows(report))
    lines += ["", "prefill:"] + _text_table(PREFILL_HEAD, prefill_rows(report))
    bench_rows = llama_bench_rows(report)
    if bench_rows:
        lines += ["", "batch-1 points " + _llama_bench_title(report) + ":"] + _text_table(LLAMA_BENCH_HEAD, bench_rows)
    lines += [""] + _notes(report)
    if report.get("bound_check"):
        lines.append(bound_check_line(report["bound_check"]))
    lines.append("achieved/bound: median time / the bound (bytes the step must read over the measured bandwidth, "
                 "or FLOPs over the measured GEMM rate, whichever is longer)")
    return "\n".join(lines)


def _md_table(head: tuple, rows: list[tuple]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + \
           ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def markdown(report: dict) -> str:
    """bench.md: the protocol, the decode and prefill tables, the paths, the routing and the weights."""
    p = report["protocol"]
    lines = [f"# mla-deploy bench model: {report['model']['name']}", "", f"Unit: {report['unit']}.", "",
             f"Machine: {machine_line(report)}.", ""]
    if report.get("command"):
        lines += [f"Command: `{report['command']}`", ""]
    lines += ["## Decode", "", "ms/token: one decode step (a new token for every sequence of the batch); tok/s per "
              "seq = 1000 / ms; tok/s batch = B x 1000 / ms.", ""]
    lines += _md_table(DECODE_HEAD, decode_rows(report))
    lines += ["", "## Prefill", "", "tok/s = B x prompt / s.", ""] + _md_table(PREFILL_HEAD, prefill_rows(report))
    bench_rows = llama_bench_rows(report)
    if bench_rows:
        lines += ["", "## llama-bench", "", f"The batch-1 points {_llama_bench_title(report)}. size: the weights as "
                  "stored (quantized integers and scales included).", ""] + _md_table(LLAMA_BENCH_HEAD, bench_rows)
    lines += ["", "## Paths", ""]
    for path, info in report["paths"].items():
        line = f"* `{path}`: {info['label']}"
        if not info["available"]:
            line += f" — **not available**: {info['reason']}"
        elif info.get("peak_rss_bytes"):
            pages = (info.get("runtime") or {}).get("huge_pages")
            line += (f" — loaded in {info['load_seconds']:.1f} s, peak RSS {format_bytes(info['peak_rss_bytes'])} "
                     f"(after loading {format_bytes(info['peak_rss_after_load_bytes'])})"
                     f"{f'; {pages}' if pages else ''}")
        lines.append(line)
    lines += ["", "## Bound", "", p["bound"] + ".", "", f"* {_routing_line(report)}"]
    if report.get("bound_check"):
        lines.append(f"* {bound_check_line(report['bound_check'])}")
    lines += [f"* {line}" for line in [_agreement_line(report)] if line]
    for path, info in report["paths"].items():
        w = info["weights"]
        quantized = (f" ({format_bytes(w['quantized_bytes'])} of it in {w['quantized_tensors']} {w['weights']} "
                     f"tensors, integers and scales)" if w["quantized_bytes"] else "")
        lines.append(f"* weights of `{path}`: {format_bytes(w['total_bytes'])} in all{quantized}; every step reads "
                     f"{format_bytes(w['always_bytes'])} (attention, dense and shared MLPs, routers, norms) + lm_head "
                     f"{format_bytes(w['lm_head_bytes'])}; one routed expert {format_bytes(w['expert_bytes'])} "
                     f"({w['n_experts']} per MoE layer, {w['moe_layers']} MoE layer(s), top-{w['top_k']})")
    lines.append("")
    lines += ["## Protocol", ""] + [f"* {k}: {v}" for k, v in p.items() if isinstance(v, str)]
    lines += [f"* threads {p['threads']}, warm-up {p['warmup']}, repeat {p['repeat']}", ""]
    lines += [f"Preparation: {'; '.join(report['preparation']['notes'])}.", "",
              f"Versions: {', '.join(f'{k} {v}' for k, v in report['versions'].items() if v)}.", ""]
    return "\n".join(lines)
