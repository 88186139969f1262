"""``mla-deploy build``: an engine for an exported artifact: TensorRT engines for the GPU (``--target tensorrt``, the
default) or the pre-built ONNX Runtime CPU engine (``--target cpu``)."""

from __future__ import annotations

import click

from ..errors import ArtifactError, InputError

@click.command()
@click.argument("artifact_dir", type=click.Path())
@click.option("--target", type=click.Choice(["tensorrt", "cpu"]), default="tensorrt", show_default=True,
              help="tensorrt: TensorRT engines in ARTIFACT_DIR/trt (a GPU); cpu: ONNX Runtime's graphs optimised once, "
                   "with their weights and pre-packed weights for mmap, and quantized products computed by "
                   "mla-deploy's own operators (compiled here with cc; see `mla-deploy doctor`), in ARTIFACT_DIR/cpu, "
                   "which run, validate and bench then open without re-optimising.")
@click.option("--workspace-mib", type=click.IntRange(min=1),
              help="Builder workspace limit (default: the recipe's [build] workspace_mib).")
@click.option("--strongly-typed/--weakly-typed", default=None,
              help="TensorRT 10: strongly typed, or weakly typed with the FP16/BF16 flag of the export's precision "
                   "(default). TensorRT 11 is always strongly typed.")
@click.option("--no-timing-cache", is_flag=True, help="Neither read nor write ARTIFACT_DIR/trt/timing.cache.")
@click.option("--opt-level", type=click.IntRange(0, 5), help="TensorRT builder optimisation level.")
def build(artifact_dir, target, workspace_mib, strongly_typed, no_timing_cache, opt_level):
    """Build engines for an exported artifact. --target tensorrt (default): one TensorRT engine per graph
    (ARTIFACT_DIR/trt/model.engine with a prefill and a decode profile, or prefill.engine and decode.engine),
    timing.cache and build.json, with optimisation profiles from the recipe's [build] ranges. --target cpu: ONNX
    Runtime's CPU engine in ARTIFACT_DIR/cpu (per graph the optimised graph, its weights and pre-packed weights;
    cpu_ops.so, mla-deploy's own operators for quantized experts and products, compiled for this CPU; and engine.json:
    the ONNX Runtime version, CPU features, source graphs and operator library it is tied to)."""
    if target == "cpu":
        given = [flag for flag, value in (("--workspace-mib", workspace_mib), ("--strongly-typed/--weakly-typed",
                 strongly_typed), ("--opt-level", opt_level), ("--no-timing-cache", no_timing_cache or None))
                 if value is not None]
        if given:
            raise InputError(f"{', '.join(given)}: options of --target tensorrt; --target cpu takes none")
        _build_cpu(artifact_dir)
        return
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


def _build_cpu(artifact_dir) -> None:
    """``--target cpu``: build, then one line per engine graph and one for what it is tied to."""
    from pathlib import Path

    from ..ort.record import CPU_ENGINE_DIR
    from ..ort.cpu_build import build_cpu_engine

    record = build_cpu_engine(artifact_dir)
    folder = Path(artifact_dir) / CPU_ENGINE_DIR
    for graph in record.graphs:
        size = ((folder / graph.engine).stat().st_size + graph.data_bytes) / 2**20
        click.echo(f"{folder / graph.engine}{f' + {graph.data}' if graph.data else ''}  {size:.1f} MiB: "
                   f"{' + '.join(graph.roles)} from {graph.source}")
    host = record.host
    click.echo(f"ONNX Runtime {host.onnxruntime} on {host.machine} ({', '.join(host.features) or 'no listed features'})"
               f"; built in {record.build_seconds:.1f} s; opened without graph optimisation; pre-packed weights "
               f"stored for {', '.join(record.prepacked) or 'no kernel (quantized weights pack at open)'}")
    if record.operators.used or record.operators.why_not:
        click.echo(f"operators: {record.operators.describe()}")
