"""``mla-deploy inspect`` and ``mla-deploy presets``: a model's dimensions and cache sizes; the built-in presets."""

from __future__ import annotations

import click


def _config_from(preset: str | None, recipe: str | None, hf: str | None):
    from ..config import from_hf_config
    from ..errors import ConfigError
    from ..recipe import load_recipe

    given = [x for x in (preset, recipe, hf) if x]
    if len(given) != 1:
        raise ConfigError("give exactly one of --preset, --recipe, --hf")
    if hf:
        return from_hf_config(hf)
    return load_recipe(preset or recipe).model



@click.command()
@click.option("--preset", metavar="NAME", help="A built-in preset (see `mla-deploy presets`).")
@click.option("--recipe", type=click.Path(dir_okay=False), help="A recipe TOML file.")
@click.option("--hf", type=click.Path(), help="A Hugging Face checkpoint folder or config.json.")
def inspect(preset, recipe, hf):
    """Print a model's dimensions and its cache size per token per layer (MHA, CD, latent)."""
    from ..cache_table import format_inspect

    kind = "checkpoint" if hf else "recipe" if recipe else "preset"
    click.echo(format_inspect(_config_from(preset, recipe, hf), kind))


@click.command()
def presets():
    """List the built-in presets."""
    from ..recipe import load_recipe, preset_names

    for name in preset_names():
        c = load_recipe(name).model
        click.echo(f"{name:<18} layers={c.num_hidden_layers:<3} hidden={c.hidden_size:<5} "
                   f"heads={c.num_attention_heads:<4} latent={c.latent_dim}")
