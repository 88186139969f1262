"""``mla-deploy bench``: two benches, each a subcommand with only its own options.

* ``bench attention``: the decode step of N MLA attention layers (:mod:`mla_deploy.bench.attention`);
* ``bench model``: the whole exported model beside transformers' own (:mod:`mla_deploy.bench.whole_model`).

The spelling from before the subcommands still runs (:class:`BenchGroup`): ``bench --preset ...`` is
``bench attention --preset ...`` and ``bench --whole-model ...`` is ``bench model ...``.
"""

from __future__ import annotations

import click

from ..errors import ConfigError
from ..host import usable_cpus
from ..quant import parse_block_size
from .groups import BLOCK_SIZES, seed_option, threads_help
from .options import Int, IntList, Positive, Threads


class PathList(click.ParamType):
    """The attention bench's variants: a comma-separated subset of its paths, or ``all``
    (:func:`mla_deploy.bench.attention.spec.parse_paths` says which)."""

    name = "paths"

    def get_metavar(self, param, ctx=None) -> str:
        return "PATH[,PATH...]|all"

    def convert(self, value, param, ctx):
        from ..bench.attention.spec import parse_paths

        return value if isinstance(value, tuple) else parse_paths(value)


#: the old mode flag, read only by :class:`BenchGroup`
WHOLE_MODEL_FLAG = "--whole-model"


class BenchGroup(click.Group):
    """``bench`` with its two subcommands; arguments that start with an option other than ``--help`` are the
    spelling from before them: with ``--whole-model`` they go to ``model`` (the flag dropped), otherwise to
    ``attention``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0].startswith("-") and args[0] not in ctx.help_option_names:
            if WHOLE_MODEL_FLAG in args:
                args = ["model", *(a for a in args if a != WHOLE_MODEL_FLAG)]
            else:
                args = ["attention", *args]
        return super().parse_args(ctx, args)


class BenchCommand(click.Command):
    """A bench subcommand: an option of the other bench is refused with the name of the bench it belongs to."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            siblings = ctx.parent.command.commands if ctx.parent is not None else {}
            owner = next((name for name, command in siblings.items() if name != self.name
                          and any(exc.option_name in p.opts + p.secondary_opts for p in command.params)), None)
            if owner is None:
                raise
            raise click.UsageError(f"{exc.option_name} is an option of `bench {owner}`, not of `bench {self.name}`",
                                   ctx) from None


def _command_line(ctx: click.Context) -> str:
    """The command as run, rebuilt from its parsed options (for the report)."""
    import shlex

    parts = ["mla-deploy", "bench", ctx.info_name or "bench"]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        flag = getattr(param, "is_flag", False)
        if value is None or (flag and (value == param.default or not (value or param.secondary_opts))):
            continue
        if getattr(param, "is_flag", False):
            parts.append(param.opts[0] if value else param.secondary_opts[0])
        else:
            parts += [param.opts[0], shlex.quote(",".join(map(str, value)) if isinstance(value, tuple) else str(value))]
    return " ".join(parts)


def _echo(line: str) -> None:
    click.echo(line, err=True)


def _options(*decorators):
    """One decorator applying ``decorators`` in the order given (the order ``--help`` lists them)."""

    def apply(f):
        for decorator in reversed(decorators):
            f = decorator(f)
        return f

    return apply


_SOURCE = _options(
    click.option("--preset", metavar="NAME", help="A built-in preset (see `mla-deploy presets`)."),
    click.option("--recipe", type=click.Path(dir_okay=False), help="A recipe TOML file."),
)
_RUN = _options(
    click.option("--batch", "batches", type=IntList(), default="1,8", show_default=True,
                 help="Batch sizes B, comma list."),
    click.option("--threads", type=Threads(), default=lambda: min(2, usable_cpus()),
                 show_default="2, or the CPUs this process may use if fewer",
                 help=threads_help("torch and ONNX Runtime intra-op threads")),
    click.option("--warmup", type=Int(minimum=0), default=3, show_default=True, help="Untimed calls before the timed ones."),
)
_PROBE = _options(
    click.option("--probe-mib", type=Int(), default=512, show_default=True, hidden=True,
                 help="Read-bandwidth probe buffer."),
)


@click.group(cls=BenchGroup)
def bench() -> None:
    """Speed and memory against this machine's measured bound: `bench attention` (the decode step of N MLA
    attention layers) or `bench model` (the whole exported model beside transformers' own).

    The spelling from before the subcommands still works: `bench --preset NAME ...` is `bench attention`,
    `bench --whole-model ...` is `bench model`."""


@bench.command("attention", cls=BenchCommand,
               short_help="The decode step of N MLA attention layers, against transformers' attention and the roofline.")
@_SOURCE
@click.option("--layers", type=Int(), help="Attention layers in the benched unit [default: 2].")
@click.option("--context", "contexts", type=IntList(), help="Cached tokens T, comma list [default: 1024,4096,16384].")
@_RUN
@click.option("--repeat", type=Int(), help="Timed calls per point and pass, at most [default: 20].")
@click.option("--passes", type=Int(),
              help="Passes; each runs every variant in its own process, odd passes in reverse order [default: 2].")
@click.option("--paths", type=PathList(),
              help="Comma subset of hf-eager, hf-sdpa, torch-cd, torch-absorbed, ort-concat, ort-static, trt "
                   "[default: all].")
@click.option("--max-seconds", type=Positive(),
              help="Time budget of one point in one pass (at least 3 timed calls are kept) [default: 20].")
@seed_option("Seed of the weights and inputs.", default=0)
@_PROBE
@click.option("--out", default="bench-results", show_default=True, type=click.Path(file_okay=False),
              help="Folder for bench.json, bench.md and bench.png.")
def attention(preset, recipe, out, **options):
    """Decode-step latency, tokens/s, cache and peak memory of N MLA attention layers of a model's shapes:
    transformers' own attention (naive), this project's PyTorch model (CD and absorbed), the exported graph in
    ONNX Runtime (concat and static in place) and TensorRT where available; each against the machine's measured
    roofline."""
    from ..bench.attention.driver import run_bench
    from ..bench.attention.output import format_table
    from ..bench.attention.spec import BenchSpec
    from ..recipe import load_recipe

    if bool(preset) == bool(recipe):
        raise ConfigError("give exactly one of --preset, --recipe")
    spec = BenchSpec(config=load_recipe(preset or recipe).model, source=preset or recipe,
                     **{k: v for k, v in options.items() if v is not None})
    report = run_bench(spec, out, echo=_echo, command=_command_line(click.get_current_context()))
    click.echo(format_table(report))
    click.echo(f"wrote {out}/bench.json, {out}/bench.md, {out}/bench.png")


@bench.command("model", cls=BenchCommand,
               short_help="The whole exported model in ONNX Runtime beside transformers' own, against its bound.")
@click.option("--artifact", type=click.Path(file_okay=False), help="An exported artifact, benched as is.")
@click.option("--hf", type=click.Path(file_okay=False),
              help="A Hugging Face DeepSeek checkpoint folder, exported into OUT/artifact first.")
@_SOURCE
@click.option("--layers", type=Int(), help="Keep only the first N decoder layers of the preset or recipe [default: all].")
@click.option("--context", "contexts", type=IntList(minimum=0),
              help="Cached tokens T before the decode steps, comma list [default: 0,4096].")
@_RUN
@click.option("--prompt-length", type=Int(), help="Tokens per sequence of the timed prefill [default: 512].")
@click.option("--repeat", type=Int(), help="Timed decode steps per point and timed prefills per batch size [default: 10].")
@seed_option("Seed of the prompts and of a preset's random checkpoint.", default=0)
@click.option("--transformers/--no-transformers", default=True, show_default=True,
              help="Also time transformers' own model on the same checkpoint.")
@click.option("--engine/--no-engine", default=True, show_default=True,
              help="Run the artifact's CPU engine (mla-deploy build ARTIFACT --target cpu) when it has one, built "
                   "first for the bench's own exports; "
                   "--no-engine: its source graphs.")
@click.option("--weights", metavar="LIST",
              help="With --hf, --preset or --recipe: comma list of float, int8, int4; each is exported (OUT/artifact, "
                   "OUT/artifact-int8, ...) and timed, quantized rows beside the float one [default: float].")
@click.option("--block-size", type=click.Choice(BLOCK_SIZES),
              help="Input features per scale of the int8/int4 exports [default: 32].")
@_PROBE
@click.option("--provider", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="cuda: an --artifact exported for the GPU on ONNX Runtime's CUDA provider (batch 1,8,32,64 and "
                   "context 0,1024,4096 unless given), kernels per step and GPU busy fraction from torch.profiler, "
                   "beside transformers' DeepSeek-V2 with its static cache under torch.compile (reduce-overhead); "
                   "writes gpu-bench.json and gpu-bench.md.")
@click.option("--variants", metavar="LIST", default="graph,eager", show_default=True,
              help="--provider cuda: engine variants, comma list of graph, eager (CUDA graphs on/off), graph-fpa, "
                   "graph-nofpa (MatMulNBits' fpA_intB GEMM on/off).")
@click.option("--allow-cpu-nodes", is_flag=True,
              help="--provider cuda: let nodes the CUDA provider cannot run fall back to the CPU (an older export).")
@click.option("--dry-run", is_flag=True, help="--provider cuda: print the plan (points, variants, bounds) and exit.")
@click.option("--out", default="bench-results", show_default=True, type=click.Path(file_okay=False),
              help="Folder for bench.json and bench.md; from --hf, --preset or --recipe also keeps the exported "
                   "artifact (and the random checkpoint) there, reused by a later run on the same model.")
def model(artifact, hf, preset, recipe, out, provider, variants, allow_cpu_nodes, dry_run, **options):
    """The whole model (--artifact, --hf, or --preset/--recipe [--layers N]) in ONNX Runtime beside transformers'
    AutoModelForCausalLM.generate on the same checkpoint: decode ms/token and tokens/s after each --context,
    prefill tokens/s of a --prompt-length prompt, peak RSS, and each step's time over its bound (the weights it
    must read, routed experts counted per step, plus the latent cache, over the measured bandwidth; or its FLOPs
    over the measured GEMM rate)."""
    from ..bench.whole_model.driver import run_whole_model
    from ..bench.whole_model.report import format_table
    from ..bench.whole_model.spec import WholeModelSpec

    sources = {"artifact": artifact, "hf": hf, "preset": preset, "recipe": recipe}
    given = [name for name, value in sources.items() if value]
    if len(given) != 1:
        raise ConfigError("bench model takes exactly one of --artifact, --hf, --preset, --recipe")
    context = click.get_current_context()
    if provider == "cuda":
        return _gpu_model(context, artifact, out, variants, allow_cpu_nodes, dry_run, options)
    if dry_run or allow_cpu_nodes or context.get_parameter_source("variants") != click.core.ParameterSource.DEFAULT:
        raise ConfigError("--variants, --allow-cpu-nodes and --dry-run apply to --provider cuda")
    options["block_size"] = parse_block_size(options["block_size"])
    spec = WholeModelSpec(source=given[0], location=sources[given[0]],
                          **{k: v for k, v in options.items() if v is not None})
    report = run_whole_model(spec, out, echo=_echo, command=_command_line(click.get_current_context()))
    click.echo(format_table(report))
    click.echo(f"wrote {out}/bench.json, {out}/bench.md")


def _gpu_model(context: click.Context, artifact, out, variants: str, allow_cpu_nodes: bool, dry_run: bool,
               options: dict) -> None:
    """``bench model --provider cuda`` (:mod:`mla_deploy.bench.whole_model.gpu`)."""
    from click.core import ParameterSource

    from ..bench.whole_model import gpu

    if not artifact:
        raise ConfigError("bench model --provider cuda benches an exported GPU artifact: give --artifact (export it "
                          "with `mla-deploy export ... --precision bf16 --cache-mode static`)")
    cpu_only = [name for name in ("layers", "weights", "block_size", "prompt_length", "engine")
                if name in options and context.get_parameter_source(name) == ParameterSource.COMMANDLINE]
    if cpu_only:
        raise ConfigError(f"--{cpu_only[0].replace('_', '-')} applies to the CPU bench, not to --provider cuda")
    given = lambda name: context.get_parameter_source(name) == ParameterSource.COMMANDLINE  # noqa: E731
    spec = gpu.GpuBenchSpec(artifact=artifact,
                            batches=tuple(options["batches"]) if given("batches") else gpu.BATCHES,
                            contexts=tuple(options["contexts"]) if options.get("contexts") else gpu.CONTEXTS,
                            variants=tuple(v for v in variants.split(",") if v),
                            repeat=options.get("repeat") or 20, warmup=max(1, options["warmup"]),
                            peer=options["transformers"], allow_cpu_nodes=allow_cpu_nodes, seed=options["seed"])
    click.echo(gpu.format_plan(gpu.plan(spec)))
    if dry_run:
        return
    report = gpu.run_gpu_bench(spec, out, echo=_echo)
    click.echo(gpu.format_table(report))
    click.echo(f"wrote {out}/gpu-bench.json, {out}/gpu-bench.md")
