"""Recipes: the declarative TOML files under ``export/``, one per model preset.

A recipe's ``[model]`` table holds an :class:`~mla_deploy.config.MLAConfig` (with a nested
``[model.rope_scaling]`` table for YaRN). Every key is checked: an unknown section or field
is a :class:`~mla_deploy.errors.ConfigError`, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import MLAConfig
from .errors import ConfigError
from . import expert_forms
from .quant import DEFAULT_BLOCK_SIZE, DEFAULT_FORMAT, FLOAT, Quantization, plan

if TYPE_CHECKING:
    from .cache_layout import CacheLayout

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SECTIONS = ("model", "export", "build", "validate")
#: the smallest ``[export] max_cache_length`` (a prompt token and one generated token); the CLI's bound too
MIN_CACHE_LENGTH = 2
#: the attention forms an exported graph can hold, by role (the original CD form is for PyTorch only)
GRAPH_FORMS = {"prefill": ("CC", "A_CC", "A_CC_ME"), "decode": ("A_CC", "A_CC_ME")}


def _check_keys(section: str, data: dict, cls, source: str) -> None:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{source} [{section}]: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")


@dataclass(frozen=True)
class ExportSettings:
    """``[export]``: how the ONNX graphs are made.

    Attributes:
        precision: ``fp32``, ``fp16`` or ``bf16``; the ONNX carries this dtype (TensorRT 11 reads precision from it).
        cache_mode: ``static`` (the default: a fixed capacity written in place, what every command takes: ``serve``,
            ``build --target cpu``, the CUDA provider's in-place binding and TensorRT's aliased I/O) or ``concat``
            (a cache that grows by each step, copied by each step).
        max_cache_length: capacity of the static cache (tokens per sequence, prompt included). A runtime allocates
            only the rows a request needs, up to it, so a large capacity costs nothing until it is used.
        prefill_form: attention form of the prefill graph. The same as ``decode_form`` (the default, ``A_CC``):
            prefill and decode are one graph, ``model.onnx``, whose weights a runtime holds once. ``CC``
            (re-expands K/V, fewer FLOPs for long prompts) makes a second graph, ``prefill.onnx``, over the same
            weights file; ONNX Runtime then holds two sessions.
        decode_form: attention form of the decode graph (``A_CC`` or ``A_CC_ME``).
        opset: ONNX opset (>= the layout's ``min_opset``: 18, or 24 for the static cache's ``TensorScatter``).
        external_data_threshold: graphs whose weights exceed this many bytes keep them in a side file.
        seed: seed of the random weights of a preset export (checkpoint exports use the checkpoint's).
        init_std: standard deviation of those random weights.
        decode_attention: ``standard`` (ONNX ops) or ``plugin``: the decode graph's attention becomes one
            ``mla_deploy::MlaDecode`` node for the TensorRT plugin of ``plugins/mla_decode`` (static cache only;
            ONNX Runtime cannot run such a graph).
        weights: ``float`` (the weights in ``precision``), or ``int8``/``int4``: weight-only quantization with a
            symmetric scale per block of input features (:mod:`mla_deploy.quant`).
        block_size: input features per scale of quantized weights (32, 64 or 128).
        quant_format: how quantized weights are written: ``matmulnbits`` (ONNX Runtime's ``com.microsoft``
            ``MatMulNBits``: loads in 1.4x the weights' bytes) or ``qdq`` (standard ``DequantizeLinear -> MatMul``,
            which TensorRT reads; ONNX Runtime fuses it at load in 2.2-2.8x). See :mod:`mla_deploy.quant.formats`.
        These three are read through :attr:`quantization`.
        experts: the routed experts' graph form (:mod:`mla_deploy.expert_forms`): ``fused`` (one ONNX Runtime
            ``MoE``/``QMoE`` operator per MoE layer; ONNX Runtime only; fp32 in the CPU layout, fp16/bf16 in the
            CUDA one), ``branches`` (one branch of standard ops per expert; TensorRT builds it) or ``auto`` (the
            default: fused unless ``decode_attention = "plugin"``, quantized weights are in the ``qdq`` format or
            ``QMoE`` cannot hold the quantized experts). Read through :meth:`expert_form`.
    """

    precision: str = "fp32"
    cache_mode: str = "static"
    max_cache_length: int = 4096
    prefill_form: str = "A_CC"
    decode_form: str = "A_CC"
    opset: int = 24
    external_data_threshold: int = 64 << 20
    seed: int = 0
    init_std: float = 0.02
    decode_attention: str = "standard"
    weights: str = FLOAT.weights
    block_size: int = DEFAULT_BLOCK_SIZE
    quant_format: str = DEFAULT_FORMAT.name
    experts: str = expert_forms.DEFAULT

    def __post_init__(self) -> None:
        from .cache_layout import CACHE_MODES, get_layout
        from .io_spec import PRECISIONS

        if self.precision not in PRECISIONS:
            raise ConfigError(f"[export] precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.cache_mode not in CACHE_MODES:
            raise ConfigError(f"[export] cache_mode must be one of {', '.join(CACHE_MODES)}, got {self.cache_mode!r}")
        layout = get_layout(self.cache_mode)
        if self.max_cache_length < MIN_CACHE_LENGTH:
            raise ConfigError(f"[export] max_cache_length must be at least {MIN_CACHE_LENGTH}")
        for role, form in (("prefill", self.prefill_form), ("decode", self.decode_form)):
            if form not in GRAPH_FORMS[role]:
                raise ConfigError(f"[export] {role}_form must be {', '.join(GRAPH_FORMS[role][:-1])} or "
                                  f"{GRAPH_FORMS[role][-1]}, got {form!r}")
        if not self.init_std > 0:
            raise ConfigError("[export] init_std must be positive")
        if self.opset < layout.min_opset:
            raise ConfigError(f"[export] opset {self.opset} is too old (the {layout.mode} cache needs >= "
                              f"{layout.min_opset})")
        if self.decode_attention not in ("standard", "plugin"):
            raise ConfigError(f"[export] decode_attention must be standard or plugin, got {self.decode_attention!r}")
        if self.decode_attention == "plugin" and not layout.supports_plugin:
            able = " or ".join(f'"{m}"' for m in CACHE_MODES if get_layout(m).supports_plugin)
            raise ConfigError(f"[export] decode_attention = \"plugin\" needs cache_mode = {able} "
                              f"(the plugin reads per-sequence valid lengths, not a padding mask)")
        self.quantization  # noqa: B018  (raises ConfigError for an unknown scheme, block size or format)
        expert_forms.check(self.experts, self.precision, "[export] experts")

    def expert_form(self, config: MLAConfig) -> str:
        """The routed experts' graph form the export of ``config`` writes, ``fused`` or ``branches``
        (:func:`mla_deploy.expert_forms.resolve` of :attr:`experts`).

        Raises:
            ConfigError: an unknown form; ``fused`` with quantization blocks that do not divide the hidden and
                expert widths (in an fp16/bf16 export, widths that are not multiples of 64 either: CUDA's ``QMoE``).
        """
        quantization = self.quantization
        widths = {"hidden_size": config.hidden_size, "moe_intermediate_size": config.moe_intermediate_size or 0}
        layout = expert_forms.fused_layout(self.precision)
        blocks = quantization.qmoe_misfit(widths, layout) if config.n_routed_experts else None
        return expert_forms.resolve(self.experts, self.precision, self.decode_attention == "plugin",
                                    quantization.tensorrt_format, blocks)

    @property
    def quantization(self) -> Quantization:
        """What the export does to the weights (:mod:`mla_deploy.quant`): :data:`~mla_deploy.quant.FLOAT` for
        ``weights = "float"``, else the scheme in :attr:`quant_format`.

        Raises:
            ConfigError: an unknown scheme or format, a block size not 32, 64 or 128 or given for float weights.
        """
        try:
            return plan(self.weights, self.block_size, self.quant_format)
        except ConfigError as exc:
            raise ConfigError(f"[export] {exc}") from None

    @property
    def layout(self) -> "CacheLayout":
        """The :class:`~mla_deploy.cache_layout.CacheLayout` of :attr:`cache_mode`."""
        from .cache_layout import get_layout

        return get_layout(self.cache_mode)


def _range(name: str, value) -> tuple[int, int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        raise ConfigError(f"[build] {name} must be [min, opt, max] integers, got {value!r}")
    lo, opt, hi = value
    if not 0 <= lo <= opt <= hi:
        raise ConfigError(f"[build] {name} needs 0 <= min <= opt <= max, got {list(value)}")
    return lo, opt, hi


@dataclass(frozen=True)
class BuildSettings:
    """``[build]``: TensorRT optimisation profiles, each as ``[min, opt, max]``.

    Attributes:
        batch: batch size range (both graphs).
        prompt_length: prefill ``sequence_length`` range.
        past_length: concat mode: ``past_sequence_length`` range of the decode graph (the prefill profile
            uses ``[0, 0, max]``); static mode uses ``[export] max_cache_length`` instead.
        workspace_mib: builder workspace limit.
    """

    batch: tuple[int, int, int] = (1, 1, 4)
    prompt_length: tuple[int, int, int] = (1, 16, 128)
    past_length: tuple[int, int, int] = (1, 128, 256)
    workspace_mib: int = 4096

    def __post_init__(self) -> None:
        for name in ("batch", "prompt_length", "past_length"):
            object.__setattr__(self, name, _range(name, getattr(self, name)))
        if self.batch[0] < 1 or self.prompt_length[0] < 1:
            raise ConfigError("[build] batch and prompt_length ranges must start at 1 or more")


@dataclass(frozen=True)
class Tolerance:
    """Absolute and relative tolerance of one precision."""

    atol: float
    rtol: float


DEFAULT_TOLERANCES = {"fp32": Tolerance(1e-4, 1e-4), "fp16": Tolerance(2e-2, 2e-2), "bf16": Tolerance(5e-2, 5e-2)}


@dataclass(frozen=True)
class QuantizationThreshold:
    """What quantized weights may cost, per scheme: the artifact as deployed (ONNX Runtime, int8 activations)
    against the unquantized original, over the logits of every real token of the validation trajectory.

    Attributes:
        min_top1: the least fraction of positions whose argmax token is the original's.
        min_mean_cosine: the least mean cosine similarity of a position's logits with the original's.
    """

    min_top1: float
    min_mean_cosine: float


#: Defaults for trained weights, from measurement: tiny DeepSeek-V2 and V3 MoE checkpoints trained briefly on a
#: learnable task and written by transformers (``tests/hf_oracle.py`` ``trained_model``, seeds 0-3 each), exported
#: with blocks of 32 and validated over the default trajectory (141 positions: two prompts, 64 decode steps):
#:
#: ====== ============== ========================= ============================ ==================
#: scheme top-1          mean logits cosine        worst position's cosine      max abs error
#: ====== ============== ========================= ============================ ==================
#: int8   100% (8 of 8)  0.99964 - 0.99997         0.979 - 0.9999               1-13% of max|logit|
#: int4   100% (8 of 8)  0.99068 - 0.99554         0.910 - 0.980                13-23% of max|logit|
#: ====== ============== ========================= ============================ ==================
#:
#: Their top token leads the next by 3.5 or more at every position, so top-1 agreement shows that no error reaches
#: such a margin. ``min_mean_cosine`` allows about 3x the worst measured cost ``1 - mean cosine`` (int8: 3.6e-4 ->
#: 1e-3; int4: 9.3e-3 -> 3e-2), and int4's figures fail int8's bound. ``min_top1``: int8 the 99% asked of it, int4
#: 97% (its logit error is about twice int8's). Random weights have near-tied logits (top-1 flips on any change):
#: the presets' recipes set their own thresholds (``export/*.toml``).
DEFAULT_QUANTIZATION_THRESHOLDS = {"int8": QuantizationThreshold(0.99, 0.999),
                                   "int4": QuantizationThreshold(0.97, 0.97)}


@dataclass(frozen=True)
class ValidateSettings:
    """``[validate]``: the validation trajectory and tolerances.

    Attributes:
        batch: batch size of the trajectory.
        prompt_length: prefill length.
        decode_steps: teacher-forced decode steps after the prefill.
        seed: seed of the random prompt ids.
        tolerance: per precision (``[validate.tolerance.fp32] atol = ..., rtol = ...``).
        quantization_steps: a quantized artifact's trajectory has at least this many decode steps (fewer only
            where a static cache holds no more).
        quantization: per weight scheme, what quantization may cost (``[validate.quantization.int8] min_top1 =
            ..., min_mean_cosine = ...``; :class:`QuantizationThreshold`).
    """

    batch: int = 2
    prompt_length: int = 7
    decode_steps: int = 8
    seed: int = 0
    tolerance: dict = field(default_factory=lambda: dict(DEFAULT_TOLERANCES))
    quantization_steps: int = 64
    quantization: dict = field(default_factory=lambda: dict(DEFAULT_QUANTIZATION_THRESHOLDS))

    def __post_init__(self) -> None:
        if self.batch < 1 or self.prompt_length < 1 or self.decode_steps < 0:
            raise ConfigError("[validate] batch and prompt_length must be >= 1, decode_steps >= 0")
        if self.quantization_steps < 0:
            raise ConfigError("[validate] quantization_steps must be >= 0")
        object.__setattr__(self, "quantization", _thresholds(self.quantization))
        merged = dict(DEFAULT_TOLERANCES)
        for key, value in dict(self.tolerance).items():
            if key not in DEFAULT_TOLERANCES:
                raise ConfigError(f"[validate.tolerance] unknown precision {key!r}")
            if isinstance(value, Tolerance):
                merged[key] = value
                continue
            if not isinstance(value, dict) or set(value) - {"atol", "rtol"}:
                raise ConfigError(f"[validate.tolerance.{key}] takes atol and rtol only")
            merged[key] = Tolerance(float(value.get("atol", merged[key].atol)), float(value.get("rtol", merged[key].rtol)))
        object.__setattr__(self, "tolerance", merged)


def _thresholds(table) -> dict:
    """``[validate.quantization.*]`` over the defaults: ``{scheme: QuantizationThreshold}``."""
    merged = dict(DEFAULT_QUANTIZATION_THRESHOLDS)
    for key, value in dict(table).items():
        if key not in DEFAULT_QUANTIZATION_THRESHOLDS:
            raise ConfigError(f"[validate.quantization] unknown weight scheme {key!r}; known: "
                              f"{', '.join(DEFAULT_QUANTIZATION_THRESHOLDS)}")
        if isinstance(value, QuantizationThreshold):
            merged[key] = value
            continue
        known = {f.name for f in fields(QuantizationThreshold)}
        if not isinstance(value, dict) or set(value) - known:
            raise ConfigError(f"[validate.quantization.{key}] takes {' and '.join(sorted(known))} only")
        try:
            merged[key] = dataclasses.replace(merged[key], **{k: float(v) for k, v in value.items()})
        except (TypeError, ValueError):
            raise ConfigError(f"[validate.quantization.{key}] values must be numbers, got {value!r}") from None
        if not all(0 <= getattr(merged[key], k) <= 1 for k in known):
            raise ConfigError(f"[validate.quantization.{key}] values must lie in [0, 1], got {value!r}")
    return merged


@dataclass(frozen=True)
class Recipe:
    """A resolved recipe.

    Attributes:
        name: the preset name (the file's stem).
        model: the model's dimensions.
        source: the file the recipe was read from.
        export: ``[export]`` settings.
        build: ``[build]`` TensorRT profiles.
        validate: ``[validate]`` trajectory and tolerances.
    """

    name: str
    model: MLAConfig
    source: str
    export: ExportSettings = field(default_factory=ExportSettings)
    build: BuildSettings = field(default_factory=BuildSettings)
    validate: ValidateSettings = field(default_factory=ValidateSettings)

    def to_dict(self) -> dict[str, Any]:
        """The recipe as plain data (for manifests and ``--dump-recipe``)."""
        validate = asdict(self.validate)
        return {"name": self.name, "source": self.source, "model": self.model.to_dict(),
                "export": asdict(self.export), "build": asdict(self.build), "validate": validate}

    def replace(self, **changes: Any) -> "Recipe":
        """A copy with whole sections replaced."""
        return dataclasses.replace(self, **changes)


def presets_dir() -> Path:
    """The folder holding the built-in recipes (``export/`` of the source tree, packaged as ``mla_deploy._presets``).

    A source checkout's own ``export/`` comes first: an editable install maps ``mla_deploy._presets`` to the
    checkout it was installed from, which is not this package's when it is imported from another worktree.
    """
    tree = Path(__file__).resolve().parent.parent
    if (tree / "pyproject.toml").is_file() and any((tree / "export").glob("*.toml")):
        return tree / "export"
    try:
        from importlib.resources import files

        packaged = Path(str(files("mla_deploy._presets")))
        if packaged.is_dir() and any(packaged.glob("*.toml")):
            return packaged
    except (ModuleNotFoundError, TypeError):
        pass
    return Path(__file__).resolve().parent.parent / "export"


def preset_names() -> list[str]:
    """Names of the built-in presets, sorted."""
    return sorted(p.stem for p in presets_dir().glob("*.toml"))


def load_recipe(name_or_path: str | Path) -> Recipe:
    """Load a built-in preset by name, or a recipe file by path.

    Raises:
        ConfigError: unknown preset, unreadable TOML, unknown section or field, bad value.
    """
    path = Path(name_or_path)
    if not (path.suffix == ".toml" or path.is_file()):  # a folder named like a preset (its export) is no recipe
        path = presets_dir() / f"{name_or_path}.toml"
        if not path.is_file():
            raise ConfigError(f"unknown preset {str(name_or_path)!r}; known presets: {', '.join(preset_names())}")
    if not path.is_file():
        raise ConfigError(f"no recipe file at {path}")
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: not a readable TOML recipe ({type(exc).__name__}: {str(exc)[:200]})") from None
    return recipe_from_dict(data, source=str(path), default_name=path.stem)


def recipe_from_dict(data: dict[str, Any], source: str, default_name: str) -> Recipe:
    """Build a :class:`Recipe` from parsed TOML."""
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"{source}: unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    if "model" not in data:
        raise ConfigError(f"{source}: no [model] section")
    model = dict(data["model"])
    model.setdefault("name", default_name)
    try:
        config = MLAConfig.from_dict(model, source=f"{source} [model]")
    except ConfigError as exc:
        if source in str(exc):
            raise
        raise ConfigError(f"{source} [model]: {exc}") from None
    sections = {}
    for key, cls in (("export", ExportSettings), ("build", BuildSettings), ("validate", ValidateSettings)):
        raw = dict(data.get(key, {}))
        _check_keys(key, raw, cls, source)
        try:
            sections[key] = cls(**raw)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{source} [{key}]: {exc}") from None
    return Recipe(name=config.name, model=config, source=source, **sections)
