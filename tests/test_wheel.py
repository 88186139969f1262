"""The wheel a user installs (``pip install .``, not editable) carries the CPU operators' C source, so an installed
mla-deploy builds CPU engines with its own operators as a source checkout does.

The wheel is built from a copy of the tracked files and installed with ``--no-deps`` into a fresh virtual environment
that reuses this environment's packages (a ``.pth`` naming its site-packages: their ``.pth`` files, among them the
editable install of this checkout, are not run), so nothing is downloaded and the source tree is nowhere on the path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from mla_deploy.ort import operators

ROOT = Path(__file__).resolve().parent.parent
ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLA_DEPLOY_TEST_ARTIFACTS")}


def _run(*argv, cwd: Path) -> str:
    done = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=900,
                          env={**ENV, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A virtual environment holding mla-deploy installed from its wheel: its ``bin`` folder."""
    work = tmp_path_factory.mktemp("wheel")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    source = work / "source"
    for name in filter(None, tracked.decode().split("\0")):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", work / "dist", source,
         cwd=work)
    wheel = next((work / "dist").glob("mla_deploy-*.whl"))
    venv = work / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=work)
    site = Path(_run(venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                     cwd=work).strip())
    (site / "reuse-test-environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run(sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "--no-deps", "--no-index", "-q",
         wheel, cwd=work)
    return venv / "bin"


def test_the_wheel_holds_the_operator_source_and_nothing_of_the_laboratory(installed):
    where = _run(installed / "python", "-c", "import mla_deploy, mla_deploy.ort.operators as o; "
                 "print(mla_deploy.__file__); print(o.source_path()); print(o.source_path().is_file())",
                 cwd=installed).split()
    package, source, exists = where[-3:]
    assert Path(package).is_relative_to(installed.parent) and not Path(package).is_relative_to(ROOT)
    assert Path(source) == Path(package).parent / "ort" / "csrc" / "cpu_ops.c" and exists == "True"
    site = Path(package).parent.parent
    assert not (site / "benchmarks").exists() and not (site / "tests").exists()


@pytest.mark.skipif(operators.compiler() is None, reason="no C compiler (cc, gcc, clang or $CC)")
def test_an_installed_mla_deploy_builds_cpu_engines_with_its_operators(installed, tmp_path):
    from mla_deploy.ort.record import host_cpu

    cli = installed / "mla-deploy"
    _run(cli, "export", "--preset", "tiny", "--out", tmp_path / "tiny", cwd=tmp_path)
    out = _run(cli, "build", tmp_path / "tiny", "--target", "cpu", cwd=tmp_path)
    doctor = _run(cli, "doctor", "--no-providers", cwd=tmp_path)
    if operators.why_not_here(host_cpu("").features) is None:  # this CPU gets the operators' fast path
        assert "operators: mla_deploy." in out and "(cpu_ops.so" in out, out
        assert (tmp_path / "tiny" / "cpu" / operators.LIBRARY).is_file()
        assert "cpu ops      yes" in doctor, doctor
    else:  # it keeps ONNX Runtime's kernels, and says why: not for want of the source
        assert "operators: ONNX Runtime's only" in out and "is missing" not in out, out
        assert "cpu ops      no" in doctor and "is missing" not in doctor, doctor
