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
        result = result.replace(model=result.model.replace(num_hidden_layers=layers,
                                                           first_k_dense_replace=min(result.model.first_k_dense_replace, layers)))
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
@_one_line_errors
def export(preset, recipe, hf, out, precision, cache_mode, max_cache_length, layers, overwrite, run_validation,
           dump_recipe):
    """Export the absorbed model to ONNX (prefill + decode graphs) with the latent cache as explicit I/O."""
    import json
    import time

    resolved = _recipe_for_export(preset, recipe, hf, precision, cache_mode, max_cache_length, layers)
    if dump_recipe:
        click.echo(json.dumps(resolved.to_dict(), indent=2))
        return
    from .exporter import export_recipe

    model = weights = None
    if hf:
        from pathlib import Path

        from .checkpoint import load_checkpoint

        model = load_checkpoint(hf, form="CC", dtype="float32")
        weights = {"kind": "hf", "path": str(Path(hf).resolve())}
    start = time.perf_counter()
    manifest = export_recipe(resolved, out, model=model, weights=weights, overwrite=overwrite)
    export_s = time.perf_counter() - start
    settings = resolved.export
    click.echo(f"exported {resolved.name} to {out} in {export_s:.1f} s: {settings.precision}, "
               f"{settings.cache_mode} cache, opset {settings.opset}, latent {resolved.model.latent_dim} per token per layer")
    for role, graph in manifest["graphs"].items():
        click.echo(f"  {role:<7} {graph['file']:<13} form {graph['form']:<7} {graph['bytes'] / 1e6:.2f} MB")
    if run_validation:
        from .validate import validate_artifact

        result = validate_artifact(out)
        click.echo(result.summary() if hasattr(result, "summary") else str(result))


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
    from .runtime.ort_engine import OrtEngine

    engine = OrtEngine(artifact, provider=provider, threads=threads)
    result = engine.generate(_parse_ids(prompt_ids), max_new_tokens)
    for i, tokens in enumerate(result.tokens):
        click.echo(f"sequence {i}: {','.join(map(str, tokens))}")
    info = engine.info()
    click.echo(f"provider {result.provider}; {info['precision']}, {info['cache_mode']} cache; batch "
               f"{len(result.tokens)}; prefill {result.prefill_seconds * 1e3:.1f} ms; decode "
               f"{result.tokens_per_second:.1f} tokens/s ({result.decode_steps} steps)")


if __name__ == "__main__":  # pragma: no cover
    main()
