"""``mla-deploy build``: TensorRT engines for an exported artifact."""

from __future__ import annotations

import click

from ..errors import ArtifactError


@click.command()
@click.argument("artifact_dir", type=click.Path())
@click.option("--workspace-mib", type=click.IntRange(min=1),
              help="Builder workspace limit (default: the recipe's [build] workspace_mib).")
@click.option("--strongly-typed/--weakly-typed", default=None,
              help="TensorRT 10: strongly typed, or weakly typed with the FP16/BF16 flag of the export's precision "
                   "(default). TensorRT 11 is always strongly typed.")
@click.option("--no-timing-cache", is_flag=True, help="Neither read nor write ARTIFACT_DIR/trt/timing.cache.")
@click.option("--opt-level", type=click.IntRange(0, 5), help="TensorRT builder optimisation level.")
def build(artifact_dir, workspace_mib, strongly_typed, no_timing_cache, opt_level):
    """Build TensorRT engines for an exported artifact: one engine per graph (ARTIFACT_DIR/trt/model.engine with a
    prefill and a decode profile, or prefill.engine and decode.engine), timing.cache and build.json, with
    optimisation profiles from the recipe's [build] ranges."""
    import dataclasses
    from pathlib import Path

    from ..artifact import load_manifest
    from ..trt.build import build_engines, check_buildable, require_tensorrt

    try:
        manifest = load_manifest(artifact_dir)
    except ArtifactError:
        manifest = None  # reported after the runtime, as before
    if manifest is not None:
        check_buildable(manifest, Path(artifact_dir))  # an artifact TensorRT could never parse: said first
    require_tensorrt()  # before anything else: one line naming what is missing
    settings = None
    if workspace_mib:
        settings = dataclasses.replace(load_manifest(artifact_dir).build_settings(), workspace_mib=workspace_mib)
    record = build_engines(artifact_dir, settings, strongly_typed=strongly_typed, timing_cache=not no_timing_cache,
                           optimization_level=opt_level)
    for engine in record["engines"].values():
        roles = " + ".join(f"{role} (profile {record['roles'][role]['profile']})" for role in engine["roles"])
        click.echo(f"{artifact_dir}/trt/{engine['file']}  {engine['bytes'] / 2**20:.1f} MiB  "
                   f"built in {engine['build_seconds']:.1f} s: {roles}")
    typing = "strongly typed" if record["strongly_typed"] else "weakly typed " + "+".join(record["precision_flags"])
    click.echo(f"TensorRT {record['tensorrt']} on {record['gpu']}; {record['precision']}, {typing}")
