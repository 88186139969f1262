"""``mla-deploy export``: a preset, recipe or checkpoint -> an artifact (or an onnxruntime-genai folder, or one
comparison block)."""

from __future__ import annotations

import sys

import click

from ..bench.options import Int
from .output import log_line, progress_line, report_validation, size_text


def _recipe_for_export(preset, recipe, hf, precision, cache_mode, max_cache_length, layers, weights=None,
                       block_size=None, quant_format=None):
    """The recipe an export uses: a preset or recipe file, or a checkpoint's config with default settings."""
    import dataclasses
    from pathlib import Path

    from ..errors import ConfigError
    from ..recipe import Recipe, load_recipe

    given = [x for x in (preset, recipe, hf) if x]
    if len(given) != 1:
        raise ConfigError("give exactly one of --preset, --recipe, --hf")
    if hf:
        from ..config import from_hf_config

        config = from_hf_config(hf)
        result = Recipe(name=Path(hf).resolve().name, model=config, source=str(hf))
    else:
        result = load_recipe(preset or recipe)
    changes = {k: v for k, v in (("precision", precision), ("cache_mode", cache_mode),
                                 ("max_cache_length", max_cache_length), ("weights", weights),
                                 ("block_size", block_size), ("quant_format", quant_format)) if v is not None}
    for flag, given in (("--block-size", block_size), ("--quant-format", quant_format)):
        if given is not None and (weights or result.export.weights) == "float":
            raise ConfigError(f"{flag} needs --weights int8 or int4")
    if changes:
        result = result.replace(export=dataclasses.replace(result.export, **changes))
    if layers is not None:
        if hf:
            raise ConfigError("--layers applies to presets, not to checkpoints")
        result = result.replace(model=result.model.first_layers(layers))
    return result


@click.command()
@click.option("--preset", metavar="NAME", help="A built-in preset (random weights; see `mla-deploy presets`).")
@click.option("--recipe", type=click.Path(dir_okay=False), help="A recipe TOML file.")
@click.option("--hf", type=click.Path(), help="A Hugging Face DeepSeek-V2/V3 checkpoint folder (safetensors).")
@click.option("--out", type=click.Path(file_okay=False), help="The artifact directory to write (required unless "
                                                               "--dump-recipe).")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "bf16"]), help="Override [export] precision.")
@click.option("--cache-mode", type=click.Choice(["concat", "static"]), help="Override [export] cache_mode.")
@click.option("--max-cache-length", type=Int(), help="Override [export] max_cache_length (static capacity).")
@click.option("--layers", type=Int(), help="Keep only the first N decoder layers (presets only).")
@click.option("--weights", type=click.Choice(["float", "int8", "int4"]),
              help="Override [export] weights: int8/int4 quantize the projections, MLPs, experts and lm_head "
                   "(weight-only, a symmetric scale per block of input features); float (default) quantizes nothing.")
@click.option("--block-size", type=click.Choice(["32", "64", "128"]),
              help="Input features per scale of --weights int8/int4 (default 32).")
@click.option("--quant-format", type=click.Choice(["matmulnbits", "qdq"]),
              help="How --weights int8/int4 are written: matmulnbits (default; ONNX Runtime's MatMulNBits, loads in "
                   "1.4x the weights' bytes) or qdq (standard DequantizeLinear -> MatMul, for TensorRT).")
@click.option("--overwrite", is_flag=True, help="Replace --out even if it holds a different model.")
@click.option("--validate", "run_validation", is_flag=True, help="Validate against PyTorch right after exporting.")
@click.option("--dump-recipe", is_flag=True, help="Print the resolved recipe as JSON and exit.")
@click.option("--block", type=click.Choice(["decoder", "mha", "latent-cross-attention"]), default="decoder",
              show_default=True, help="Export the whole decoder, or one comparison block sized like the preset: "
                                      "textbook MHA (K/V cache as I/O) or Perceiver-style latent cross-attention.")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines (they are shown on a terminal only).")
@click.option("--progress", "force_progress", is_flag=True, help="Progress lines on stderr even when it is no "
                                                                 "terminal.")
@click.option("--target", type=click.Choice(["artifact", "genai"]), default="artifact", show_default=True,
              help="artifact: the mla-deploy artifact; genai: a folder onnxruntime-genai loads (needs --hf; "
                   "--max-cache-length is its context length).")
def export(preset, recipe, hf, out, precision, cache_mode, max_cache_length, layers, weights, block_size,
           quant_format, overwrite, run_validation, dump_recipe, block, quiet, force_progress, target):
    """Export the absorbed model to ONNX (prefill + decode graphs) with the latent cache as explicit I/O."""
    import json
    import time

    from ..errors import ConfigError

    resolved = _recipe_for_export(preset, recipe, hf, precision, cache_mode, max_cache_length, layers, weights,
                                  None if block_size is None else int(block_size), quant_format)
    if dump_recipe:
        click.echo(json.dumps(resolved.to_dict(), indent=2))
        return
    if out is None:
        raise ConfigError("export needs --out DIR (the artifact directory to write)")
    if target == "genai":
        _export_genai(resolved, hf, out, overwrite, cache_mode, block, run_validation, quiet, force_progress)
        return
    if block == "decoder":  # before the heavy imports: a bad --out fails at once
        from ..artifact.target import check_export_target, probe_writable

        check_export_target(out, overwrite=overwrite)
        probe_writable(out)
    if block != "decoder":
        from ..exporter.blocks import export_block

        manifest = export_block(block, resolved.model, out, overwrite=overwrite)
        click.echo(f"exported the {block} block sized like {resolved.name} to {out}/{manifest['file']}")
        return
    from ..exporter import export_recipe

    source = weights = None
    if hf:
        from ..checkpoint import CheckpointTensors

        source = CheckpointTensors(hf)  # read one tensor at a time while the weights are written
        weights = source.weights_source()
    show = force_progress or (not quiet and sys.stderr.isatty())
    start = time.perf_counter()
    manifest = export_recipe(resolved, out, weights=weights, overwrite=overwrite, source=source,
                             progress=progress_line("weights") if show else None,
                             log=log_line(start) if show else None)
    export_s = time.perf_counter() - start
    click.echo(f"exported {manifest.name} to {out} in {export_s:.1f} s: {manifest.precision}, "
               f"{manifest.layout.mode} cache, opset {manifest.opset}, "
               f"latent {manifest.config.latent_dim} per token per layer")
    shown, total = set(), 0
    for role, graph in manifest.graphs.items():
        roles = [r for r, g in manifest.graphs.items() if g.file == graph.file]
        if graph.file not in shown:
            shown.add(graph.file)
            total += graph.bytes
            click.echo(f"  {'+'.join(roles):<14} {graph.file:<13} form {graph.form:<7} {size_text(graph.bytes)}")
    if manifest.weights_data is not None:
        total += manifest.weights_data["bytes"]
        click.echo(f"  {'weights':<14} {manifest.weights_data['file']:<13} {'':<12} "
                   f"{size_text(manifest.weights_data['bytes'])} (shared by the graphs)")
    else:
        click.echo(f"  {'weights':<14} {'':<13} {'':<12} inside the graph file(s)")
    if manifest.tokenizer is not None:
        total += sum(f["bytes"] for f in manifest.tokenizer.files)
        click.echo(f"  {'tokenizer':<14} {', '.join(manifest.tokenizer.names)}")
    click.echo(f"  {'total':<14} {'':<13} {'':<12} {size_text(total)}")
    if run_validation:
        from ..validate import validate_artifact

        report_validation(validate_artifact(out))


def _export_genai(resolved, hf, out, overwrite, cache_mode, block, run_validation, quiet, force_progress):
    """``export --target genai``: the onnxruntime-genai folder of a checkpoint (:mod:`mla_deploy.exporter.genai`)."""
    import time

    from ..errors import ConfigError

    if not hf:
        raise ConfigError("--target genai exports a checkpoint: give --hf CHECKPOINT")
    if cache_mode or block != "decoder" or run_validation:
        raise ConfigError("--target genai takes neither --cache-mode, --block nor --validate (genai holds the "
                          "cache in its own layout)")
    from ..artifact.target import probe_writable
    from ..checkpoint import CheckpointTensors
    from ..exporter.genai import check_genai_target, export_genai

    check_genai_target(out, overwrite)  # before reading the checkpoint: a bad --out fails at once
    probe_writable(out)
    show = force_progress or (not quiet and sys.stderr.isatty())
    start = time.perf_counter()
    config = export_genai(resolved, out, CheckpointTensors(hf), hf, overwrite=overwrite,
                          progress=progress_line("weights") if show else None, log=log_line(start) if show else None)
    decoder = config["model"]["decoder"]
    click.echo(f"exported {resolved.name} for onnxruntime-genai to {out} in {time.perf_counter() - start:.1f} s: "
               f"{resolved.export.precision}, context length {config['model']['context_length']}, latent "
               f"{resolved.model.latent_dim} per token per layer as key/value halves of {decoder['head_size']}")
    from pathlib import Path

    from ..exporter.genai import GENAI_FILES

    for name in GENAI_FILES:
        if (Path(out) / name).is_file():
            click.echo(f"  {name:<22} {size_text((Path(out) / name).stat().st_size)}")
