"""What a bench run measures: the model, the benched unit, the points, the paths and the timing protocol."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ...cache_layout import CONCAT, STATIC, CacheLayout
from ...config import MLAConfig
from ...errors import InputError
from ...values import parse_int_list

#: The variants, in report order. ``hf-*``: transformers' own attention (naive: re-expands K/V from the latent
#: every step); ``torch-*``: this project's PyTorch model; ``ort-*``: the exported absorbed graph in ONNX Runtime;
#: ``trt``: the same graph as a TensorRT engine (needs tensorrt and a GPU).
PATHS = ("hf-eager", "hf-sdpa", "torch-cd", "torch-absorbed", "ort-concat", "ort-static", "trt")
NAIVE_PATHS = ("hf-eager", "hf-sdpa")
PATH_LABELS = {
    "hf-eager": "transformers DeepseekAttention, eager, DynamicCache (naive)",
    "hf-sdpa": "transformers DeepseekAttention, sdpa, DynamicCache (naive)",
    "torch-cd": "mla-deploy PyTorch, CD form (per-head K/V cache), torch.cat",
    "torch-absorbed": "mla-deploy PyTorch, absorbed A_CC (latent cache), torch.cat",
    "ort-concat": "ONNX Runtime, absorbed graph, concat cache (IO binding, preallocated present)",
    "ort-static": "ONNX Runtime, absorbed graph, static cache in place (one OrtValue bound as past and present)",
    "trt": "TensorRT engine of the absorbed static graph",
}

#: The paths that run the exported graph (:mod:`.graph`), and the cache layout of the graph each one runs.
GRAPH_LAYOUTS: dict[str, CacheLayout] = {"ort-concat": CONCAT, "ort-static": STATIC, "trt": STATIC}


def fixed_capacity(path: str) -> bool:
    """True when ``path`` holds a fixed-capacity cache (``T + static_margin`` slots per sequence, all attended)."""
    layout = GRAPH_LAYOUTS.get(path)
    return layout is not None and layout.has_capacity


def parse_paths(text: str | None) -> tuple[str, ...]:
    """``"ort-static,hf-eager"`` -> the paths in report order; ``None``/``"all"`` -> every path."""
    if text is None or str(text).strip() == "all":
        return PATHS
    wanted = [p.strip() for p in str(text).split(",") if p.strip()]
    unknown = [p for p in wanted if p not in PATHS]
    if not wanted or unknown:
        raise InputError(f"--paths takes a comma-separated subset of {', '.join(PATHS)} (or 'all'); "
                         f"got {text!r}")
    return tuple(p for p in PATHS if p in wanted)


@dataclass(frozen=True)
class BenchSpec:
    """A bench run.

    Attributes:
        config: the model's dimensions (a preset or recipe); ``layers`` of its attention are benched.
        layers: attention sub-layers in the benched unit (the decode step of ``layers`` attention blocks).
        contexts: cached tokens per sequence before the step (T).
        batches: sequences per step (B).
        threads: intra-op threads of torch and ONNX Runtime (one process per variant and pass).
        repeat: timed calls per point and pass (fewer when ``max_seconds`` runs out, at least 3).
        warmup: untimed calls before them.
        passes: passes over every variant; odd passes run the variants and points in reverse order.
        paths: the variants.
        seed: seed of the weights and inputs (every path gets the same).
        max_seconds: time budget of one point in one pass (warm-up plus timed calls).
        static_margin: static cache capacity = T + this (slots beyond the valid rows, masked).
        probe_mib: size of the read-bandwidth probe buffer.
        memory_fraction: a point runs only if its estimated memory is below this fraction of available memory.
        source: where ``config`` came from (preset name or recipe path).
    """

    config: MLAConfig
    layers: int = 2
    contexts: tuple[int, ...] = (1024, 4096, 16384)
    batches: tuple[int, ...] = (1, 8)
    threads: int = 2
    repeat: int = 20
    warmup: int = 3
    passes: int = 2
    paths: tuple[str, ...] = PATHS
    seed: int = 0
    max_seconds: float = 20.0
    static_margin: int = 64
    probe_mib: int = 512
    memory_fraction: float = 0.8
    source: str = ""

    def __post_init__(self) -> None:
        if self.config.is_sparse:
            raise InputError(f"{self.source or self.config.name}: bench attention times dense MLA sub-layers over "
                             "one latent cache each; DeepSeek Sparse Attention's indexer and its key cache are not "
                             "part of them (use `bench model`)")
        for name, minimum in (("layers", 1), ("threads", 1), ("repeat", 1), ("passes", 1), ("probe_mib", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise InputError(f"--{name} must be an integer >= {minimum}, got {value!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise InputError(f"--warmup must be an integer >= 0, got {self.warmup!r}")
        if self.static_margin < 1:
            raise InputError("the static cache margin must be >= 1 slot")
        if not self.max_seconds > 0:
            raise InputError(f"--max-seconds must be positive, got {self.max_seconds!r}")
        if not 0 < self.memory_fraction <= 1:
            raise InputError("memory_fraction must be in (0, 1]")
        object.__setattr__(self, "contexts", parse_int_list(self.contexts, "--context"))
        object.__setattr__(self, "batches", parse_int_list(self.batches, "--batch"))
        unknown = [p for p in self.paths if p not in PATHS]
        if unknown or not self.paths:
            raise InputError(f"unknown path(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(PATHS)}")
        object.__setattr__(self, "paths", tuple(p for p in PATHS if p in self.paths))

    @property
    def points(self) -> list[tuple[int, int]]:
        """``(T, B)`` pairs, smallest working set first."""
        return sorted(((t, b) for t in self.contexts for b in self.batches), key=lambda p: (p[0] * p[1], p[0]))

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "config"}
        out["config"] = self.config.to_dict()
        out["contexts"], out["batches"], out["paths"] = list(self.contexts), list(self.batches), list(self.paths)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BenchSpec":
        data = dict(data)
        data["config"] = MLAConfig.from_dict(data["config"])
        for key in ("contexts", "batches", "paths"):
            data[key] = tuple(data[key])
        return cls(**data)
