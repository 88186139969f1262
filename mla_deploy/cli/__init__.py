"""The ``mla-deploy`` command line. Thin: options -> recipe -> a library call.

One module per command (:mod:`.export`, :mod:`.run`, :mod:`.validate`, :mod:`.build`, :mod:`.bench`,
:mod:`.presets` for ``inspect`` and ``presets``, :mod:`.doctor`, :mod:`.serve`); :mod:`.contract` holds the error contract
(:class:`~.contract.MainGroup`: every failure is one line on stderr and an exit status, README's Errors section).
Heavy modules (torch, onnx, onnxruntime, tensorrt) are imported inside the commands, so ``mla-deploy --help`` is
instant.
"""

from __future__ import annotations

import click

from .. import __version__
from . import bench, build, doctor, export, presets, run, serve, validate
from .contract import EXIT_BUG, MainGroup

__all__ = ["EXIT_BUG", "MainGroup", "main"]


@click.group(cls=MainGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mla-deploy")
def main() -> None:
    """Deploy DeepSeek-style Multi-Head Latent Attention models: absorbed rewrite, ONNX export with the latent
    cache as explicit I/O, TensorRT engines, and validation against PyTorch."""


for _command in (presets.inspect, presets.presets, export.export, run.run, validate.validate, doctor.doctor,
                 build.build, bench.bench, serve.serve):
    main.add_command(_command)
