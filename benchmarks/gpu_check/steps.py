"""The steps of the GPU check, as data: what each runs, whether it needs the GPU, what it waits for.

A step is one command whose output goes to ``logs/NAME.log`` and whose outcome goes to ``records/NAME.json`` in
the work folder. :func:`plan` lists them in the order they run; :mod:`.runner` runs them.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from .layout import REPO, Work

DECODE_CONTEXTS = "0,1024,4096"
DECODE_BATCHES = "1,32"
#: the kernel benchmark's grid: bench.py's own plus the issue's target points (batch >= 32, context >= 4096)
BENCH_GRID = ("--batch", "1", "8", "32", "64", "--heads", "16", "128", "--lengths", "1024", "4096", "8192", "32768")
TINY_BF16 = ("the tiny preset's random weights (init_std 0.3) put bf16 up to 1.2 off even in PyTorch "
             "(docs/validation.md): a failure is expected")
NO_BF16_ON_CPU = "ONNX Runtime's CPU provider has no bf16 kernels (the CLI refuses bf16 there): runs on the GPU only"


@dataclass(frozen=True)
class Model:
    """A model the pipeline steps export and run."""

    key: str
    export_args: tuple[str, ...]
    export_timeout: int
    validate_timeout: int


MODELS = {
    "tiny": Model("tiny", ("--preset", "tiny"), 300, 300),
    # 4 decoder layers of DeepSeek-V2-Lite (1 dense + 3 MoE of 64 experts), int4 weights in blocks of 32; a static
    # cache of 4096 + 256 rows holds the decode timing's longest context
    "v2lite4-int4": Model("v2lite4-int4", ("--preset", "deepseek-v2-lite", "--layers", "4", "--weights", "int4",
                                           "--max-cache-length", "4352"), 540, 540),
}
PRECISIONS = ("fp16", "bf16")
#: issue 48's GPU decode check: the routed experts' two forms, by ``export --experts``: the branches form (the old
#: GPU artifact, one static branch per expert) and ``auto`` (the fused form CUDA's QMoE runs, the exporter's choice
#: for fp16/bf16 GPU exports once issue 48's export half is in)
EXPERT_FORMS = {"branches": "branches", "fused": "auto"}
#: the GPU bench's engine variants timed on the fused form: CUDA graphs on/off, fpA_intB on (graph) against off
GPU_BENCH_VARIANTS = "graph,eager,graph-fpa"
GPU_BENCH_BATCHES = "1,8,32,64"


@dataclass(frozen=True)
class Step:
    """One command of the check.

    Attributes:
        group: ``env``, ``kernel``, ``export``, ``ort`` or ``decode`` (``--steps`` takes groups or names).
        argv: the command; run in the repository root.
        timeout: seconds before it is stopped (recorded as TIMEOUT).
        gpu: needs the GPU: ``--dry-run`` skips it.
        after: steps that must have passed first.
        needs_ort: needs onnxruntime and polygraphy (on the GPU machine: onnxruntime-gpu, from ``install``).
        skip: why it does not run in this mode (None: it runs).
        expect_fail: why a failure is expected: recorded as XFAIL (and a pass as XPASS), not counted as a failure.
        fail_on_skip: pytest: a skipped test fails the step (the GPU tests skip where torch sees no GPU).
        kind: which figures the report reads from its log.
    """

    name: str
    group: str
    argv: tuple[str, ...]
    timeout: int
    gpu: bool = False
    after: tuple[str, ...] = ()
    needs_ort: bool = False
    skip: str | None = None
    expect_fail: str | None = None
    fail_on_skip: bool = False
    kind: str = ""


@dataclass(frozen=True)
class Options:
    """What ``run`` was asked for."""

    work: Work
    dry_run: bool = False
    models: tuple[str, ...] = tuple(MODELS)
    precisions: tuple[str, ...] = PRECISIONS
    python: str = sys.executable

    @property
    def provider(self) -> str:
        return "cpu" if self.dry_run else "cuda"


def _mla(options: Options, *args: str) -> tuple[str, ...]:
    return (options.python, "-m", "mla_deploy", *args)


def _probe(options: Options, *args: str) -> tuple[str, ...]:
    return (options.python, "-m", "gpu_check.probes", *args)


def ort_cuda_test_files(repo: Path = REPO) -> tuple[str, ...]:
    """The test files of the engine on ONNX Runtime's CUDA provider (marked ``ort_cuda``): they need the carried
    onnxruntime-gpu, so they run after ``install`` in a step of their own, not among the kernel tests."""
    return tuple(str(p.relative_to(repo)) for p in sorted((repo / "tests").rglob("test_*.py"))
                 if "mark.ort_cuda" in p.read_text())


def gpu_test_files(repo: Path = REPO) -> tuple[str, ...]:
    """The test files holding ``gpu``-marked tests (only these are collected: the rest may need packages the GPU
    machine lacks, and a collection error would fail the step), less the TensorRT modules (``pytest.mark.trt`` on
    the whole module): TensorRT cannot be installed there, so they skip as a whole at collection, which the
    deselection by marker cannot prevent, and a skip fails the step."""
    files = []
    for path in sorted((repo / "tests").rglob("test_*.py")):
        text = path.read_text()
        if ("mark.gpu" in text and not re.search(r"^pytestmark = .*mark\.trt", text, re.M)
                and "mark.ort_cuda" not in text):
            files.append(str(path.relative_to(repo)))
    return tuple(files)


def env_steps(options: Options) -> list[Step]:
    smi = "nvidia-smi && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv"
    return [Step("nvidia-smi", "env", ("bash", "-c", smi), 60, gpu=True, kind="nvidia-smi"),
            Step("versions", "env", _probe(options, "versions"), 300, kind="versions")]


def kernel_steps(options: Options) -> list[Step]:
    pytest = (options.python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider")
    # TensorRT cannot be installed there: its tests would only skip
    return [Step("kernel-tests", "kernel", (*pytest, "-m", "gpu and not trt and not ort_cuda", *gpu_test_files()),
                 540, gpu=True,
                 fail_on_skip=True, kind="pytest"),
            Step("plugin-tests", "kernel", (*pytest, "-m", "not gpu and not trt", "tests/plugins"), 540, gpu=True,
                 kind="pytest"),
            Step("kernel-bench", "kernel", (options.python, "plugins/mla_decode/bench.py", *BENCH_GRID), 540, gpu=True,
                 kind="kernel-bench")]


def artifact(options: Options, model: str, precision: str) -> Path:
    return options.work.artifacts / f"{model}-{precision}"


def export_steps(options: Options) -> list[Step]:
    return [Step(f"export-{m}-{p}", "export",
                 _mla(options, "export", *MODELS[m].export_args, "--precision", p, "--cache-mode", "static", "--out",
                      str(artifact(options, m, p)), "--overwrite", "--quiet"), MODELS[m].export_timeout, kind="export")
            for m in options.models for p in options.precisions]


def pipeline_steps(options: Options, model: str, precision: str) -> list[Step]:
    """run, the in-place cache check and validate of one export on the provider (cuda; cpu in a dry run)."""
    path, provider, key = str(artifact(options, model, precision)), options.provider, f"{model}-{precision}"
    skip = NO_BF16_ON_CPU if options.dry_run and precision == "bf16" else None
    common = dict(after=(f"export-{key}",), needs_ort=True, skip=skip)
    prompts = ("--prompt-ids", "1,2,3,4,5,6,7", "--prompt-ids", "9,8")
    return [Step(f"run-{key}", "ort", _mla(options, "run", path, *prompts, "--max-new-tokens", "16", "--provider",
                                           provider, "--json"), 300, kind="run", **common),
            Step(f"static-{key}", "ort", _probe(options, "static", path, "--provider", provider), 300, kind="static",
                 **common),
            Step(f"validate-{key}", "ort", _mla(options, "validate", path, "--provider", provider, "--out",
                                                str(options.work.root / "validate" / key), "--quiet"),
                 MODELS[model].validate_timeout, kind="validate",
                 expect_fail=TINY_BF16 if key == "tiny-bf16" else None, **common)]


def ort_steps(options: Options) -> list[Step]:
    load = Step("ort-cuda-load", "ort", _probe(options, "cuda-load", "--env-file", str(options.work.env_file)), 600,
                gpu=True, needs_ort=True, kind="cuda-load")
    doctor = Step("doctor", "ort", _mla(options, "doctor", "--json"), 300, needs_ort=True, kind="doctor")
    pipeline = [s for m in options.models for p in options.precisions for s in pipeline_steps(options, m, p)]
    return [load, doctor, *pipeline]


def decode_steps(options: Options) -> list[Step]:
    """Whole-model decode ms/token of the 4-layer V2-Lite int4 export on the GPU, through `mla-deploy run` (the
    GPU bench of `bench model --provider cuda` is the gpu-decode group's)."""
    if "v2lite4-int4" not in options.models:
        return []
    timing = [Step(f"decode-{p}", "decode",
                   _probe(options, "decode", str(artifact(options, "v2lite4-int4", p)), "--provider", "cuda",
                          "--contexts", DECODE_CONTEXTS, "--batch", DECODE_BATCHES), 540, gpu=True, needs_ort=True,
                   after=(f"export-v2lite4-int4-{p}",), kind="decode")
              for p in options.precisions]
    return timing


def gpu_decode_artifact(options: Options, form: str) -> Path:
    return options.work.artifacts / f"gpu-decode-{form}"


def gpu_decode_steps(options: Options) -> list[Step]:
    """Issue 48's GPU decode check (group ``gpu-decode``), on the first model of ``--models``: export the branches
    and the fused form (bf16; fp16 in a dry run, which the CPU provider can run), profile the branches form
    (eager, CPU nodes allowed: it is the old artifact), validate the fused form on CUDA, time it with and without
    CUDA graphs and fpA_intB over batch 1/8/32/64 and context 0/1024/4096, time it beside transformers' static
    cache under torch.compile, the CUDA engine's GPU tests, and the kernel bench under CUDA-graph timing. The
    model is the 4-layer V2-Lite int4 where ``--models`` holds it, else the first one asked for.

    A dry run runs the exports, validates on the CPU provider and runs each bench as ``--dry-run`` (its plan:
    the command lines are checked, nothing is timed)."""
    if not options.models:
        return []
    model = MODELS["v2lite4-int4" if "v2lite4-int4" in options.models else options.models[0]]
    precision = "fp16" if options.dry_run else "bf16"
    args = tuple(a for a in model.export_args if a not in ("--max-cache-length", "4352"))
    capacity = ("--max-cache-length", "4352") if model.key != "tiny" else ()
    # the tiny preset holds 64 rows: its plan checks the command lines at contexts that fit
    contexts = "0,16" if model.key == "tiny" else DECODE_CONTEXTS
    dry = ("--dry-run",) if options.dry_run else ()
    steps = []
    for form, experts in EXPERT_FORMS.items():
        steps.append(Step(f"gpu-export-{form}", "gpu-decode",
                          _mla(options, "export", *args, *capacity, "--precision", precision, "--cache-mode", "static",
                               "--experts", experts, "--out", str(gpu_decode_artifact(options, form)), "--overwrite",
                               "--quiet"), model.export_timeout, kind="export"))

    def bench(name: str, form: str, *extra: str, timeout: int = 420) -> Step:
        argv = _mla(options, "bench", "model", "--artifact", str(gpu_decode_artifact(options, form)), "--provider",
                    "cuda", "--repeat", "10", "--out", str(options.work.root / "gpu-bench" / name), *extra, *dry)
        return Step(name, "gpu-decode", argv, timeout, gpu=not options.dry_run, after=(f"gpu-export-{form}",),
                    needs_ort=True, kind="gpu-bench")

    pytest = (options.python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider")
    steps += [
        bench("gpu-profile-branches", "branches", "--allow-cpu-nodes", "--variants", "eager", "--batch", "1,32",
              "--context", "0", "--no-transformers"),
        Step("gpu-validate-fused", "gpu-decode",
             _mla(options, "validate", str(gpu_decode_artifact(options, "fused")), "--provider", options.provider,
                  "--steps", "8", "--out", str(options.work.root / "validate" / "gpu-decode-fused"), "--quiet"),
             MODELS[model.key].validate_timeout, after=("gpu-export-fused",), needs_ort=True, kind="validate"),
        bench("gpu-bench-fused", "fused", "--variants", GPU_BENCH_VARIANTS, "--batch", GPU_BENCH_BATCHES,
              "--context", contexts, "--no-transformers"),
        bench("gpu-peer", "fused", "--variants", "graph", "--batch", "1,32", "--context", contexts.split(",")[0] +
              "," + contexts.split(",")[1]),
        Step("gpu-engine-tests", "gpu-decode", (*pytest, "-m", "ort_cuda", *ort_cuda_test_files()), 300, gpu=True,
             needs_ort=True, fail_on_skip=True, kind="pytest"),
        Step("gpu-kernel-bench-graphs", "gpu-decode",
             (options.python, "plugins/mla_decode/bench.py", "--timing", "cudagraph", *BENCH_GRID), 300, gpu=True,
             kind="kernel-bench"),
    ]
    return steps


def plan(options: Options) -> list[Step]:
    """Every step, in the order it runs."""
    return [*env_steps(options), *kernel_steps(options), *export_steps(options), *ort_steps(options),
            *decode_steps(options), *gpu_decode_steps(options)]


GROUPS = ("env", "kernel", "export", "ort", "decode", "gpu-decode")
#: issue 48's check in one call (after ``install``): the device and versions, the CUDA provider's load (which
#: writes the environment the later steps need) and the GPU decode group
GPU_DECODE_SELECTION = "env,ort-cuda-load,gpu-decode"
