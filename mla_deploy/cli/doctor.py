"""``mla-deploy doctor``: what works on this machine."""

from __future__ import annotations

import click


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
@click.option("--no-providers", is_flag=True, help="Do not try ONNX Runtime's providers with real sessions.")
def doctor(as_json, no_providers):
    """Report torch and CUDA, the ONNX Runtime providers that really load, TensorRT, Polygraphy, the GPU,
    and which commands work on this machine."""
    import json

    from ..doctor import collect, format_report

    info = collect(providers=not no_providers)
    click.echo(json.dumps(info, indent=2) if as_json else format_report(info))
