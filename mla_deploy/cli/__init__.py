"""The ``mla-deploy`` command line. Thin: options -> recipe -> a library call.

One module per command (:mod:`.export`, :mod:`.run`, :mod:`.validate`, :mod:`.build`, :mod:`.bench`,
:mod:`.presets` for ``inspect`` and ``presets``, :mod:`.doctor`, :mod:`.serve`); :mod:`.contract` holds the error contract
(:class:`~.contract.MainGroup`: every failure is one line on stderr and an exit status, docs/errors.md).
Heavy modules (torch, onnx, onnxruntime, tensorrt) are imported inside the commands, so ``mla-deploy --help`` is
instant.
"""

from __future__ import annotations

import click

from .. import __version__
from . import bench, build, doctor, export, presets, run, serve, validate
from .contract import EXIT_BUG, MainGroup

__all__ = ["EXIT_BUG", "MainGroup", "entry", "main"]


@click.group(cls=MainGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mla-deploy")
def main() -> None:
    """Deploy DeepSeek-style Multi-Head Latent Attention models: absorbed rewrite, ONNX export with the latent
    cache as explicit I/O, TensorRT engines, and validation against PyTorch."""


for _command in (presets.inspect, presets.presets, export.export, run.run, validate.validate, doctor.doctor,
                 build.build, bench.bench, serve.serve):
    main.add_command(_command)


#: the commands whose decode steps stream the weights, which glibc's huge pages measurably speed up (2-3% a decode
#: step on the CPU engine); the others (export, build, validate, inspect, doctor, --help) start without re-executing
HUGE_PAGE_COMMANDS = frozenset({"run", "serve", "bench"})


def command_of(argv: list[str]) -> str | None:
    """The subcommand ``argv`` (the arguments after the program) names: its first argument that is not an option."""
    return next((a for a in argv if not a.startswith("-")), None)


def entry() -> None:
    """The ``mla-deploy`` program (its console script and ``python -m mla_deploy``): :data:`main`; for the commands
    of :data:`HUGE_PAGE_COMMANDS`, in a process whose weights glibc puts on huge pages.

    Where the system allows transparent huge pages and glibc has the ``glibc.malloc.hugetlb`` tunable, such a
    command re-executes itself once, the same command line with the tunable added to ``GLIBC_TUNABLES``
    (:mod:`mla_deploy.ort.huge_pages` says why and how much it gains); the pid, open files and signals are
    the same. A ``GLIBC_TUNABLES`` naming the tunable already (``glibc.malloc.hugetlb=0`` turns it off) is kept.
    """
    import os
    import sys

    command = getattr(sys, "orig_argv", None)
    if command_of(sys.argv[1:]) in HUGE_PAGE_COMMANDS:
        from ..ort.huge_pages import environment_with_huge_pages

        environ = environment_with_huge_pages(os.environ)
        if environ is not None and command and sys.executable:
            for stream in (sys.stdout, sys.stderr):  # None where the descriptor was closed before Python started
                if stream is not None:
                    try:
                        stream.flush()
                    except OSError:
                        pass
            try:
                os.execve(sys.executable, [sys.executable, *command[1:]], environ)
            except OSError:  # cannot re-execute (a vanished interpreter): run on, on small pages
                pass
    main()
