"""``mla-deploy inspect`` and ``mla-deploy presets``: a model's dimensions and cache sizes; the built-in presets."""

from __future__ import annotations

import click

from .groups import ModelSource, SourceArgs


@click.command()
@SourceArgs()
def inspect(source: ModelSource):
    """Print a model's dimensions and its cache size per token per layer (MHA, CD, latent)."""
    from ..cache_table import format_inspect

    kind = {"hf": "checkpoint", "recipe": "recipe", "preset": "preset"}[source.kind]
    click.echo(format_inspect(source.config(), kind))


@click.command()
def presets():
    """List the built-in presets."""
    from ..recipe import load_recipe, preset_names

    for name in preset_names():
        c = load_recipe(name).model
        click.echo(f"{name:<18} layers={c.num_hidden_layers:<3} hidden={c.hidden_size:<5} "
                   f"heads={c.num_attention_heads:<4} latent={c.latent_dim}")
