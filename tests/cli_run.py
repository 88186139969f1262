"""Running the real CLI in a subprocess, as a user would: ``python -m mla_deploy ...`` with one thread and a bare
environment."""

from __future__ import annotations

import subprocess
import sys


def cli(*args) -> subprocess.CompletedProcess:
    """``mla-deploy ARGS`` in a subprocess (arguments turned into strings); its output captured as text."""
    return subprocess.run([sys.executable, "-m", "mla_deploy", *map(str, args)], capture_output=True, text=True,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONIOENCODING": "utf-8"},
                          timeout=600)


def ok(result: subprocess.CompletedProcess) -> str:
    """The standard output of a command that must have succeeded."""
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout
