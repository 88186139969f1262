"""``mla-deploy bench model --artifact ART --provider cuda``: an exported GPU artifact's decode on ONNX Runtime's CUDA
provider, each point against the memory bound of its step, beside a PyTorch peer measured in the same run.

For each engine variant (:data:`VARIANTS`: CUDA graphs on or off, ``MatMulNBits``' fpA_intB GEMM on or off) and
each point (batch ``B`` in 1/8/32/64, context ``T`` in 0/1024/4096 by default):

* **decode ms/token**: a prompt of ``max(T, 1)`` random ids per sequence is prefilled, ``warmup`` decode steps
  run untimed (the first captures the CUDA graph), then ``repeat`` steps are timed one by one on the host clock,
  each ``engine.decode`` + ``engine.argmax`` (the token chosen on the device, ``[B]`` ids back), the median kept;
* **kernels per step and GPU busy fraction**: ``profile_steps`` more steps under ``torch.profiler`` (CUPTI traces
  every CUDA kernel of the process, ONNX Runtime's included): the kernels (memory copies and sets counted apart)
  per step, and the union of their intervals over the steps' wall time;
* **memory bound**: the bytes the step must read (:func:`~mla_deploy.bench.whole_model.cost.step_cost`: every
  weight read each step, the routed experts ``B`` tokens are expected to reach, the cache's held rows) over this
  GPU's measured device-to-device copy rate (read + write).

The **peer**: transformers' own DeepSeek-V2 (``AutoModelForCausalLM.from_config`` on the artifact's config, random
weights in the artifact's precision: decode speed does not depend on their values) generating greedily with its
static cache under ``torch.compile(mode="reduce-overhead")`` (CUDA graphs), ``generate(cache_implementation=
"static", compile_config=CompileConfig(mode="reduce-overhead"))``: decode ms/token is ``(t(1 + n) - t(1)) / n`` of
two timed generations after a warm one, so the prefill and the compilation cancel.

``--dry-run`` prints the plan (points, variants and their provider options, the bound of each point in bytes, the
peer) from the manifest alone: nothing is opened, no GPU is needed.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ...errors import ConfigError
from ...ort.cuda import CudaOptions

#: the engine variants a run can time: CUDA graphs, and the fpA_intB GEMM of MatMulNBits, on and off
VARIANTS = {
    "graph": CudaOptions(cuda_graph=True),
    "eager": CudaOptions(cuda_graph=False),
    "graph-fpa": CudaOptions(cuda_graph=True, fpa_intb=True),
    "graph-nofpa": CudaOptions(cuda_graph=True, fpa_intb=False),
}
BATCHES = (1, 8, 32, 64)
CONTEXTS = (0, 1024, 4096)
PEER = ('transformers AutoModelForCausalLM.from_config (DeepSeek-V2, random weights) .generate(greedy, '
        'cache_implementation="static", compile_config=CompileConfig(mode="reduce-overhead"))')


@dataclass(frozen=True)
class GpuBenchSpec:
    """What a GPU bench run measures (see the module docstring)."""

    artifact: str
    batches: tuple[int, ...] = BATCHES
    contexts: tuple[int, ...] = CONTEXTS
    variants: tuple[str, ...] = ("graph", "eager")
    repeat: int = 20
    warmup: int = 3
    profile_steps: int = 5
    peer: bool = True
    peer_tokens: int = 32
    allow_cpu_nodes: bool = False
    seed: int = 0

    def __post_init__(self):
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown or not self.variants:
            raise ConfigError(f"--variants takes a comma list of {', '.join(VARIANTS)}; got {','.join(self.variants)}")
        if self.warmup < 1:
            raise ConfigError("the GPU bench needs at least one warm-up step (it captures the CUDA graph)")

    def options(self, variant: str) -> CudaOptions:
        from dataclasses import replace

        return replace(VARIANTS[variant], strict_placement=not self.allow_cpu_nodes)

    @property
    def points(self) -> list[tuple[int, int]]:
        """``(context, batch)``, smallest working set first."""
        return sorted(((t, b) for t in self.contexts for b in self.batches), key=lambda p: (p[0] * p[1], p))

    def rows(self) -> int:
        """Cache rows per sequence the run needs."""
        return max(max(self.contexts), 1) + self.warmup + self.repeat + self.profile_steps + 1


def step_bound(manifest, batch: int, context: int) -> dict:
    """The bytes one decode step of ``batch`` sequences after ``context`` tokens must read (weights, the routed
    experts ``batch`` tokens are expected to reach uniformly, the held cache rows)."""
    from ...weight_bytes import manifest_weight_groups
    from .cost import expected_distinct_experts, step_cost

    groups = manifest_weight_groups(manifest)
    experts = [expected_distinct_experts(groups.n_experts, groups.top_k, batch)] * len(groups.moe_layers)
    return step_cost(manifest.config, groups, batch, 1, max(context, 1), experts, batch)


def plan(spec: GpuBenchSpec) -> dict:
    """The run as data, from the manifest alone (what ``--dry-run`` prints)."""
    from ...artifact import load_manifest

    manifest = load_manifest(spec.artifact)
    if not manifest.layout.in_place:
        raise ConfigError(f"{spec.artifact} has a {manifest.layout.mode} cache; the GPU bench needs the in-place "
                          f"static cache (export with --cache-mode static)")
    capacity = manifest.capacity or 0
    if capacity and spec.rows() > capacity:
        raise ConfigError(f"{spec.artifact} holds {capacity} cache rows per sequence; the longest --context needs "
                          f"{spec.rows()} (export with --max-cache-length {spec.rows()} or more)")
    variants = {}
    for name in spec.variants:
        options = spec.options(name)
        variants[name] = {"provider_options": options.provider(manifest.precision, capture=True)[1],
                          "session_entries": options.session_entries()}
    points = [{"context": t, "batch": b, "bound_bytes": step_bound(manifest, b, t)["bytes"]} for t, b in spec.points]
    return {"artifact": str(spec.artifact), "model": manifest.name, "precision": manifest.precision,
            "weights": manifest.quantization.weights, "layers": manifest.config.num_hidden_layers,
            "variants": variants, "points": points, "timing": {"warmup": spec.warmup, "repeat": spec.repeat,
                                                               "profile_steps": spec.profile_steps},
            "peer": PEER if spec.peer else None}


def format_plan(planned: dict) -> str:
    lines = [f"plan: {planned['model']} ({planned['layers']} layers, {planned['precision']}, "
             f"{planned['weights']} weights) on ONNX Runtime's CUDA provider"]
    for name, variant in planned["variants"].items():
        lines.append(f"  variant {name}: provider options {variant['provider_options']}, session entries "
                     f"{variant['session_entries']}")
    for point in planned["points"]:
        lines.append(f"  context {point['context']:>5}  batch {point['batch']:>3}  step reads "
                     f"{point['bound_bytes'] / 1e6:9.1f} MB (the memory bound at the measured copy rate)")
    timing = planned["timing"]
    lines.append(f"  per point: {timing['warmup']} warm-up, {timing['repeat']} timed, {timing['profile_steps']} "
                 f"profiled decode steps")
    lines.append(f"  peer: {planned['peer'] or 'not run (--no-transformers)'}")
    return "\n".join(lines)


# --- on the GPU ---------------------------------------------------------------------------------------------------

def copy_rate_gbps(torch, mib: int = 1024) -> float:
    """Device-to-device copy rate of this GPU, read + write bytes per second / 1e9 (the median of 10 copies)."""
    source = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    target.copy_(source)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * source.numel() / statistics.median(times) / 1e9


def profile_steps(torch, step: Callable[[], None], count: int) -> dict:
    """``count`` calls of ``step`` under ``torch.profiler`` (CUDA activity through CUPTI): kernels and memory
    operations per step, and the fraction of the wall time some kernel or copy ran."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(count):
            step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    device = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = [e for e in device if e.name.lower().startswith(("memcpy", "memset"))]
    intervals = sorted((e.time_range.start, e.time_range.end) for e in device)
    busy, last = 0.0, None
    for begin, end in intervals:  # the union of the intervals, in microseconds
        if last is None or begin > last:
            busy += end - begin
            last = end
        elif end > last:
            busy += end - last
            last = end
    return {"kernels_per_step": (len(device) - len(copies)) / count, "copies_per_step": len(copies) / count,
            "busy_fraction": min(1.0, busy / 1e6 / wall) if wall else None}


def time_point(engine, torch, spec: GpuBenchSpec, batch: int, context: int) -> dict:
    """One point on an open engine: prefill, warm-up, timed and profiled decode steps."""
    rng = np.random.default_rng((spec.seed, batch, context))
    vocab = engine.vocab_size
    ids = rng.integers(0, vocab, size=(batch, max(context, 1)), dtype=np.int64)
    state = engine.new_state(batch, rows=spec.rows())
    tokens = engine.argmax(engine.prefill(ids, np.full(batch, ids.shape[1]), state))

    def step():
        nonlocal tokens
        tokens = engine.argmax(engine.decode(tokens, state))

    for _ in range(spec.warmup):
        step()
    times = []
    for _ in range(spec.repeat):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    row = {"context": context, "batch": batch, "ms_per_token": 1e3 * statistics.median(times),
           "ms_min": 1e3 * min(times)}
    if spec.profile_steps and torch is not None:
        row.update(profile_steps(torch, step, spec.profile_steps))
    return row


def run_variant(spec: GpuBenchSpec, name: str, torch, echo) -> dict:
    from ...ort.engine import OrtEngine

    engine = OrtEngine(spec.artifact, provider="cuda", cuda=spec.options(name))
    rows = []
    for context, batch in spec.points:
        try:
            row = time_point(engine, torch, spec, batch, context)
        except Exception as exc:  # a point that does not fit the GPU's memory: recorded, the others still run
            row = {"context": context, "batch": batch, "error": (str(exc).splitlines() or [type(exc).__name__])[0][:200]}
        echo(f"{name}: {json.dumps(row)}")
        rows.append(row)
    info = engine.info()
    return {"variant": name, "cuda": info.get("cuda"), "cuda_graph": info.get("cuda_graph"),
            "token_choice": info.get("token_choice"), "rows": rows}


def peer_point(model, torch, batch: int, context: int, tokens: int, seed: int) -> dict:
    """Decode ms/token of transformers' ``generate`` with its static cache under ``torch.compile``."""
    from transformers import CompileConfig

    rng = np.random.default_rng((seed, batch, context))
    ids = torch.from_numpy(rng.integers(0, model.config.vocab_size, size=(batch, max(context, 1)))).cuda()
    compile_config = CompileConfig(mode="reduce-overhead", fullgraph=True)

    def generate(new: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, cache_implementation="static", compile_config=compile_config)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    generate(1 + tokens)  # compiles and captures
    one, many = generate(1), generate(1 + tokens)
    return {"context": context, "batch": batch, "ms_per_token": 1e3 * (many - one) / tokens}


def run_peer(spec: GpuBenchSpec, manifest, torch, echo) -> dict:
    import transformers

    from ...config import to_hf_config

    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[manifest.precision]
    config = transformers.AutoConfig.for_model(**to_hf_config(manifest.config))
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=dtype).cuda().eval()
    rows = []
    for context, batch in spec.points:
        try:
            row = peer_point(model, torch, batch, context, spec.peer_tokens, spec.seed)
        except Exception as exc:
            row = {"context": context, "batch": batch, "error": (str(exc).splitlines() or [type(exc).__name__])[0][:200]}
        echo(f"peer: {json.dumps(row)}")
        rows.append(row)
    return {"peer": PEER, "transformers": transformers.__version__, "rows": rows}


def run_gpu_bench(spec: GpuBenchSpec, out: str | Path, echo: Callable[[str], None] = print) -> dict:
    """Every variant and the peer at every point; writes ``OUT/gpu-bench.json`` and ``OUT/gpu-bench.md``.

    Raises: RuntimeMissingError: the CUDA provider does not load, or torch sees no CUDA GPU (one line each)."""
    from ...artifact import load_manifest
    from ...errors import RuntimeMissingError
    from ...ort.cuda import require_cuda
    from ...ort.engine import require_onnxruntime

    planned = plan(spec)
    require_cuda(require_onnxruntime())
    try:
        import torch
    except ImportError as exc:
        raise RuntimeMissingError("the GPU bench profiles with torch.profiler: install torch with CUDA") from exc
    if not torch.cuda.is_available():
        raise RuntimeMissingError("torch sees no CUDA GPU: the GPU bench's profiler and peer need one")
    manifest = load_manifest(spec.artifact)
    rate = copy_rate_gbps(torch)
    report = {"plan": planned, "gpu": torch.cuda.get_device_name(0), "copy_gbps": rate,
              "variants": [run_variant(spec, name, torch, echo) for name in spec.variants]}
    if spec.peer:
        try:
            report["peer"] = run_peer(spec, manifest, torch, echo)
        except Exception as exc:  # transformers missing or its model refusing: said in the report
            report["peer"] = {"peer": PEER, "error": (str(exc).splitlines() or [type(exc).__name__])[0][:300]}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-bench.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "gpu-bench.md").write_text(format_table(report) + "\n")
    return report


def format_table(report: dict) -> str:
    """The report as a Markdown table: one row per point, a column group per variant, the peer, the bound."""
    bounds = {(p["context"], p["batch"]): p["bound_bytes"] for p in report["plan"]["points"]}
    rate = report["copy_gbps"]
    peer = {(r["context"], r["batch"]): r for r in report.get("peer", {}).get("rows", [])}
    head = ["context", "batch"]
    for variant in report["variants"]:
        head += [f"{variant['variant']} ms/token", "kernels/step", "GPU busy"]
    head += ["peer ms/token", "bound ms", "best / bound"]
    lines = [f"{report['plan']['model']} ({report['plan']['precision']}, {report['plan']['weights']} weights) on "
             f"{report['gpu']}; copy {rate:.0f} GB/s (read + write); bound: bytes a step reads / that rate", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for context, batch in sorted(bounds, key=lambda p: (p[0] * p[1], p)):
        cells, best = [str(context), str(batch)], None
        for variant in report["variants"]:
            row = next(r for r in variant["rows"] if (r["context"], r["batch"]) == (context, batch))
            if "error" in row:
                cells += [f"error: {row['error'][:60]}", "", ""]
                continue
            best = row["ms_per_token"] if best is None else min(best, row["ms_per_token"])
            busy = row.get("busy_fraction")
            cells += [f"{row['ms_per_token']:.3f}", f"{row.get('kernels_per_step', float('nan')):.0f}",
                      "" if busy is None else f"{busy:.0%}"]
        theirs = peer.get((context, batch), {})
        cells.append(f"{theirs['ms_per_token']:.3f}" if "ms_per_token" in theirs else theirs.get("error", "")[:60])
        bound = bounds[(context, batch)] / (rate * 1e9) * 1e3
        cells += [f"{bound:.3f}", f"{best / bound:.1f}x" if best else ""]
        lines.append("| " + " | ".join(cells) + " |")
    for variant in report["variants"]:
        lines.append(f"\n{variant['variant']}: CUDA graphs {variant['cuda_graph']}; tokens chosen on the "
                     f"{variant['token_choice']}; {variant['cuda']}")
    if "peer" in report and "error" in report["peer"]:
        lines.append(f"\npeer not measured: {report['peer']['error']}")
    return "\n".join(lines)
