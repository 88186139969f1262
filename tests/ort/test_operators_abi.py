"""The operators reach ONNX Runtime's C API through table positions written by hand (no package ships its header):
a compiled library is run once in a child process before an engine records it (``mla_deploy/ort/probe.py``), so a
wrong position is refused in one line, whether it computes garbage or crashes, and the test process survives; a
library that needs a newer C API than the running ONNX Runtime is refused when registered."""

from __future__ import annotations

import onnxruntime as ort
import pytest

from mla_deploy.errors import ArtifactError
from mla_deploy.ort import operators

pytestmark = pytest.mark.skipif(operators.compiler() is None, reason="no C compiler (cc, gcc, clang or $CC)")


def _compiled_with(tmp_path, old: str, new: str) -> operators.Library:
    source = operators.source_path().read_text()
    assert old in source  # the planted change is a real edit of the shipped source
    planted = tmp_path / "cpu_ops.c"
    planted.write_text(source.replace(old, new))
    return operators.compile_library(tmp_path, operators.PORTABLE, source=planted)


def test_the_shipped_source_passes_its_check(tmp_path):
    library = operators.compile_library(tmp_path, operators.PORTABLE)
    assert library.path is not None and library.why_not is None
    assert operators.check_library(library.path) is None


@pytest.mark.parametrize("old,new,how", [
    ("API_GetDimensions = 62", "API_GetDimensions = 63", "failed: "),  # another entry: wrong shapes, an error
    ("API_CreateOp = 213", "API_CreateOp = 212", "crashed (SIGSEGV)"),  # another entry's signature: a crash
], ids=["wrong-result", "crash"])
def test_a_wrong_table_position_is_refused_in_one_line(tmp_path, old, new, how):
    library = _compiled_with(tmp_path, old, new)
    assert library.path is None and not (tmp_path / operators.LIBRARY).exists()
    assert "\n" not in library.why_not and how in library.why_not, library.why_not
    assert "C API table positions in cpu_ops.c do not match" in library.why_not


def test_a_library_for_a_newer_c_api_is_refused_when_registered(tmp_path):
    current = operators.api_version(ort.__version__)
    assert current >= 17 and operators.api_version("1.31.1") == 31 and operators.api_version("garbage") == 0
    library = _compiled_with(tmp_path, "#define API_VERSION 17", f"#define API_VERSION {current + 1}")
    assert library.path is None
    assert f"needs ONNX Runtime's C API version {current + 1} or newer; ONNX Runtime {ort.__version__} has {current}" \
        in library.why_not, library.why_not


def test_a_foreign_library_is_refused_when_registered(tmp_path):
    (tmp_path / "foreign.so").write_bytes(b"not a library")
    with pytest.raises(ArtifactError, match="not an mla-deploy operator library"):
        operators.register(ort.SessionOptions(), tmp_path / "foreign.so")
