"""``mla-deploy validate``: an exported artifact against its PyTorch original, with Polygraphy."""

from __future__ import annotations

import sys

import click

from ..bench.options import Int
from .output import log_line, report_validation


@click.command()
@click.argument("artifact_dir", type=click.Path())
@click.option("--steps", type=Int(minimum=0), help="Decode steps after the prefill (default: the recipe's).")
@click.option("--out", type=click.Path(file_okay=False), help="Report folder (default: ARTIFACT_DIR/validation).")
@click.option("--load-results", type=click.Path(dir_okay=False),
              help="Compare a saved run_results.json again instead of running.")
@click.option("--provider", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="ONNX Runtime execution provider.")
@click.option("--threads", type=Int(), help="ONNX Runtime intra-op threads.")
@click.option("--trt", "with_trt", is_flag=True, help="Also validate a TensorRT engine (needs mla_deploy.trt).")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines (they are shown on a terminal only).")
@click.option("--progress", "force_progress", is_flag=True, help="Progress lines on stderr even when it is no "
                                                                 "terminal.")
def validate(artifact_dir, steps, out, load_results, provider, threads, with_trt, quiet, force_progress):
    """Validate an exported artifact against its PyTorch original with Polygraphy; write report.{json,html,md}.

    Quantized weights: the graphs against a PyTorch model with the same dequantized weights, and the quantization's
    cost (the artifact as deployed against the unquantized original), one line each.

    Exit status 0 when every output is within the recipe's tolerance at every step (and the quantization within
    its thresholds), 1 otherwise."""
    import time

    from ..validate import validate_artifact

    runtimes = ("onnxrt", "tensorrt") if with_trt else ("onnxrt",)
    show = force_progress or (not quiet and sys.stderr.isatty())
    result = validate_artifact(artifact_dir, out_dir=out, steps=steps, load_results=load_results,
                               runtimes=runtimes, provider=provider, threads=threads,
                               log=log_line(time.perf_counter()) if show else None)
    report_validation(result)
