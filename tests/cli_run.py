"""Running the CLI from a test: in this process (:func:`cli`, click's ``CliRunner`` over the real ``mla-deploy``
group with its error contract, fast: no second interpreter importing torch and ONNX Runtime), or as a user does in
a real process (:func:`cli_process`, for what only a process shows: signals, native libraries' output on the
stderr file descriptor, the exit of the interpreter). Both return a ``subprocess.CompletedProcess``."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import traceback


def cli(*args, cwd=None) -> subprocess.CompletedProcess:
    """``mla-deploy ARGS`` run in this process (arguments turned into strings, in ``cwd`` if given); its exit status
    and its stdout and stderr as text. An exception that escaped the command group (which the error contract
    forbids) is appended to stderr as the interpreter would print it. Not thread-safe: one call at a time."""
    from click.testing import CliRunner

    from mla_deploy.cli import main

    argv = [str(a) for a in args]
    with contextlib.chdir(cwd) if cwd is not None else contextlib.nullcontext():
        result = CliRunner().invoke(main, argv, prog_name="mla-deploy")
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    return subprocess.CompletedProcess(["mla-deploy", *argv], result.exit_code, result.stdout, stderr)


def cli_process(*args, cwd=None) -> subprocess.CompletedProcess:
    """``mla-deploy ARGS`` in a subprocess (``python -m mla_deploy``, one thread, a bare environment); its output
    captured as text."""
    return subprocess.run([sys.executable, "-m", "mla_deploy", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONIOENCODING": "utf-8"},
                          timeout=600)


def ok(result: subprocess.CompletedProcess) -> str:
    """The standard output of a command that must have succeeded."""
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def fails(result: subprocess.CompletedProcess, message: str) -> str:
    """The one error line of a command that must have failed with exit status 1 and said ``message`` (no traceback,
    nothing else on stderr)."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert message in lines[0]
    return lines[0]
