"""``mla-deploy export``: a preset, recipe or checkpoint -> an artifact (or an onnxruntime-genai folder, or one
comparison block)."""

from __future__ import annotations

import click

from ..errors import ConfigError
from .groups import ExportOverrides, ExportSettingsArgs, ModelSource, Progress, ProgressArgs, SourceArgs
from .output import report_validation, size_text


@click.command()
@SourceArgs(preset_help="A built-in preset (random weights; see `mla-deploy presets`).",
            hf_help="A Hugging Face DeepSeek-V2/V3 checkpoint folder (safetensors).")
@click.option("--out", type=click.Path(file_okay=False), help="The artifact directory to write (required unless "
                                                               "--dump-recipe).")
@ExportSettingsArgs()
@click.option("--overwrite", is_flag=True, help="Replace --out even if it holds a different model.")
@click.option("--validate", "run_validation", is_flag=True, help="Validate against PyTorch right after exporting.")
@click.option("--dump-recipe", is_flag=True, help="Print the resolved recipe as JSON and exit.")
@click.option("--block", type=click.Choice(["decoder", "mha", "latent-cross-attention"]), default="decoder",
              show_default=True, help="Export the whole decoder, or one comparison block sized like the preset: "
                                      "textbook MHA (K/V cache as I/O) or Perceiver-style latent cross-attention.")
@ProgressArgs()
@click.option("--target", type=click.Choice(["artifact", "genai"]), default="artifact", show_default=True,
              help="artifact: the mla-deploy artifact; genai: a folder onnxruntime-genai loads (needs --hf; "
                   "--max-cache-length is its context length).")
def export(source: ModelSource, out, settings: ExportOverrides, overwrite, run_validation, dump_recipe, block,
           progress: Progress, target):
    """Export the absorbed model to ONNX (prefill + decode graphs) with the latent cache as explicit I/O."""
    recipe = settings.apply(source.recipe(), from_checkpoint=source.kind == "hf")
    _check_block_settings(block, settings)
    if not dump_recipe and recipe.export.max_cache_length:
        from ..cache_layout import cache_elements_per_token
        from ..memory import check_fits_memory

        model = recipe.model  # the export traces one sequence's cache of max_cache_length rows, in float32
        check_fits_memory(recipe.export.max_cache_length * cache_elements_per_token(model) * model.num_hidden_layers * 4,
                          f"--max-cache-length {recipe.export.max_cache_length} (one sequence's cache)")
    if dump_recipe:
        import json

        click.echo(json.dumps(recipe.to_dict(), indent=2))
        return
    if out is None:
        raise ConfigError("export needs --out DIR (the artifact directory to write)")
    if target == "genai":
        if source.kind != "hf":
            raise ConfigError("--target genai exports a checkpoint: give --hf CHECKPOINT")
        if settings.cache_mode or block != "decoder" or run_validation:
            raise ConfigError("--target genai takes neither --cache-mode, --block nor --validate (genai holds the "
                              "cache in its own layout)")
        _export_genai(recipe, source.location, out, overwrite, progress)
    elif block != "decoder":
        from ..exporter.blocks import export_block

        manifest = export_block(block, recipe.model, out, overwrite=overwrite)
        click.echo(f"exported the {block} block sized like {recipe.name} to {out}/{manifest['file']}")
    else:
        _export_artifact(recipe, source.location if source.kind == "hf" else None, out, overwrite, progress)
        if run_validation:
            from ..validate import validate_artifact

            report_validation(validate_artifact(out))


def _check_block_settings(block: str, settings: ExportOverrides) -> None:
    """A comparison block is exported from the model's sizes alone, in float: an export setting given with it would
    be ignored, so it is refused. Raises: ConfigError."""
    if block == "decoder":
        return
    given = [f"--{name.replace('_', '-')}" for name in ("weights", "block_size", "quant_format", "experts",
                                                         "precision", "cache_mode", "max_cache_length")
             if getattr(settings, name) is not None]
    if given:
        raise ConfigError(f"--block {block} exports the block in float32 from the model's sizes alone: it takes no "
                          f"{given[0]}")


def _export_artifact(recipe, checkpoint: str | None, out: str, overwrite: bool, progress: Progress) -> None:
    """The artifact of ``recipe`` in ``out`` (the weights streamed from ``checkpoint``, else random); its summary."""
    import time

    from ..artifact.target import check_export_target, probe_writable

    check_export_target(out, overwrite=overwrite)  # before the heavy imports: a bad --out fails at once
    probe_writable(out)
    from ..exporter import export_recipe

    source = weights = None
    if checkpoint:
        from ..checkpoint import CheckpointTensors

        source = CheckpointTensors(checkpoint)  # read one tensor at a time while the weights are written
        weights = source.weights_source()
    start = time.perf_counter()
    manifest = export_recipe(recipe, out, weights=weights, overwrite=overwrite, source=source,
                             progress=progress.bar("weights"), log=progress.log(start))
    click.echo(f"exported {manifest.name} to {out} in {time.perf_counter() - start:.1f} s: {manifest.precision}, "
               f"{manifest.layout.mode} cache, opset {manifest.opset}, "
               f"latent {manifest.config.latent_dim}"
               + (f" + index keys {manifest.config.index_head_dim}" if manifest.config.is_sparse else "")
               + " per token per layer")
    _print_files(manifest)


def _print_files(manifest) -> None:
    """An artifact's files: each graph file with the roles it serves, the weights, the tokenizer, the total."""
    shown, total = set(), 0
    for graph in manifest.graphs.values():
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


def _export_genai(recipe, checkpoint: str, out: str, overwrite: bool, progress: Progress) -> None:
    """``export --target genai``: the onnxruntime-genai folder of a checkpoint (:mod:`mla_deploy.exporter.genai`)."""
    import time
    from pathlib import Path

    from ..artifact.target import probe_writable
    from ..checkpoint import CheckpointTensors
    from ..exporter.genai import GENAI_FILES, check_genai_target, export_genai

    check_genai_target(out, overwrite)  # before reading the checkpoint: a bad --out fails at once
    probe_writable(out)
    start = time.perf_counter()
    config = export_genai(recipe, out, CheckpointTensors(checkpoint), checkpoint, overwrite=overwrite,
                          progress=progress.bar("weights"), log=progress.log(start))
    decoder = config["model"]["decoder"]
    click.echo(f"exported {recipe.name} for onnxruntime-genai to {out} in {time.perf_counter() - start:.1f} s: "
               f"{recipe.export.precision}, context length {config['model']['context_length']}, latent "
               f"{recipe.model.latent_dim} per token per layer as key/value halves of {decoder['head_size']}")
    for name in GENAI_FILES:
        if (Path(out) / name).is_file():
            click.echo(f"  {name:<22} {size_text((Path(out) / name).stat().st_size)}")
