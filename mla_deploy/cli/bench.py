"""``mla-deploy bench``: the attention bench, or the whole-model bench with ``--whole-model``."""

from __future__ import annotations

import click

from ..errors import ConfigError
from .groups import BLOCK_SIZES, seed_option, threads_help
from .options import Int, IntList, PathList, Positive, Threads, available_cpus


def _command_line(ctx: click.Context) -> str:
    """The command as run, rebuilt from its parsed options (for the report)."""
    import shlex

    parts = ["mla-deploy", ctx.info_name or "bench"]
    for name, value in ctx.params.items():
        if value is None or value is False:
            continue
        parts.append("--" + name.replace("_", "-"))
        if value is not True:
            parts.append(shlex.quote(",".join(map(str, value)) if isinstance(value, tuple) else str(value)))
    return " ".join(parts)


@click.command()
@click.option("--whole-model", is_flag=True,
              help="Bench the whole model instead of the attention stack: decode ms/token and tokens/s after a context, "
                   "prefill tokens/s, peak memory, ONNX Runtime beside transformers' own model, each against the "
                   "bound measured in the same run.")
@click.option("--preset", metavar="NAME", help="A built-in preset (see `mla-deploy presets`).")
@click.option("--recipe", type=click.Path(dir_okay=False), help="A recipe TOML file.")
@click.option("--artifact", type=click.Path(file_okay=False), help="--whole-model: an exported artifact, benched as is.")
@click.option("--hf", type=click.Path(file_okay=False),
              help="--whole-model: a Hugging Face DeepSeek checkpoint folder, exported into OUT/artifact first.")
@click.option("--layers", type=Int(),
              help="Attention layers in the benched unit [default: 2]; --whole-model: keep only the first N decoder "
                   "layers of the preset or recipe [default: all].")
@click.option("--context", type=IntList(minimum=0),
              help="Cached tokens T, comma list [default: 1024,4096,16384; --whole-model: 0,4096].")
@click.option("--batch", type=IntList(), default="1,8", show_default=True, help="Batch sizes B, comma list.")
@click.option("--prompt-length", type=Int(), help="--whole-model: tokens per sequence of the timed prefill [default: 512].")
@click.option("--threads", type=Threads(), default=lambda: min(2, available_cpus()),
              show_default="2, or the CPUs this process may use if fewer",
              help=threads_help("torch and ONNX Runtime intra-op threads"))
@click.option("--repeat", type=Int(),
              help="Timed calls per point and pass, at most [default: 20]; --whole-model: timed decode steps per "
                   "point and timed prefills per batch size [default: 10].")
@click.option("--warmup", type=Int(minimum=0), default=3, show_default=True, help="Untimed calls before them.")
@click.option("--passes", type=Int(),
              help="Passes; each runs every variant in its own process, odd passes in reverse order [default: 2].")
@click.option("--paths", type=PathList(),
              help="Comma subset of hf-eager, hf-sdpa, torch-cd, torch-absorbed, ort-concat, ort-static, trt "
                   "[default: all].")
@click.option("--max-seconds", type=Positive(),
              help="Time budget of one point in one pass (at least 3 timed calls are kept) [default: 20].")
@seed_option("Seed of the weights and inputs (--whole-model: of the prompts and of a preset's checkpoint).",
             default=0)
@click.option("--no-transformers", is_flag=True, help="--whole-model: do not time transformers' model.")
@click.option("--weights", "weights", metavar="LIST",
              help="--whole-model (--hf, --preset, --recipe): comma list of float, int8, int4; each is exported "
                   "(OUT/artifact, OUT/artifact-int8, ...) and timed, quantized rows beside the float one "
                   "[default: float].")
@click.option("--block-size", type=click.Choice(BLOCK_SIZES),
              help="--whole-model: input features per scale of the int8/int4 exports [default: 32].")
@click.option("--probe-mib", type=Int(), default=512, show_default=True, hidden=True, help="Read-bandwidth probe buffer.")
@click.option("--out", default="bench-results", show_default=True, type=click.Path(file_okay=False),
              help="Folder for bench.json, bench.md and bench.png; --whole-model from --hf or --preset also keeps the "
                   "exported artifact (and the random checkpoint) there, reused by a later run on the same model.")
def bench(whole_model, preset, recipe, artifact, hf, layers, context, batch, prompt_length, threads, repeat, warmup,
          passes, paths, max_seconds, seed, no_transformers, weights, block_size, probe_mib, out):
    """Decode-step latency, tokens/s, cache and peak memory of MLA attention: transformers' own attention
    (naive), this project's PyTorch model (CD and absorbed), the exported graph in ONNX Runtime (concat and
    static in place) and TensorRT where available; each against the machine's measured roofline.

    With --whole-model: the whole model (--artifact, --hf or --preset/--recipe [--layers N]) in ONNX Runtime
    beside transformers' AutoModelForCausalLM.generate on the same checkpoint: decode ms/token and tokens/s after
    each --context, prefill tokens/s of a --prompt-length prompt, peak RSS, and each step's time over its bound
    (the weights it must read, routed experts counted per step, plus the latent cache, over the measured
    bandwidth; or its FLOPs over the measured GEMM rate)."""
    command = _command_line(click.get_current_context())
    echo = lambda line: click.echo(line, err=True)  # noqa: E731
    sources = {"artifact": artifact, "hf": hf, "preset": preset, "recipe": recipe}
    given = [name for name, value in sources.items() if value]
    if whole_model:
        misplaced = [n for n, v in (("--passes", passes), ("--paths", paths), ("--max-seconds", max_seconds)) if v]
        if misplaced:
            raise ConfigError(f"{misplaced[0]} applies to the attention bench, not to --whole-model")
        if len(given) != 1:
            raise ConfigError("--whole-model takes exactly one of --artifact, --hf, --preset, --recipe")
        from ..bench.whole_model import run_whole_model
        from ..bench.whole_report import format_table as whole_model_table
        from ..bench.whole_spec import WholeModelSpec

        chosen = {"contexts": context, "prompt_length": prompt_length, "repeat": repeat, "weights": weights,
                  "block_size": None if block_size is None else int(block_size)}
        spec = WholeModelSpec(source=given[0], location=sources[given[0]], layers=layers, batches=batch,
                              threads=threads, warmup=warmup, seed=seed, transformers=not no_transformers,
                              probe_mib=probe_mib, **{k: v for k, v in chosen.items() if v is not None})
        report = run_whole_model(spec, out, echo=echo, command=command)
        click.echo(whole_model_table(report))
        click.echo(f"wrote {out}/bench.json, {out}/bench.md")
        return
    misplaced = [n for n, v in (("--artifact", artifact), ("--hf", hf), ("--prompt-length", prompt_length),
                                ("--no-transformers", no_transformers), ("--weights", weights),
                                ("--block-size", block_size)) if v]
    if misplaced:
        raise ConfigError(f"{misplaced[0]} applies to --whole-model only")
    from ..bench.driver import run_bench
    from ..bench.output import format_table
    from ..bench.spec import BenchSpec
    from ..recipe import load_recipe

    if bool(preset) == bool(recipe):
        raise ConfigError("give exactly one of --preset, --recipe")
    config = load_recipe(preset or recipe).model
    chosen = {"layers": layers, "contexts": context, "repeat": repeat, "passes": passes, "paths": paths,
              "max_seconds": max_seconds}
    spec = BenchSpec(config=config, batches=batch, threads=threads, warmup=warmup, seed=seed, probe_mib=probe_mib,
                     source=preset or recipe, **{k: v for k, v in chosen.items() if v is not None})
    report = run_bench(spec, out, echo=echo, command=command)
    click.echo(format_table(report))
    click.echo(f"wrote {out}/bench.json, {out}/bench.md, {out}/bench.png")
