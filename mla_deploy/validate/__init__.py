"""Validation of exported artifacts against the PyTorch original, with Polygraphy, and accuracy reports.

Main entry points (imported lazily: Polygraphy, torch and onnxruntime load on first use)::

    from mla_deploy.validate import validate_artifact
    result = validate_artifact("out/tiny", steps=8)      # -> ValidationResult
    validate_artifact("out/tiny", options=ValidateOptions(write_reports=False, tolerance=Tolerance(1e-4, 1e-3)))
    # ValidateOptions: tolerance (mla_deploy.recipe.Tolerance), check_error_stat, prompt_lengths, write_reports, ...
    result.passed, result.worst, result.files["report.html"]
    result.raise_for_failure()                             # AccuracyError naming the worst output and step

* :mod:`.trajectory`: the prefill + teacher-forced decode trajectory as Polygraphy feed dicts.
* :mod:`.runners`: stateful Polygraphy runners (PyTorch reference, ONNX Runtime, optional TensorRT), over the
  engines of :mod:`mla_deploy.engines`.
* :mod:`.compat`: Polygraphy 0.49 - 0.53 differences.
* :mod:`.metrics`, :mod:`.report`, :mod:`.report_html`: figures and the report files.
* :mod:`.quantization`: quantized weights: the graphs against a reference with the same dequantized weights,
  and the quantization's cost (the artifact as deployed against the unquantized original) against thresholds.
* :func:`check_artifact` (from :mod:`mla_deploy.artifact`): artifact integrity, usable by any command.
"""

from __future__ import annotations

from ..lazy import lazy_getattr

_LAZY = {
    "validate_artifact": "mla_deploy.validate.core",
    "ValidationResult": "mla_deploy.validate.core",
    "ValidateOptions": "mla_deploy.validate.core",
    "check_artifact": "mla_deploy.artifact",
    "Trajectory": "mla_deploy.validate.trajectory",
    "TrajectoryLoader": "mla_deploy.validate.trajectory",
    "make_trajectory": "mla_deploy.validate.trajectory",
    "TorchRunner": "mla_deploy.validate.runners",
    "OrtRunner": "mla_deploy.validate.runners",
    "EngineRunner": "mla_deploy.validate.runners",
    "trt_runner": "mla_deploy.validate.runners",
    "load_reference_model": "mla_deploy.validate.reference",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
