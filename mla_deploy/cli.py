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


if __name__ == "__main__":  # pragma: no cover
    main()
