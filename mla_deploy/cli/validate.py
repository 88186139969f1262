"""``mla-deploy validate``: an exported artifact against its PyTorch original, with Polygraphy."""

from __future__ import annotations

import click

from .groups import Progress, ProgressArgs, Runtime, RuntimeArgs
from .options import Int
from .output import report_validation


@click.command()
@click.argument("artifact_dir", type=click.Path())
@click.option("--steps", type=Int(minimum=0), help="Decode steps after the prefill (default: the recipe's).")
@click.option("--out", type=click.Path(file_okay=False), help="Report folder (default: ARTIFACT_DIR/validation).")
@click.option("--load-results", type=click.Path(dir_okay=False),
              help="Compare a saved run_results.json again instead of running.")
@RuntimeArgs()
@click.option("--trt", "with_trt", is_flag=True, help="Also validate a TensorRT engine (needs mla_deploy.trt).")
@ProgressArgs()
def validate(artifact_dir, steps, out, load_results, runtime: Runtime, with_trt, progress: Progress):
    """Validate an exported artifact against its PyTorch original with Polygraphy; write report.{json,html,md}.

    Quantized weights: the graphs against a PyTorch model with the same dequantized weights, and the quantization's
    cost (the artifact as deployed against the unquantized original), one line each.

    Exit status 0 when every output is within the recipe's tolerance at every step (and the quantization within
    its thresholds), 1 otherwise."""
    import time

    from ..validate import ValidateOptions, validate_artifact

    result = validate_artifact(artifact_dir, out_dir=out, steps=steps, load_results=load_results,
                               runtimes=("onnxrt", "tensorrt") if with_trt else ("onnxrt",),
                               provider=runtime.provider, threads=runtime.threads,
                               options=ValidateOptions(use_engine=runtime.use_engine, cuda=runtime.cuda),
                               log=progress.log(time.perf_counter()))
    report_validation(result)
