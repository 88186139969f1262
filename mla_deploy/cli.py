"""The ``mla-deploy`` command line. Thin: options -> recipe -> a library call.

Heavy modules (torch, onnx, onnxruntime, tensorrt) are imported inside the commands, so
``mla-deploy --help`` is instant. A :class:`~mla_deploy.errors.MLADeployError` becomes one line on
stderr and exit status 1; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import sys

import click

from . import __version__
from .errors import MLADeployError


def _one_line_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except MLADeployError as exc:
            message = " ".join(str(exc).split())
            click.echo(f"mla-deploy: error: {message}", err=True)
            sys.exit(1)

    return wrapper


def _config_from(preset: str | None, recipe: str | None, hf: str | None):
    from .config import from_hf_config
    from .errors import ConfigError
    from .recipe import load_recipe

    given = [x for x in (preset, recipe, hf) if x]
    if len(given) != 1:
        raise ConfigError("give exactly one of --preset, --recipe, --hf")
    if hf:
        return from_hf_config(hf)
    return load_recipe(preset or recipe).model


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mla-deploy")
def main() -> None:
    """Deploy DeepSeek-style Multi-Head Latent Attention models: absorbed rewrite, ONNX export with the
    latent cache as explicit I/O, TensorRT engines, and validation against PyTorch."""


@main.command()
@click.option("--preset", help="A built-in preset (see `mla-deploy presets`).")
@click.option("--recipe", type=click.Path(dir_okay=False), help="A recipe TOML file.")
@click.option("--hf", type=click.Path(), help="A Hugging Face checkpoint folder or config.json.")
@_one_line_errors
def inspect(preset, recipe, hf):
    """Print a model's dimensions and its cache size per token per layer (MHA, CD, latent)."""
    from .cache_table import format_inspect

    click.echo(format_inspect(_config_from(preset, recipe, hf)))


@main.command()
def presets():
    """List the built-in presets."""
    from .recipe import load_recipe, preset_names

    for name in preset_names():
        c = load_recipe(name).model
        click.echo(f"{name:<18} layers={c.num_hidden_layers:<3} hidden={c.hidden_size:<5} "
                   f"heads={c.num_attention_heads:<4} latent={c.latent_dim}")


def _recipe_for_export(preset, recipe, hf, precision, cache_mode, max_cache_length, layers):
    """The recipe an export uses: a preset or recipe file, or a checkpoint's config with default settings."""
    import dataclasses
    from pathlib import Path

    from .errors import ConfigError
    from .recipe import Recipe, load_recipe

    given = [x for x in (preset, recipe, hf) if x]
    if len(given) != 1:
        raise ConfigError("give exactly one of --preset, --recipe, --hf")
    if hf:
        from .config import from_hf_config

        config = from_hf_config(hf)
        result = Recipe(name=Path(hf).resolve().name, model=config, source=str(hf))
    else:
        result = load_recipe(preset or recipe)
    changes = {k: v for k, v in (("precision", precision), ("cache_mode", cache_mode),
                                 ("max_cache_length", max_cache_length)) if v is not None}
    if changes:
        result = result.replace(export=dataclasses.replace(result.export, **changes))
    if layers is not None:
        if hf:
            raise ConfigError("--layers applies to presets, not to checkpoints")
        result = result.replace(model=result.model.first_layers(layers))
    return result


@main.command()
@click.option("--preset", help="A built-in preset (random weights; see `mla-deploy presets`).")
@click.option("--recipe", type=click.Path(dir_okay=False), help="A recipe TOML file.")
@click.option("--hf", type=click.Path(), help="A Hugging Face DeepSeek-V2/V3 checkpoint folder (safetensors).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="The artifact directory to write.")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "bf16"]), help="Override [export] precision.")
@click.option("--cache-mode", type=click.Choice(["concat", "static"]), help="Override [export] cache_mode.")
@click.option("--max-cache-length", type=int, help="Override [export] max_cache_length (static capacity).")
@click.option("--layers", type=int, help="Keep only the first N decoder layers (presets only).")
@click.option("--overwrite", is_flag=True, help="Replace --out even if it holds a different model.")
@click.option("--validate", "run_validation", is_flag=True, help="Validate against PyTorch right after exporting.")
@click.option("--dump-recipe", is_flag=True, help="Print the resolved recipe as JSON and exit.")
@click.option("--block", type=click.Choice(["decoder", "mha", "latent-cross-attention"]), default="decoder",
              show_default=True, help="Export the whole decoder, or one comparison block sized like the preset: "
                                      "textbook MHA (K/V cache as I/O) or Perceiver-style latent cross-attention.")
@_one_line_errors
def export(preset, recipe, hf, out, precision, cache_mode, max_cache_length, layers, overwrite, run_validation,
           dump_recipe, block):
    """Export the absorbed model to ONNX (prefill + decode graphs) with the latent cache as explicit I/O."""
    import json
    import time

    resolved = _recipe_for_export(preset, recipe, hf, precision, cache_mode, max_cache_length, layers)
    if dump_recipe:
        click.echo(json.dumps(resolved.to_dict(), indent=2))
        return
    if block != "decoder":
        from .exporter.blocks import export_block

        manifest = export_block(block, resolved.model, out, overwrite=overwrite)
        click.echo(f"exported the {block} block sized like {resolved.name} to {out}/{manifest['file']}")
        return
    from .exporter import export_recipe

    model = weights = None
    if hf:
        from pathlib import Path

        from .artifact import WeightsSource
        from .checkpoint import load_checkpoint

        model = load_checkpoint(hf, form="CC", dtype="float32")
        weights = WeightsSource(kind="hf", path=str(Path(hf).resolve()))
    start = time.perf_counter()
    manifest = export_recipe(resolved, out, model=model, weights=weights, overwrite=overwrite)
    export_s = time.perf_counter() - start
    click.echo(f"exported {manifest.name} to {out} in {export_s:.1f} s: {manifest.precision}, "
               f"{manifest.layout.mode} cache, opset {manifest.opset}, "
               f"latent {manifest.config.latent_dim} per token per layer")
    for role, graph in manifest.graphs.items():
        click.echo(f"  {role:<7} {graph.file:<13} form {graph.form:<7} {graph.bytes / 1e6:.2f} MB")
    if run_validation:
        from .validate import validate_artifact

        result = validate_artifact(out)
        click.echo(result.summary())
        result.raise_for_failure()


def _parse_ids(values) -> list[list[int]]:
    from .errors import InputError

    prompts = []
    for value in values:
        try:
            prompts.append([int(x) for x in value.replace(" ", "").split(",") if x != ""])
        except ValueError:
            raise InputError(f"--prompt-ids takes comma-separated integers, got {value!r}") from None
    return prompts


@main.command()
@click.argument("artifact", type=click.Path())
@click.option("--prompt-ids", "prompt_ids", multiple=True, required=True,
              help="Comma-separated token ids of one prompt; repeat for a batch.")
@click.option("--max-new-tokens", default=32, show_default=True, type=int)
@click.option("--provider", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="ONNX Runtime execution provider.")
@click.option("--threads", type=int, help="ONNX Runtime intra-op threads.")
@_one_line_errors
def run(artifact, prompt_ids, max_new_tokens, provider, threads):
    """Generate greedily from an exported artifact with ONNX Runtime."""
    from .engines.ort_engine import OrtEngine

    engine = OrtEngine(artifact, provider=provider, threads=threads)
    result = engine.generate(_parse_ids(prompt_ids), max_new_tokens)
    for i, tokens in enumerate(result.tokens):
        click.echo(f"sequence {i}: {','.join(map(str, tokens))}")
    info = engine.info()
    click.echo(f"provider {result.provider}; {info['precision']}, {info['cache_mode']} cache; batch "
               f"{len(result.tokens)}; prefill {result.prefill_seconds * 1e3:.1f} ms; decode "
               f"{result.tokens_per_second:.1f} tokens/s ({result.decode_steps} steps)")


@main.command()
@click.argument("artifact_dir", type=click.Path())
@click.option("--steps", type=click.IntRange(min=0), help="Decode steps after the prefill (default: the recipe's).")
@click.option("--out", type=click.Path(file_okay=False), help="Report folder (default: ARTIFACT_DIR/validation).")
@click.option("--load-results", type=click.Path(dir_okay=False),
              help="Compare a saved run_results.json again instead of running.")
@click.option("--provider", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="ONNX Runtime execution provider.")
@click.option("--threads", type=int, help="ONNX Runtime intra-op threads.")
@click.option("--trt", "with_trt", is_flag=True, help="Also validate a TensorRT engine (needs mla_deploy.trt).")
@_one_line_errors
def validate(artifact_dir, steps, out, load_results, provider, threads, with_trt):
    """Validate an exported artifact against its PyTorch original with Polygraphy; write report.{json,html,md}.

    Exit status 0 when every output is within the recipe's tolerance at every step, 1 otherwise."""
    from .validate import validate_artifact

    runtimes = ("onnxrt", "tensorrt") if with_trt else ("onnxrt",)
    result = validate_artifact(artifact_dir, out_dir=out, steps=steps, load_results=load_results,
                               runtimes=runtimes, provider=provider, threads=threads, raise_on_failure=True)
    click.echo(result.summary())


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
@click.option("--no-providers", is_flag=True, help="Do not try ONNX Runtime's providers with real sessions.")
def doctor(as_json, no_providers):
    """Report torch and CUDA, the ONNX Runtime providers that really load, TensorRT, Polygraphy, the GPU,
    and which commands work on this machine."""
    import json

    from .doctor import collect, format_report

    info = collect(providers=not no_providers)
    click.echo(json.dumps(info, indent=2) if as_json else format_report(info))


@main.command()
@click.argument("artifact_dir", type=click.Path())
@click.option("--workspace-mib", type=click.IntRange(min=1),
              help="Builder workspace limit (default: the recipe's [build] workspace_mib).")
@click.option("--strongly-typed/--weakly-typed", default=None,
              help="TensorRT 10: strongly typed, or weakly typed with the FP16/BF16 flag of the export's precision "
                   "(default). TensorRT 11 is always strongly typed.")
@click.option("--no-timing-cache", is_flag=True, help="Neither read nor write ARTIFACT_DIR/trt/timing.cache.")
@click.option("--opt-level", type=click.IntRange(0, 5), help="TensorRT builder optimisation level.")
@_one_line_errors
def build(artifact_dir, workspace_mib, strongly_typed, no_timing_cache, opt_level):
    """Build TensorRT engines for an exported artifact: ARTIFACT_DIR/trt/{prefill,decode}.engine, timing.cache
    and build.json, with optimisation profiles from the recipe's [build] ranges."""
    import dataclasses

    from .trt.build import build_engines, require_tensorrt

    require_tensorrt()  # before anything else: one line naming what is missing
    settings = None
    if workspace_mib:
        from .artifact import load_manifest

        settings = dataclasses.replace(load_manifest(artifact_dir).build_settings(), workspace_mib=workspace_mib)
    record = build_engines(artifact_dir, settings, strongly_typed=strongly_typed, timing_cache=not no_timing_cache,
                           optimization_level=opt_level)
    for role, engine in record["engines"].items():
        click.echo(f"{role:<8} {artifact_dir}/trt/{engine['file']}  {engine['bytes'] / 2**20:.1f} MiB  "
                   f"built in {engine['build_seconds']:.1f} s")
    typing = "strongly typed" if record["strongly_typed"] else "weakly typed " + "+".join(record["precision_flags"])
    click.echo(f"TensorRT {record['tensorrt']} on {record['gpu']}; {record['precision']}, {typing}")


@main.command()
@click.option("--preset", help="A built-in preset (see `mla-deploy presets`).")
@click.option("--recipe", type=click.Path(dir_okay=False), help="A recipe TOML file.")
@click.option("--layers", default="2", show_default=True,
              help="Attention layers in the benched unit (the decode step of N attention blocks).")
@click.option("--context", default="1024,4096,16384", show_default=True, help="Cached tokens T, comma list.")
@click.option("--batch", default="1,8", show_default=True, help="Batch sizes B, comma list.")
@click.option("--threads", default="2", show_default=True, help="torch and ONNX Runtime intra-op threads.")
@click.option("--repeat", default="20", show_default=True, help="Timed calls per point and pass (at most).")
@click.option("--warmup", default="3", show_default=True, help="Untimed calls before them.")
@click.option("--passes", default="2", show_default=True,
              help="Passes; each runs every variant in its own process, odd passes in reverse order.")
@click.option("--paths", default="all", show_default=True,
              help="Comma subset of hf-eager, hf-sdpa, torch-cd, torch-absorbed, ort-concat, ort-static, trt.")
@click.option("--max-seconds", default="20", show_default=True,
              help="Time budget of one point in one pass (at least 3 timed calls are kept).")
@click.option("--seed", default="0", show_default=True, help="Seed of the weights and inputs.")
@click.option("--probe-mib", default="512", show_default=True, hidden=True, help="Read-bandwidth probe buffer.")
@click.option("--out", default="bench-results", show_default=True, type=click.Path(file_okay=False),
              help="Folder for bench.json, bench.md and bench.png.")
@_one_line_errors
def bench(preset, recipe, layers, context, batch, threads, repeat, warmup, passes, paths, max_seconds, seed,
          probe_mib, out):
    """Decode-step latency, tokens/s, cache and peak memory of MLA attention: transformers' own attention
    (naive), this project's PyTorch model (CD and absorbed), the exported graph in ONNX Runtime (concat and
    static in place) and TensorRT where available; each against the machine's measured roofline."""
    import shlex

    from .bench.driver import run_bench
    from .bench.output import format_table
    from .bench.spec import BenchSpec, parse_float, parse_int, parse_paths
    from .errors import ConfigError
    from .recipe import load_recipe

    if bool(preset) == bool(recipe):
        raise ConfigError("give exactly one of --preset, --recipe")
    config = load_recipe(preset or recipe).model
    spec = BenchSpec(config=config, layers=parse_int(layers, "--layers"), contexts=context, batches=batch,
                     threads=parse_int(threads, "--threads"), repeat=parse_int(repeat, "--repeat"),
                     warmup=parse_int(warmup, "--warmup", minimum=0), passes=parse_int(passes, "--passes"),
                     paths=parse_paths(paths), seed=parse_int(seed, "--seed", minimum=0),
                     max_seconds=parse_float(max_seconds, "--max-seconds"),
                     probe_mib=parse_int(probe_mib, "--probe-mib"), source=preset or recipe)
    params = click.get_current_context().params
    command = "mla-deploy bench " + " ".join(f"--{k.replace('_', '-')} {shlex.quote(str(v))}"
                                             for k, v in params.items() if v is not None)
    report = run_bench(spec, out, echo=lambda line: click.echo(line, err=True), command=command)
    click.echo(format_table(report))
    click.echo(f"wrote {out}/bench.json, {out}/bench.md, {out}/bench.png")


if __name__ == "__main__":  # pragma: no cover
    main()
