"""``mla-deploy bench model``: the whole model's decode and prefill speed and memory, this project's
exported artifact in ONNX Runtime beside transformers' own model on the same checkpoint, each against the
bound this machine's bandwidth and GEMM rate (measured in the same run) put on the step.

The driver prepares the artifacts (a checkpoint is exported into ``OUT/artifact``, and with ``--weights int8``
... also into ``OUT/artifact-int8`` ...; a preset's random checkpoint is first written to ``OUT/checkpoint``;
all are reused by a later run on the same model), then runs every part in a process of its own (:mod:`.worker`,
through the shared harness :mod:`..harness`): probes of the machine, ``ours`` on each artifact (``ours``,
``ours-int8``, ...) and the routing reference of each, ``transformers``, and writes ``bench.json`` and ``bench.md``
(:mod:`.report`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ... import host, quant
from ...errors import ExportError, InputError
from ...weight_bytes import PROCESS_OVERHEAD, export_bytes, manifest_weight_groups, weight_groups
from .. import machine
from ..harness import run_points
from .spec import TRANSFORMERS, WholeModelSpec, points

#: marks ``OUT/checkpoint`` as written by the bench, with what it holds (a later run reuses it when equal)
CHECKPOINT_RECORD = "checkpoint.json"


@dataclass(frozen=True)
class Variant:
    """One artifact ``ours`` runs. Attributes: path: its name in the report (``ours``, ``ours-int8``: :meth:`mla_deploy.quant.Quantization.variant`);
    artifact: the folder; manifest: its manifest."""

    path: str
    artifact: Path
    manifest: object


@dataclass
class Prepared:
    """What the bench runs on.

    Attributes:
        variants: the artifacts, in ``--weights`` order (one for ``--artifact``).
        checkpoint: the checkpoint folder transformers and the reference load (None: the artifact has none).
        notes: what preparing did, for the report. seconds: how long each preparation step took.
    """

    variants: list[Variant]
    checkpoint: Path | None
    notes: list[str] = field(default_factory=list)
    seconds: dict = field(default_factory=dict)

    @property
    def primary(self) -> Variant:
        """The float artifact when there is one, else the first: transformers' rows take its routing."""
        return next((v for v in self.variants if v.path == "ours"), self.variants[0])

    @property
    def artifact(self) -> Path:
        return self.primary.artifact

    @property
    def manifest(self):
        return self.primary.manifest


def _every(seconds: float, echo: Callable[[str], None], label: str):
    """A ``progress(done, total, seconds)`` callback echoing one line at most every ``seconds``."""
    last = [0.0]

    def show(done: int, total: int, elapsed: float) -> None:
        if elapsed - last[0] >= seconds or (total and done >= total):
            last[0] = elapsed
            echo(f"{label}: {done / 1e9:.2f} / {total / 1e9:.2f} GB ({elapsed:.0f} s)")

    return show


def _check_disk(folder: Path, need: int, what: str) -> None:
    free = shutil.disk_usage(folder).free
    if need > free:
        raise InputError(f"{what} needs about {need / 1e9:.1f} GB on disk, {free / 1e9:.1f} GB free under {folder}; "
                         f"choose another --out or fewer --layers")


def _random_checkpoint(config, folder: Path, seed: int, std: float, echo) -> tuple[float, str]:
    """Write ``config``'s random fp32 checkpoint to ``folder`` unless the bench already wrote the same one there.
    Returns (seconds, what was done)."""
    from ...random_checkpoint import write_random_checkpoint

    record_file = folder.parent / CHECKPOINT_RECORD
    wanted = {"config": config.to_dict(), "seed": seed, "std": std, "dtype": "fp32"}
    if folder.exists():
        record = json.loads(record_file.read_text()) if record_file.is_file() else None
        if record == wanted and (folder / "config.json").is_file():
            return 0.0, f"reused the random checkpoint in {folder}"
        if record is None and any(folder.iterdir()):
            raise ExportError(f"{folder} exists and was not written by the bench; choose another --out")
        shutil.rmtree(folder)
    groups = weight_groups(config, 4)
    _check_disk(folder.parent, 2 * groups.total_bytes, "the random checkpoint and its artifact")
    echo(f"writing a random fp32 checkpoint of {config.name} ({groups.total_bytes / 1e9:.2f} GB) to {folder}")
    start = time.perf_counter()
    record_file.unlink(missing_ok=True)
    write_random_checkpoint(config, folder, dtype="fp32", seed=seed, std=std,
                            progress=_every(10.0, echo, "checkpoint"))
    from ...artifact import atomic_write_text

    atomic_write_text(record_file, json.dumps(wanted, indent=2) + "\n")
    return time.perf_counter() - start, f"wrote a random fp32 checkpoint (seed {seed}, std {std}) to {folder}"


def _export(recipe, checkpoint: Path, artifact: Path, echo, quantization=quant.FLOAT) -> tuple[object, float, str]:
    """Export ``checkpoint`` with ``recipe``'s settings (its weights quantized as ``quantization``) to ``artifact``
    (as ``mla-deploy export --hf`` does), unless it already holds that export. Returns (manifest, seconds, what was
    done)."""
    from ...artifact import MANIFEST, load_manifest
    from ...checkpoint import CheckpointTensors
    from ...errors import ArtifactError
    from ...exporter import export_recipe, fingerprint

    source = CheckpointTensors(checkpoint)  # read one tensor at a time while the weights are written
    weights = source.weights_source()
    if (artifact / MANIFEST).is_file():
        try:
            old = load_manifest(artifact)
        except ArtifactError:
            old = None
        if (old is not None and old.fingerprint == fingerprint(recipe, weights)
                and old.recipe.get("export") == recipe.to_dict()["export"]):
            source.close()
            return old, 0.0, f"reused the artifact in {artifact} (same checkpoint and export settings)"
    _check_disk(artifact.parent, export_bytes(recipe.model, quantization), "the export")
    echo(f"exporting {checkpoint} to {artifact}")
    start = time.perf_counter()
    manifest = export_recipe(recipe, artifact, weights=weights, overwrite=True, source=source,
                             progress=_every(10.0, echo, "export"))
    seconds = time.perf_counter() - start
    return manifest, seconds, f"exported {checkpoint} to {artifact} in {seconds:.1f} s"


def _engine(artifact: Path, echo) -> tuple[float, str]:
    """Build ``artifact``'s CPU engine (``mla-deploy build ARTIFACT --target cpu``) unless it has a fresh one, so
    that the bench runs what a user runs after that one-time step. Returns (seconds, what was done)."""
    from ...artifact import load_manifest
    from ...ort.cpu_build import build_cpu_engine
    from ...ort.engine import fresh_cpu_engine
    from ...errors import ArtifactError

    try:
        if fresh_cpu_engine(artifact, load_manifest(artifact)) is not None:
            return 0.0, f"reused the CPU engine in {artifact / 'cpu'}"
    except ArtifactError:
        pass  # stale: rebuilt below
    echo(f"building the CPU engine of {artifact}")
    record = build_cpu_engine(artifact)
    return record.build_seconds, (f"built the CPU engine of {artifact} in {record.build_seconds:.1f} s (operators: "
                                  f"{record.operators.describe()})")


def _require_fit(config, spec: WholeModelSpec) -> None:
    """Refuse, before writing anything, a model that none of the ``--weights`` asked for fits in this machine's
    memory (the smallest export's weights); each export is checked again once written (:func:`plan`), and the fp32
    reference (transformers, the measured routing) is skipped where it does not fit."""
    plans = quant.plans(spec.weights, spec.block_size)
    need, smallest = min(((export_bytes(config, q) + PROCESS_OVERHEAD, q) for q in plans), key=lambda pair: pair[0])
    available = host.available_memory()
    if available is not None and need > spec.memory_fraction * available:
        raise InputError(f"{config.name} needs about {need / 2**30:.1f} GiB in {smallest.stored_type('fp32')} and "
                         f"{available / 2**30:.1f} GiB are available, so no path could load it; bench its first "
                         f"layers (--preset NAME --layers N), smaller weights (--weights int4) or an artifact exported "
                         f"in a smaller precision (--artifact)")


def _require_positions(config, spec: WholeModelSpec) -> None:
    """Refuse a run whose longest point reaches past the model's ``max_position_embeddings`` (its rope is defined
    up to there; ``run`` refuses the same without --allow-long)."""
    last = spec.capacity - 1  # the longest context's prompt and decode steps, or the prefill's prompt
    if last > config.max_position_embeddings:
        raise InputError(f"--context {max(spec.contexts)} with {spec.steps} decode steps (or --prompt-length "
                         f"{spec.prompt_length}) reaches position {last}, past the model's max_position_embeddings "
                         f"{config.max_position_embeddings}; bench shorter contexts")


def _as_given(spec: WholeModelSpec) -> Prepared:
    """``--artifact``: the artifact as exported, and the checkpoint its manifest names (if a folder)."""
    from ...artifact import load_manifest
    from ...ort.engine import check_precision, fresh_cpu_engine

    manifest = load_manifest(spec.location)
    check_precision(manifest.precision, "cpu")  # the ours path is OrtEngine on the CPU provider (worker)
    _require_positions(manifest.model, spec)
    if spec.engine:  # the worker opens the pre-built engine as OrtEngine does: a stale one is refused here, in one line
        fresh_cpu_engine(spec.location, manifest)
    weights = manifest.weights
    checkpoint = Path(weights.path) if weights.kind == "hf" and weights.path else None
    variant = Variant(manifest.quantization.variant("ours"), Path(spec.location), manifest)
    return Prepared([variant], checkpoint, [f"benched the artifact {spec.location} as given"])


def _source(spec: WholeModelSpec, out: Path, echo, prepared: Prepared):
    """The recipe to export and the checkpoint folder it reads (``prepared.checkpoint``): ``--hf`` as given, a
    preset or recipe written as a random fp32 checkpoint into ``out/checkpoint`` first."""
    from ...config import from_hf_config
    from ...recipe import Recipe, load_recipe

    if spec.source == "hf":
        checkpoint = Path(spec.location)
        base = Recipe(name=checkpoint.resolve().name, model=from_hf_config(checkpoint), source=str(checkpoint))
        _require_positions(base.model, spec)
        _require_fit(base.model, spec)
        out.mkdir(parents=True, exist_ok=True)
        prepared.checkpoint = checkpoint
        return base
    recipe = load_recipe(spec.location)
    model = recipe.model.first_layers(spec.layers) if spec.layers else recipe.model
    _require_positions(model, spec)
    _require_fit(model, spec)
    out.mkdir(parents=True, exist_ok=True)
    prepared.checkpoint = out / "checkpoint"
    seconds, note = _random_checkpoint(model, prepared.checkpoint, spec.seed, recipe.export.init_std, echo)
    prepared.seconds["checkpoint"] = seconds
    prepared.notes.append(note)
    # the checkpoint's own config (what transformers and the reference read), under the preset's name
    return recipe.replace(model=from_hf_config(prepared.checkpoint).replace(name=model.name))


def prepare(spec: WholeModelSpec, out: Path, echo: Callable[[str], None]) -> Prepared:
    """The artifact to bench, and the checkpoint beside it: ``--artifact`` as given; ``--hf`` exported into
    ``out/artifact``; a preset or recipe written as a random fp32 checkpoint into ``out/checkpoint`` (seed
    ``spec.seed``, the recipe's ``init_std``), then exported from it, so every path reads the same weights.

    The bench's exports are fp32 with the in-place (static) cache, one per ``spec.weights``: ``float`` into
    ``out/artifact``, ``int8``/``int4`` (blocks of ``spec.block_size``) into ``out/artifact-int8``/``-int4``.

    Raises:
        InputError: the model's fp32 weights do not fit this machine's memory, or its files do not fit the disk.
        ExportError: ``out/checkpoint`` holds something the bench did not write.
        RuntimeMissingError: an artifact ONNX Runtime's CPU provider cannot run (bf16)."""
    from ...cache_layout import STATIC

    if spec.source == "artifact":
        return _as_given(spec)
    prepared = Prepared([], None)
    base = _source(spec, out, echo, prepared)
    # the recipe's capacity stays a floor (the export traces its graphs within it); the engine sizes each
    # point's cache itself
    settings = dataclasses.replace(base.export, precision="fp32", cache_mode=STATIC.mode, decode_attention="standard",
                                   max_cache_length=max(spec.capacity, base.export.max_cache_length),
                                   **quant.FLOAT.settings())
    for quantization in quant.plans(spec.weights, spec.block_size, base.export.quant_format):
        export = dataclasses.replace(settings, **quantization.settings())
        folder = out / quantization.variant("artifact")
        manifest, seconds, note = _export(base.replace(export=export), prepared.checkpoint, folder, echo,
                                          quantization)
        prepared.seconds[f"export {quantization.weights}"] = seconds
        prepared.notes.append(note)
        if spec.engine:
            seconds, note = _engine(folder, echo)
            prepared.seconds[f"engine {quantization.weights}"] = seconds
            prepared.notes.append(note)
        prepared.variants.append(Variant(quantization.variant("ours"), folder, manifest))
    if any(seconds > 0 for seconds in prepared.seconds.values()) and hasattr(os, "sync"):
        # what this run wrote (a reused file costs nothing): its writeback would otherwise run beside the first points
        start = time.perf_counter()
        os.sync()
        prepared.notes.append(f"flushed the exports to disk before timing in {time.perf_counter() - start:.1f} s")
    return prepared


def plan(spec: WholeModelSpec, prepared: Prepared) -> tuple[dict, dict]:
    """Which paths run and how routing is counted, before anything is loaded.

    Returns:
        ``({path: {"available", "reason"}}`` for each variant (``ours``, ``ours-int8``, ...) and ``transformers``,
        ``{"method", "reason"})``; routing method ``measured`` (the reference runs), ``uniform`` (expected distinct
        experts under uniform routing) or ``none`` (a dense model).
    """
    config = prepared.manifest.config
    fp32 = weight_groups(config, 4).total_bytes + PROCESS_OVERHEAD
    available = host.available_memory()
    limit = spec.memory_fraction * available if available is not None else None

    def too_big(need: int) -> str | None:
        if limit is None or need <= limit:
            return None
        return (f"needs about {need / 2**30:.1f} GiB, {available / 2**30:.1f} GiB available "
                f"(limit {spec.memory_fraction:.0%} of it)")

    from ...errors import RuntimeMissingError
    from ...ort.engine import require_onnxruntime

    try:
        require_onnxruntime()
        missing = None
    except RuntimeMissingError:
        missing = "onnxruntime is not installed"
    status = {}
    for variant in prepared.variants:
        need = too_big(manifest_weight_groups(variant.manifest).total_bytes + PROCESS_OVERHEAD)
        reason = missing or (f"the artifact {need}" if need else None)
        status[variant.path] = {"available": reason is None, "reason": reason}
    status[TRANSFORMERS] = _transformers_status(spec, prepared, too_big(fp32))
    if not config.is_moe:
        routing = {"method": "none", "reason": "a dense model: no routed experts"}
    elif too_big(fp32):
        routing = {"method": "uniform", "reason": f"the fp32 reference model {too_big(fp32)}"}
    else:
        routing = {"method": "measured", "reason": None}
    return status, routing


def _transformers_status(spec: WholeModelSpec, prepared: Prepared, too_big: str | None) -> dict:
    reason = None
    if not spec.transformers:
        reason = "skipped (--no-transformers)"
    elif machine.package_version("transformers") is None:
        reason = "transformers is not installed"
    elif prepared.checkpoint is None:
        reason = (f"the artifact's weights are of kind {prepared.manifest.weights.kind!r}, not a checkpoint folder "
                  f"transformers can load (bench model --hf or --preset writes and uses one)")
    elif not prepared.checkpoint.is_dir():
        reason = f"the checkpoint {prepared.checkpoint} named by the artifact is not there"
    elif too_big:
        reason = f"the fp32 model {too_big}"
    return {"available": reason is None, "reason": reason}


def run_role(role: str, base_job: dict, keys: list[str], work: Path, threads: int, echo,
             name: str | None = None) -> dict:
    """Run ``role`` over the points ``keys`` in fresh processes until each point has a record (the shared
    harness, :func:`~..harness.run_points`: a process killed at a point, e.g. by the kernel's OOM killer, is
    restarted on the points after it). ``name``: how its files and progress lines call it (default: ``role``).

    Returns: ``{"records": {key: record}, "probes", "info", "load_seconds", "peak_rss_after_load_bytes",
    "restarts", "failure"}`` (``failure``: why the worker died before its first point, else None)."""
    name = name or role
    runs = run_points(f"{__package__}.worker", {**base_job, "role": role, "name": name}, keys, work, name, threads,
                      echo, stream=True)
    return {"records": {r["point"]: r for r in runs.records}, "probes": runs.probes, "info": runs.last("info"),
            "load_seconds": runs.last("load_seconds"),
            "peak_rss_after_load_bytes": runs.last("peak_rss_after_load_bytes"), "restarts": runs.restarts,
            "failure": runs.failure}


def _run_paths(spec: WholeModelSpec, prepared: Prepared, status: dict, routing: dict, work: Path, echo):
    """Every available path in turn, each in processes of its own, with a machine probe before each timed path
    and at the end. Returns (results per path, routing results per ``ours`` path, probes, routing)."""
    keys = points(spec)
    base = {"spec": spec.to_dict(), "capacity": spec.capacity,
            "checkpoint": str(prepared.checkpoint) if prepared.checkpoint else None}
    results, routed, probes = {}, {}, []

    def probe() -> None:
        probes.extend(run_role("probe", base, [], work, spec.threads, echo)["probes"])

    probe()
    for variant in prepared.variants:
        if not status[variant.path]["available"]:
            continue
        job = {**base, "artifact": str(variant.artifact)}
        results[variant.path] = run_role("ours", job, keys, work, spec.threads, echo, variant.path)
        if routing["method"] == "measured":  # the reference of this artifact's weights, on its tokens
            tokens = {k: r["tokens"] for k, r in results[variant.path]["records"].items()
                      if r.get("status") == "ok" and "tokens" in r}
            routed[variant.path] = run_role("routing", {**job, "tokens": tokens}, keys, work, spec.threads, echo,
                                            f"routing {variant.path}")
    if routing["method"] == "measured" and routed and all(r["failure"] for r in routed.values()):
        routing = {"method": "uniform", "reason": next(iter(routed.values()))["failure"]}
    if status[TRANSFORMERS]["available"]:
        probe()
        results[TRANSFORMERS] = run_role(TRANSFORMERS, {**base, "artifact": str(prepared.artifact)}, keys, work,
                                         spec.threads, echo)
    probe()
    return results, routed, probes, routing


def run_whole_model(spec: WholeModelSpec, out_dir: str | Path, echo: Callable[[str], None] | None = None,
                    command: str | None = None) -> dict:
    """Run ``spec``; write ``bench.json`` and ``bench.md`` into ``out_dir`` (atomically) and return the report."""
    echo = echo or (lambda line: None)
    out = Path(out_dir)
    created = [p for p in (out, *out.parents) if not os.path.lexists(p)]  # deepest first
    try:
        return _run_whole_model(spec, out, echo, command)
    except BaseException:  # failed or interrupted: the folders this run made and left empty go too
        for folder in created:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only an empty one: an export kept for a later run stays
        raise


def _run_whole_model(spec: WholeModelSpec, out: Path, echo: Callable[[str], None], command: str | None) -> dict:
    from ..reporting import write_outputs
    from .report import build_report, markdown

    started = time.time()
    described = host.describe()
    prepared = prepare(spec, out, echo)  # checks the source before anything is written
    out.mkdir(parents=True, exist_ok=True)
    status, routing = plan(spec, prepared)
    for path, s in status.items():
        if not s["available"]:
            echo(f"{path}: not available ({s['reason']})")
    if routing["reason"]:
        echo(f"routed experts: {routing['method']} ({routing['reason']})")
    work = Path(tempfile.mkdtemp(prefix=".bench-work-", dir=out))
    try:
        results, routed, probes, routing = _run_paths(spec, prepared, status, routing, work, echo)
        report = build_report(spec, prepared, status, routing, results, routed, probes, described, started, command)
        write_outputs(report, out, markdown)
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)
