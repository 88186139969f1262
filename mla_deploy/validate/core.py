"""``validate_artifact``: run an artifact and its PyTorch original over one trajectory and compare them.

1. :func:`~mla_deploy.artifact.check_artifact` (files whole, manifest consistent with the graphs).
2. The runners (:class:`TorchRunner` reference, :class:`OrtRunner`, optionally TensorRT) go through
   ``Comparator.run`` over a :class:`TrajectoryLoader` (prefill, then teacher-forced decode steps); the
   ``RunResults`` are saved (``run_results.json``, ``inputs.json``) so they can be compared again later.
3. ``Comparator.compare_accuracy`` with per-output ``atol``/``rtol`` from the recipe's
   ``[validate.tolerance.<precision>]`` decides pass/fail per output per step.
4. An artifact with quantized weights adds the quantization's cost, the artifact as deployed against the
   unquantized original, judged by the recipe's ``[validate.quantization.<scheme>]`` (:mod:`.quantization`).
5. ``report.json``, ``report.html`` and ``report.md`` are written (see :mod:`.report`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ..artifact import Manifest, check_artifact
from ..errors import AccuracyError, InputError, OutputError
from ..recipe import Tolerance, ValidateSettings
from .quantization import cost_check
from .report import INPUTS_FILE, REPORT_JSON, Comparison, RunRecord, build_report, environment
from .report import write_reports as write_files

RUNTIMES = ("onnxrt", "tensorrt")


@dataclass
class ValidationResult:
    """The outcome of :func:`validate_artifact`.

    Attributes:
        passed: every output of every runner at every step is within tolerance, and quantized weights' cost
            (``report["quantization"]``) is within its thresholds.
        report: the content of ``report.json`` (every figure).
        out_dir: where the files were written (None when ``write_reports=False``).
        files: ``{"report.json": path, ...}`` of the files written.
    """

    passed: bool
    report: dict[str, Any]
    out_dir: Path | None = None
    files: dict[str, Path] = field(default_factory=dict)

    @property
    def worst(self) -> dict[str, Any] | None:
        """The output, step and runner farthest from tolerance (the first failure's kind when failing)."""
        return self.report.get("worst")

    @property
    def graph_passed(self) -> bool:
        """The graphs' comparison with the PyTorch reference (the reference carries a quantized artifact's
        dequantized weights) is within tolerance."""
        return all(r["passed"] for r in self.report.get("runners", {}).values())

    @property
    def quantization(self) -> dict[str, Any] | None:
        """The quantization's cost against the unquantized original (None for float weights)."""
        return self.report.get("quantization")

    def _sections(self) -> list[dict[str, Any]]:
        """The report's sections beside the graphs' comparison: the quantization's cost (quantized weights)."""
        return [self.quantization] if self.quantization is not None else []

    def lines(self) -> list[str]:
        """:meth:`summary`, then for quantized weights the quantization's line."""
        from .quantization import summary_line

        return [self.summary()] + [summary_line(section) for section in self._sections()]

    def summary(self) -> str:
        """One line: the graphs' verdict, the worst output, its step and error, and where the report is."""
        w = self.worst
        where = f"; report: {self.files['report.html']}" if "report.html" in self.files else ""
        passed = self.graph_passed
        if w is None:
            return f"validation {'passed' if passed else 'failed'} (nothing compared){where}"
        tol = f"atol {w['atol']:.1e}, rtol {w['rtol']:.1e}"
        if w.get("nonfinite"):
            return (f"validation failed: {w['output']} holds {w['nonfinite']} NaN/Inf values at step {w['step']} "
                    f"({w['role']}) ({w['runner']} vs {w['reference']}){where}")
        figures = f"max abs error {w['max_abs']:.3e}, max rel error {w['max_rel']:.3e}"
        step = f"step {w['step']} ({w['role']})"
        if passed:
            return (f"validation passed: {self.report['summary']['compared']} output-steps within {tol}; worst "
                    f"{w['output']} at {step}: {figures} ({w['runner']} vs {w['reference']}){where}")
        return (f"validation failed: worst output {w['output']} at {step}: {figures} exceeds {tol} "
                f"({w['runner']} vs {w['reference']}; {self.report['summary']['failed']} of "
                f"{self.report['summary']['compared']} output-steps fail){where}")

    def failures(self) -> list[str]:
        """The lines of :meth:`lines` that fail."""
        verdicts = [self.graph_passed] + [section["passed"] for section in self._sections()]
        return [line for line, ok in zip(self.lines(), verdicts) if not ok]

    def raise_for_failure(self) -> None:
        """Raise :class:`~mla_deploy.errors.AccuracyError` (the failing lines of :meth:`lines`) unless passed."""
        if not self.passed:
            raise AccuracyError("; ".join(self.failures()))

    def __str__(self) -> str:
        return "\n".join(self.lines())


def output_names(config) -> list[str]:
    """``logits`` then every cache's present (``present_latent.{i}`` for each layer; with sparse attention
    ``present_index.{i}`` too, :func:`~mla_deploy.cache_layout.cache_tensors`): what every runner returns per step."""
    from ..cache_layout import cache_tensors

    return ["logits"] + [t.present for t in cache_tensors(config)]


@dataclass(frozen=True)
class ValidateOptions:
    """How :func:`validate_artifact` compares and what it leaves behind, beside the artifact, runtimes and steps.

    Attributes:
        tolerance: overrides the recipe's: one :class:`Tolerance` for every output, or ``{output: Tolerance}``
            (key ``""`` = default).
        check_error_stat: Polygraphy's ``elemwise`` (default), ``max``, ``mean``, ``median`` or ``quantile``.
        prompt_lengths: explicit prompt lengths (default: the recipe's batch, lengths ``L, L-1, ...``).
        write_reports: write the files (``False``: only return the result).
        raise_on_failure: raise :class:`AccuracyError` (after writing the reports) when an output fails.
        quiet: keep Polygraphy's per-iteration logging off.
        use_engine: ONNX Runtime on the CPU runs the artifact's pre-built CPU engine (``ARTIFACT/cpu``) where the
            fast compute is compared (float weights; quantized: as deployed), when it has one; the exact compute of
            quantized weights always runs the source graphs. False: the source graphs everywhere.
        cuda: ONNX Runtime's CUDA provider options (:class:`~mla_deploy.ort.cuda.CudaOptions`; None: its defaults).
    """

    tolerance: Tolerance | dict[str, Tolerance] | None = None
    check_error_stat: str = "elemwise"
    prompt_lengths: Sequence[int] | None = None
    write_reports: bool = True
    raise_on_failure: bool = False
    quiet: bool = True
    use_engine: bool = True
    cuda: Any = None


def validate_artifact(artifact_dir: str | Path, out_dir: str | Path | None = None, steps: int | None = None, *,
                      load_results: str | Path | None = None, runtimes: Sequence[str] = ("onnxrt",),
                      provider: str = "cpu", threads: int | None = None,
                      options: ValidateOptions = ValidateOptions(),
                      log: Callable[[str], None] | None = None) -> ValidationResult:
    """Validate an exported artifact against the PyTorch original it was exported from.

    Args:
        artifact_dir: the export directory.
        out_dir: where ``run_results.json``, ``inputs.json`` and the reports go (default ``<artifact>/validation``).
        steps: decode steps after the prefill (default: the recipe's ``[validate] decode_steps``; quantized
            weights: at least ``[validate] quantization_steps``, as many as a static cache holds).
        load_results: a ``run_results.json`` saved by an earlier run: compare it again without running anything
            (``inputs.json`` beside it, when present, restricts the figures to real tokens).
        runtimes: runners compared with the reference: ``onnxrt`` and/or ``tensorrt`` (needs ``mla_deploy.trt``).
        provider, threads: ONNX Runtime execution provider (``cpu``/``cuda``) and intra-op threads.
        options: tolerances, error statistic, prompt lengths, reports, failure and logging (:class:`ValidateOptions`).
        log: called with one line per step (runners ready, the trajectory run, the comparison, the reports).
    Returns:
        a :class:`ValidationResult`.
    Raises:
        ArtifactError: a missing, truncated or inconsistent artifact. AccuracyError: see ``options.raise_on_failure``.
        RuntimeMissingError: Polygraphy, ONNX Runtime (or TensorRT when asked for) is unavailable.
        InputError: bad ``runtimes``/``steps``/``load_results``. CacheCapacityError: the trajectory does not fit.
    """
    from . import compat

    o = options

    compat.polygraphy_version()
    root = Path(artifact_dir)
    manifest = check_artifact(root)
    settings = manifest.validate_settings()
    names = output_names(manifest.config)
    tolerances = _tolerances(o.tolerance, settings, manifest.precision, names)
    out = Path(out_dir) if out_dir is not None else root / "validation"
    if o.write_reports:
        check_writable_dir(out)  # before minutes of running, not after
    if load_results is not None:
        with compat.quiet(o.quiet):
            run_results, feeds, providers, trajectory = _load(Path(load_results), names)
    else:
        run_results, feeds, providers, trajectory = _run(root, manifest, settings, steps, runtimes, provider,
                                                         threads, o, log or (lambda line: None))
    cost = cost_check(manifest)
    reference, others, pairs = _comparisons(compat.runner_names(run_results), cost.runners)
    compare_func = compat.simple_compare_func({k: t.atol for k, t in tolerances.items()},
                                              {k: t.rtol for k, t in tolerances.items()}, o.check_error_stat)
    with compat.quiet(o.quiet):
        accuracy = compat.compare(run_results, pairs, compare_func)
    compared = Comparison(reference, tuple(others), tuple(names), tolerances, o.check_error_stat)
    run = RunRecord(run_results, feeds, trajectory, str(load_results) if load_results is not None else "run")
    report = build_report(root, manifest, run, accuracy, compared, environment(providers))
    report = cost.judged(report, run_results, feeds, manifest, settings)
    result = ValidationResult(bool(report["passed"]), report)
    if o.write_reports:
        _write(result, out, report, None if load_results is not None else run)
    if o.raise_on_failure:
        result.raise_for_failure()
    return result


def _write(result: ValidationResult, out: Path, report: dict, run: "RunRecord | None") -> None:
    """Write the reports (and, for a fresh run, its results and inputs) into ``out``; record them on ``result``."""
    result.out_dir = out
    try:
        result.files = write_files(out, report, None if run is None else run.run_results,
                                   None if run is None else run.feeds)
    except OSError as exc:
        raise OutputError(f"cannot write the validation reports to {out}: {exc.strerror or exc}") from None


def _comparisons(runners: list[str], cost: Sequence[str]) -> tuple[str, list[str], list[tuple[int, int]]]:
    """The reference runner, the runners compared with it (all but the reference and ``cost``'s, which the
    quantization's cost compares: :func:`~.quantization.cost_check`), and Polygraphy's comparison index pairs.

    Raises:
        InputError: run results without ``cost``'s runners, or with nothing to compare.
    """
    reference = "torch" if "torch" in runners else runners[0]
    if not set(cost) <= set(runners):
        raise InputError(f"the run results lack the runners {' and '.join(cost)} that measure a quantized "
                         f"artifact's cost (runners: {', '.join(runners)})")
    others = [name for name in runners if name != reference and name not in cost]
    if not others:
        raise InputError(f"the run results hold only the runner {reference!r}: nothing to compare")
    return reference, others, [(runners.index(name), runners.index(reference)) for name in others]


def check_writable_dir(out: Path) -> None:
    """Refuse a report folder that cannot be made: a file in the way, or no write permission.

    Raises:
        OutputError: naming the path and the reason.
    """
    import os

    existing = next(p for p in (out, *out.parents) if os.path.lexists(p))
    if not existing.is_dir():
        raise OutputError(f"cannot write the validation reports to {out}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write the validation reports to {out}: {existing} is not writable")


def _tolerances(tolerance, settings: ValidateSettings, precision: str, names: list[str]) -> dict[str, Tolerance]:
    """Per-output tolerances: ``{"": default, "logits": ..., "present_latent.0": ...}``."""
    if isinstance(tolerance, dict):
        default = tolerance.get("", settings.tolerance[precision])
        out = {"": default, **{n: tolerance.get(n, default) for n in names}}
    else:
        default = tolerance if isinstance(tolerance, Tolerance) else settings.tolerance[precision]
        out = {"": default, **{n: default for n in names}}
    for key, tol in out.items():
        if not (tol.atol >= 0 and tol.rtol >= 0):
            raise InputError(f"tolerance of {key or 'every output'} must be >= 0, got {tol}")
    return out


def _run(root: Path, manifest: Manifest, settings: ValidateSettings, steps, runtimes, provider, threads,
         options: ValidateOptions, log):
    from . import compat
    from .runners import OrtRunner, TorchRunner, trt_runner
    from .trajectory import TrajectoryLoader, make_trajectory

    unknown = [r for r in runtimes if r not in RUNTIMES]
    if unknown or not runtimes:
        raise InputError(f"runtimes must be among {', '.join(RUNTIMES)}, got {list(runtimes)}")
    cost = cost_check(manifest)
    prompt_lengths = options.prompt_lengths
    longest = max(prompt_lengths) if prompt_lengths else settings.prompt_length
    decode_steps, clamped = cost.decode_steps(settings.decode_steps if steps is None else int(steps), settings,
                                              longest, manifest.capacity)
    trajectory = make_trajectory(manifest.config.vocab_size, settings.batch, settings.prompt_length, decode_steps,
                                 settings.seed, prompt_lengths, manifest.capacity)
    # the engines first: one their runtime cannot run (bf16 on ONNX Runtime's CPU provider, no TensorRT) is refused
    # before the reference is loaded, which takes minutes for a full-size checkpoint
    log(f"loading {', '.join(runtimes)} ...")
    engines = []
    if "onnxrt" in runtimes:  # quantized weights: exact float32 products, the graph's own error only
        engines.append(OrtRunner(root, provider=provider, threads=threads, use_engine=options.use_engine,
                                 cuda=options.cuda, **cost.exact))
    if "tensorrt" in runtimes:
        engines.append(trt_runner(root))
    log("loading the PyTorch reference ...")
    # quantized weights add their cost: as deployed against the unquantized original
    runners = [TorchRunner.from_artifact(root, manifest), *engines, *cost.runners_for(root, manifest, provider, threads,
                                                                                  options.use_engine, options.cuda)]
    loader = TrajectoryLoader(trajectory)
    log(f"running {', '.join(r.name for r in runners)} over a prefill and {decode_steps} decode steps ...")
    with compat.quiet(options.quiet):
        run_results = compat.run_comparator(runners, loader)
    log("comparing ...")
    providers = {r.name: getattr(r, "provider", None) or "torch-cpu" for r in runners}
    return run_results, list(loader), providers, cost.record(trajectory.to_dict(), clamped)


def _load(path: Path, names: list[str]):
    from . import compat

    try:
        run_results = compat.load_run_results(path)
    except (FileNotFoundError, ValueError) as exc:
        raise InputError(str(exc)) from None
    for runner in compat.runner_names(run_results):
        iterations = compat.iteration_outputs(run_results, runner)
        have = sorted(iterations[0]) if iterations else []
        if sorted(names) != have:
            raise InputError(f"{path}: runner {runner} has outputs {have}, the artifact's are {sorted(names)}")
    feeds, providers, trajectory = None, {}, {"source": str(path)}
    inputs = path.parent / INPUTS_FILE
    if inputs.is_file():
        feeds = compat.load_feed_dicts(inputs)
    previous = path.parent / REPORT_JSON
    if previous.is_file():
        try:
            old = json.loads(previous.read_text())
            providers = old.get("environment", {}).get("providers", {})
            trajectory = {**old.get("trajectory", {}), "source": str(path)}
        except (OSError, json.JSONDecodeError, AttributeError):
            pass
    return run_results, feeds, providers, trajectory
