"""Which of ONNX Runtime's execution providers really run here. ONNX Runtime's GPU wheel lists the CUDA and TensorRT
providers even on a machine without a GPU or without their libraries, and falls back to the CPU without a word, so
each listed provider is tried: a one-node session is created with it alone and counted only if
``session.get_providers()`` still names it."""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import tempfile
from typing import Any


@contextlib.contextmanager
def _captured_output():
    """Capture Python's and the C++ libraries' stdout/stderr (file descriptors 1 and 2); yields a list that
    receives the captured text on exit."""
    text: list[str] = []
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        python = io.StringIO()
        try:
            with contextlib.redirect_stdout(python), contextlib.redirect_stderr(python):
                yield text
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            sink.seek(0)
            text.append(sink.read().decode(errors="replace") + python.getvalue())


def _reason(log: str) -> str:
    """The most telling line of a provider's failure log (a missing library, a missing GPU)."""
    for pattern in (r"with error: ([^\n\x1b]+)", r"(Failed to create \w+)", r"(Please install [^\n\x1b.]+)"):
        found = re.search(pattern, log)
        if found:
            return found.group(1).strip()
    return "fell back to CPUExecutionProvider"


def _tiny_model() -> bytes:
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def probe_providers() -> dict[str, Any]:
    """ONNX Runtime's version, its listed providers, and for each whether a session really runs on it."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        return {"version": None, "error": str(exc), "listed": [], "loaded": {}}
    model = _tiny_model()
    options = ort.SessionOptions()
    options.log_severity_level = 4
    loaded: dict[str, dict[str, Any]] = {}
    for provider in ort.get_available_providers():
        with _captured_output() as log:
            try:
                session = ort.InferenceSession(model, options, providers=[provider])
                used, error = session.get_providers(), None
            except Exception as exc:  # onnxruntime raises its own types
                used, error = [], str(exc).splitlines()[0]
        ok = bool(used) and used[0] == provider
        loaded[provider] = {"ok": ok, "reason": None if ok else (error or _reason(log[0] if log else ""))}
    return {"version": ort.__version__, "listed": ort.get_available_providers(), "loaded": loaded}


def listed_providers() -> dict[str, Any]:
    """ONNX Runtime's version and listed providers, without trying them (``loaded`` is None)."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        return {"version": None, "error": str(exc), "listed": [], "loaded": None}
    return {"version": ort.__version__, "listed": ort.get_available_providers(), "loaded": None}
