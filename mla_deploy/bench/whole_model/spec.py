"""What a whole-model bench run measures (``mla-deploy bench model``): the model's source, the points,
the timing protocol, and the token ids every path is given.

Points:

* prefill: for each batch size B, a ``prompt_length``-token prompt per sequence into an empty cache;
* decode: for each context T and batch size B, a prompt of ``max(T, 1)`` tokens per sequence fills the cache
  (transformers' ``generate`` needs at least one token), then ``warmup`` untimed and ``repeat`` timed greedy
  decode steps follow; the timed step ``i`` sees ``max(T, 1) + warmup + i`` cached rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from ...errors import ConfigError
from ...quant import FLOAT, weights_list
from ...values import parse_int, parse_int_list

#: where the model comes from: an exported artifact (benched as is), a checkpoint folder (exported first), a
#: preset or recipe file (a random checkpoint of its model written first, then exported)
SOURCES = ("artifact", "hf", "preset", "recipe")
TRANSFORMERS = "transformers"
TRANSFORMERS_LABEL = ("transformers: AutoModelForCausalLM.from_pretrained(checkpoint, dtype=float32).generate "
                      "(greedy, its own cache)")


def path_label(path: str) -> str:
    """What a path runs, for the report."""
    if path == TRANSFORMERS:
        return TRANSFORMERS_LABEL
    weights = "fp32" if path == "ours" else f"{path.removeprefix('ours-')} weights (MatMulNBits, int8 activations)"
    return (f"mla-deploy: the exported artifact ({weights}) in ONNX Runtime (OrtEngine.step: prefill, then greedy "
            f"decode steps)")
#: the salts of the two kinds of prompts, so a prefill prompt and a context are different token ids
PREFILL, CONTEXT = 1, 2


@dataclass(frozen=True)
class WholeModelSpec:
    """A whole-model bench run.

    Attributes:
        source: one of :data:`SOURCES`.
        location: the artifact folder, the checkpoint folder, the preset name or the recipe file.
        layers: presets and recipes: keep only the first N decoder layers (None: all of them).
        contexts: cached tokens T before the decode steps (0: a one-token prompt).
        batches: sequences per step B.
        prompt_length: tokens per sequence of the timed prefill.
        threads: intra-op threads of ONNX Runtime and torch (each path in its own process).
        repeat: timed prefills per batch size, timed decode steps per point.
        warmup: untimed calls before them.
        seed: seed of the prompts and of a preset's random checkpoint.
        weights: the artifacts ``ours`` runs, one per entry of :data:`mla_deploy.quant.WEIGHTS` (``--hf``, presets
            and recipes: each exported into ``OUT/artifact`` (float) or ``OUT/artifact-int8`` ...; an ``--artifact`` is benched
            as exported).
        block_size: input features per scale of the quantized ones (None: the exporter's default, 32).
        transformers: also time transformers' own model (when it can run).
        engine: run an artifact's pre-built CPU engine (``mla-deploy build ARTIFACT --target cpu``) when it has one,
            building it first for the bench's own exports (False: their source graphs).
        probe_mib: size of the read-bandwidth probe buffer.
        memory_fraction: a path or point runs only if its estimated memory is below this fraction of the
            available memory.
    """

    source: str
    location: str
    layers: int | None = None
    contexts: tuple[int, ...] = (0, 4096)
    batches: tuple[int, ...] = (1, 8)
    prompt_length: int = 512
    threads: int = 2
    repeat: int = 10
    warmup: int = 3
    seed: int = 0
    weights: tuple[str, ...] = (FLOAT.weights,)
    block_size: int | None = None
    transformers: bool = True
    engine: bool = True
    probe_mib: int = 512
    memory_fraction: float = 0.8

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ConfigError(f"the whole-model bench takes one of --{', --'.join(SOURCES)}; got {self.source!r}")
        if self.layers is not None:
            if self.source not in ("preset", "recipe"):
                raise ConfigError("--layers applies to presets and recipes, not to checkpoints or artifacts")
            object.__setattr__(self, "layers", parse_int(self.layers, "--layers"))
        object.__setattr__(self, "contexts", parse_int_list(self.contexts, "--context", minimum=0))
        object.__setattr__(self, "batches", parse_int_list(self.batches, "--batch"))
        for name, minimum in (("prompt_length", 1), ("threads", 1), ("repeat", 1), ("warmup", 0), ("seed", 0),
                              ("probe_mib", 1)):
            option = "--" + name.replace("_", "-")
            object.__setattr__(self, name, parse_int(getattr(self, name), option, minimum))
        self._check_weights()
        if not 0 < self.memory_fraction <= 1:
            raise ConfigError("memory_fraction must be in (0, 1]")

    def _check_weights(self) -> None:
        weights, block_size = weights_list(self.weights, self.block_size)
        if self.source == "artifact" and (weights != (FLOAT.weights,) or block_size is not None):
            raise ConfigError("--weights and --block-size apply to --hf, --preset and --recipe; an --artifact is "
                              "benched with the weights it was exported with")
        object.__setattr__(self, "weights", weights)
        object.__setattr__(self, "block_size", block_size)

    @property
    def decode_points(self) -> list[tuple[int, int]]:
        """``(T, B)`` pairs, smallest working set first."""
        return sorted(((t, b) for t in self.contexts for b in self.batches), key=lambda p: (p[0] * p[1], p[0], p[1]))

    @property
    def steps(self) -> int:
        """Decode steps per point (untimed and timed)."""
        return self.warmup + self.repeat

    @property
    def capacity(self) -> int:
        """Cache rows per sequence the run needs (a fixed-capacity cache is made this large)."""
        return max(max(prompt_tokens(t) for t in self.contexts) + self.steps, self.prompt_length) + 1

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["contexts"], out["batches"], out["weights"] = list(self.contexts), list(self.batches), list(self.weights)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "WholeModelSpec":
        data = dict(data)
        data["contexts"], data["batches"] = tuple(data["contexts"]), tuple(data["batches"])
        data["weights"] = tuple(data.get("weights", (FLOAT.weights,)))
        return cls(**data)


def prompt_tokens(context: int) -> int:
    """Tokens of the prompt that fills a context of ``context`` tokens (at least one)."""
    return max(context, 1)


def prompt_ids(vocab_size: int, batch: int, length: int, seed: int, kind: int) -> np.ndarray:
    """``[batch, length]`` int64 token ids, uniform over the vocabulary; the same in every process for the same
    arguments (``kind``: :data:`PREFILL` or :data:`CONTEXT`)."""
    rng = np.random.default_rng((seed, kind, batch, length))
    return rng.integers(0, vocab_size, size=(batch, length), dtype=np.int64)


def chunks(length: int, size: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of consecutive chunks of at most ``size`` covering ``0 .. length``."""
    for start in range(0, length, size):
        yield start, min(start + size, length)


def point_key(kind: str, batch: int, context: int | None = None) -> str:
    """The name of a point in job and result files: ``prefill/B8``, ``decode/T4096/B8``."""
    return f"prefill/B{batch}" if kind == "prefill" else f"decode/T{context}/B{batch}"


def points(spec: WholeModelSpec) -> list[str]:
    """Every point of a run, in the order a path runs them: the decode points, smallest working set first, then
    the prefills (the largest transients, e.g. ``[B, L, V]`` logits; a runtime's allocator keeps what a point
    grew, so the peak memory of a point includes what earlier points left resident)."""
    return [point_key("decode", b, t) for t, b in spec.decode_points] + [point_key("prefill", b) for b in spec.batches]


def parse_point(key: str) -> tuple[str, int, int | None]:
    """``(kind, batch, context)`` of a :func:`point_key`."""
    parts = key.split("/")
    if parts[0] == "prefill":
        return "prefill", int(parts[1][1:]), None
    return "decode", int(parts[2][1:]), int(parts[1][1:])
