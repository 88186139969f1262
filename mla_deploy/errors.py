"""Typed user-facing errors.

Every failure a user can cause (a bad preset, a checkpoint that does not match its
config, a cache past its capacity, a missing runtime) raises a subclass of
:class:`MLADeployError`. The CLI prints such an error as one line and exits non-zero.
Anything else is a bug in mla-deploy and keeps its traceback.
"""


class MLADeployError(Exception):
    """Base class of every error a user can cause."""


class ConfigError(MLADeployError):
    """A model config or recipe is unknown, inconsistent, or has unknown fields."""


class ShapeError(MLADeployError):
    """A tensor handed to mla-deploy has the wrong shape, width or dtype."""


class CheckpointError(MLADeployError):
    """A checkpoint is missing, unreadable, or does not match its config."""


class ExportError(MLADeployError):
    """An export failed or its output directory cannot be used."""


class ArtifactError(MLADeployError):
    """An exported artifact (ONNX graph, manifest, engine) is missing or inconsistent."""


class CacheCapacityError(MLADeployError):
    """A request does not fit in the fixed-capacity cache."""


class RuntimeMissingError(MLADeployError):
    """A runtime (ONNX Runtime, TensorRT, a GPU) that the command needs is not available."""


class PlacementError(ArtifactError):
    """A graph holds nodes the requested device cannot run (they would fall back to the CPU)."""


class AccuracyError(MLADeployError):
    """An exported artifact does not compute what the PyTorch original computes."""


__all__ = [
    "MLADeployError",
    "ConfigError",
    "ShapeError",
    "CheckpointError",
    "ExportError",
    "ArtifactError",
    "CacheCapacityError",
    "RuntimeMissingError",
    "PlacementError",
    "AccuracyError",
]


class BusyError(MLADeployError):
    """A server's queue of waiting requests is full: the request may be sent again later."""


class InputError(MLADeployError):
    """A value handed to mla-deploy is out of range (a token id outside the vocabulary, ...)."""


__all__.append("InputError")


def name_list(names: list[str], limit: int = 4) -> str:
    """``a, b, c, d (and 3 more)``: names for a one-line error message."""
    shown = ", ".join(names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


class OutputError(MLADeployError):
    """A result cannot be written: no space left, no permission, a path whose parent is no folder."""


__all__.append("OutputError")
