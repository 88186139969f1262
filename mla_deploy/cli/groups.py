"""Option groups shared by the commands (Polygraphy's ``tools/args`` ``BaseArgs``, for click).

A group declares its options (:meth:`OptionGroup.options`), parses their values into one typed object and
validates them (:meth:`OptionGroup.parse`). Used as a decorator, it adds its options to a command and passes the
object as one parameter (:attr:`OptionGroup.dest`), so a command receives ``source``, ``runtime``, ``sampling``
... instead of a dozen loose values, and a concern shared by commands is parsed and checked in one place.

Imported at startup: nothing heavy here (the library is imported when a value is parsed).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Callable

import click

from ..errors import CheckpointError, ConfigError, InputError
from ..expert_forms import EXPERT_FORMS
from ..host import usable_cpus
from ..io_spec import PRECISIONS
from ..quant import BLOCK_SIZE_CHOICES, FORMATS, WEIGHTS, parse_block_size, require_quantized
from ..recipe import MIN_CACHE_LENGTH
from .options import Int, Threads, TokenIds

#: ``--cache-mode`` choices: :data:`mla_deploy.cache_layout.CACHE_MODES` (not imported: it imports numpy; a test
#: holds the two equal)
CACHE_MODES = ("concat", "static")
#: ``--weights``, ``--block-size`` and ``--quant-format`` choices, in one place for every command: the quantization
#: owner's (:mod:`mla_deploy.quant`, cheap to import): float and the schemes, the block sizes, the formats (the
#: default first)
BLOCK_SIZES = BLOCK_SIZE_CHOICES
QUANT_FORMATS = tuple(FORMATS)


@dataclasses.dataclass(frozen=True)
class Option:
    """A click option as a value: what a group's :meth:`~OptionGroup.options` lists."""

    decls: tuple[str, ...]
    attrs: dict

    @property
    def name(self) -> str:
        """The parameter name click gives its value (``--max-cache-length`` -> ``max_cache_length``)."""
        return click.Option(self.decls, **self.attrs).name

    def __call__(self, command: Callable) -> Callable:
        """Add the option to ``command`` (an :class:`Option` is a decorator, as ``click.option`` is)."""
        return click.option(*self.decls, **self.attrs)(command)


def option(*decls: str, **attrs) -> Option:
    """An :class:`Option` declared as with ``click.option``."""
    return Option(decls, attrs)


class OptionGroup:
    """Options of one concern that several commands share. Subclasses set :attr:`dest` and define
    :meth:`options` and :meth:`parse`; the first line of their docstring is ``Title: what the options are for``."""

    #: the command parameter that receives the parsed object
    dest: str = ""

    def options(self) -> list[Option]:
        """The group's options, in the order ``--help`` shows them."""
        raise NotImplementedError

    def parse(self, values: dict[str, Any]) -> Any:
        """The typed object of the options' values (``{parameter name: value}``).

        Raises:
            MLADeployError: values that contradict each other (the CLI's one line, exit 1);
            click.UsageError: a malformed command line (exit 2).
        """
        raise NotImplementedError

    def __call__(self, command: Callable) -> Callable:
        """Add the options to ``command`` and pass it their parsed object as ``dest`` instead of their values."""
        options = self.options()
        names = [o.name for o in options]

        @functools.wraps(command)
        def folded(*args, **kwargs):
            kwargs[self.dest] = self.parse({name: kwargs.pop(name) for name in names})
            return command(*args, **kwargs)

        for o in reversed(options):  # click lists the options of stacked decorators top to bottom
            folded = o(folded)
        return folded


# --- where the model comes from ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ModelSource:
    """The model a command starts from: a built-in preset, a recipe file or a Hugging Face checkpoint."""

    kind: str  # "preset", "recipe" or "hf"
    location: str

    def recipe(self):
        """The :class:`~mla_deploy.recipe.Recipe` (a checkpoint's config with the default settings for ``hf``)."""
        from ..recipe import Recipe, load_recipe

        if self.kind != "hf":
            return load_recipe(self.location)
        from ..config import from_hf_config

        config = from_hf_config(self.location)
        return Recipe(name=Path(self.location).resolve().name, model=config, source=self.location)

    def config(self):
        """The model's :class:`~mla_deploy.config.MLAConfig` (a checkpoint's is read from its config only)."""
        if self.kind == "hf":
            from ..config import from_hf_config

            return from_hf_config(self.location)
        return self.recipe().model


class SourceArgs(OptionGroup):
    """Model source: where the model comes from (exactly one of --preset, --recipe, --hf)."""

    dest = "source"

    def __init__(self, preset_help: str = "A built-in preset (see `mla-deploy presets`).",
                 hf_help: str = "A Hugging Face checkpoint folder or config.json."):
        self.preset_help, self.hf_help = preset_help, hf_help

    def options(self) -> list[Option]:
        return [option("--preset", metavar="NAME", help=self.preset_help),
                option("--recipe", type=click.Path(dir_okay=False), help="A recipe TOML file."),
                option("--hf", type=click.Path(), help=self.hf_help)]

    def parse(self, values: dict[str, Any]) -> ModelSource:
        given = [(kind, value) for kind, value in values.items() if value]
        if len(given) != 1:
            raise ConfigError("give exactly one of --preset, --recipe, --hf")
        kind, location = given[0]
        from ..artifact.files import require_regular_file  # here: the artifact package imports numpy

        if kind == "recipe":
            require_regular_file(location, ConfigError)
        elif kind == "hf":
            _require_regular_checkpoint_files(Path(location))
        return ModelSource(kind, location)


#: the files of a checkpoint folder that mla-deploy opens (configs and index, weights, tokenizer files)
CHECKPOINT_FILE_PATTERNS = ("*.json", "*.safetensors", "*.jinja")


def _require_regular_file_entries(folder: Path, patterns) -> None:
    from ..artifact.files import require_regular_file

    for pattern in patterns:
        for entry in sorted(folder.glob(pattern)):
            require_regular_file(entry, CheckpointError)


def _require_regular_checkpoint_files(path: Path) -> None:
    """A checkpoint given as a folder or one of its files: none of the files read from it is a named pipe or a
    device (the reader would block on it before any error could be shown). Raises: CheckpointError."""
    from ..artifact.files import require_regular_file

    if not path.is_dir():
        require_regular_file(path, CheckpointError)
    folder = path if path.is_dir() else path.parent
    if path.exists():
        _require_regular_file_entries(folder, CHECKPOINT_FILE_PATTERNS)


# --- what an export changes in the recipe ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ExportOverrides:
    """The command line's changes to a recipe's ``[export]`` settings (None: the recipe's), and ``--layers``."""

    precision: str | None = None
    cache_mode: str | None = None
    max_cache_length: int | None = None
    weights: str | None = None
    block_size: int | None = None
    quant_format: str | None = None
    experts: str | None = None
    layers: int | None = None

    def apply(self, recipe, from_checkpoint: bool):
        """``recipe`` with these settings.

        Raises:
            ConfigError: ``--block-size``/``--quant-format`` without quantized weights, ``--layers`` of a
                checkpoint, or settings the recipe refuses.
        """
        changes = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                   if f.name != "layers" and getattr(self, f.name) is not None}
        require_quantized(self.weights or recipe.export.weights,
                          {"--block-size": self.block_size, "--quant-format": self.quant_format})
        if changes:
            recipe = recipe.replace(export=dataclasses.replace(recipe.export, **changes))
        if self.layers is not None:
            if from_checkpoint:
                raise ConfigError("--layers applies to presets, not to checkpoints")
            recipe = recipe.replace(model=recipe.model.first_layers(self.layers))
        return recipe


class ExportSettingsArgs(OptionGroup):
    """Export settings: the recipe's [export] settings a command overrides, its weight format included."""

    dest = "settings"

    def options(self) -> list[Option]:
        return [
            option("--precision", type=click.Choice(list(PRECISIONS)), help="Override [export] precision."),
            option("--cache-mode", type=click.Choice(CACHE_MODES),
                   help="Override [export] cache_mode (static, the default: a fixed capacity written in place, what "
                        "serve and build --target cpu take; concat: a cache that grows each step)."),
            option("--max-cache-length", type=Int(MIN_CACHE_LENGTH),
                   help=f"Override [export] max_cache_length (static capacity; with --target genai the context "
                        f"length), at least {MIN_CACHE_LENGTH}."),
            option("--layers", type=Int(), help="Keep only the first N decoder layers (presets only)."),
            option("--weights", type=click.Choice(WEIGHTS),
                   help="Override [export] weights: int8/int4 quantize the projections, MLPs, experts and lm_head "
                        "(weight-only, a symmetric scale per block of input features); float (default) quantizes "
                        "nothing."),
            option("--block-size", type=click.Choice(BLOCK_SIZES),
                   help="Input features per scale of --weights int8/int4 (default 32)."),
            option("--quant-format", type=click.Choice(QUANT_FORMATS),
                   help="How --weights int8/int4 are written: matmulnbits (default; ONNX Runtime's MatMulNBits, "
                        "loads in 1.4x the weights' bytes) or qdq (standard DequantizeLinear -> MatMul, for "
                        "TensorRT)."),
            option("--experts", type=click.Choice(EXPERT_FORMS),
                   help="Override [export] experts, the routed experts' graph form: fused (one ONNX Runtime "
                        "MoE/QMoE operator per MoE layer; ONNX Runtime only: CPU for fp32, CUDA for fp16/bf16), "
                        "branches (standard ops, one "
                        "branch per expert; for TensorRT) or auto (default: fused unless the settings are "
                        "TensorRT's).")]

    def parse(self, values: dict[str, Any]) -> ExportOverrides:
        block_size = values.pop("block_size")
        return ExportOverrides(block_size=parse_block_size(block_size), **values)


# --- where a graph runs ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Runtime:
    """ONNX Runtime's execution provider (``cpu``/``cuda``) and intra-op threads (None: its default)."""

    provider: str = "cpu"
    threads: int | None = None
    #: open the artifact's pre-built CPU engine when it has one (``--no-engine``: the source graphs)
    use_engine: bool = True
    #: the CUDA provider's options (:class:`~mla_deploy.ort.cuda.CudaOptions`); None on the CPU
    cuda: Any = None


def threads_help(what: str) -> str:
    """``--threads``' help: ``what`` and the bound of :class:`~.options.Threads` on this machine."""
    return f"{what}, 1 to the CPUs this process may use ({usable_cpus()} here)."


class RuntimeArgs(OptionGroup):
    """Runtime: the ONNX Runtime provider and its threads."""

    dest = "runtime"

    def options(self) -> list[Option]:
        return [option("--provider", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
                       help="ONNX Runtime execution provider."),
                option("--threads", type=Threads(), help=threads_help("ONNX Runtime intra-op threads")),
                option("--no-engine", "no_engine", is_flag=True,
                       help="Open the source graphs even when ARTIFACT/cpu holds an engine built by `mla-deploy build "
                            "ARTIFACT --target cpu` (used by default on the CPU provider; a stale one is refused)."),
                option("--cuda-graph/--no-cuda-graph", "cuda_graph", default=True, show_default=True,
                       help="--provider cuda: capture each decode batch as a CUDA graph and replay it (falls back, "
                            "saying why, where ONNX Runtime cannot capture the graph)."),
                option("--fpa-intb/--no-fpa-intb", "fpa_intb", default=None,
                       help="--provider cuda: MatMulNBits' fpA_intB GEMM on or off (ep.cuda.fpa_intb_gemm; default: "
                            "ONNX Runtime's, off in 1.31)."),
                option("--allow-cpu-nodes", is_flag=True,
                       help="--provider cuda: let nodes the CUDA provider cannot run fall back to the CPU (an older "
                            "GPU export) instead of refusing the artifact.")]

    def parse(self, values: dict[str, Any]) -> Runtime:
        from ..ort.cuda import CudaOptions

        no_engine = values.pop("no_engine")
        cuda = CudaOptions(cuda_graph=values.pop("cuda_graph"), fpa_intb=values.pop("fpa_intb"),
                           strict_placement=not values.pop("allow_cpu_nodes"))
        return Runtime(**values, use_engine=not no_engine, cuda=cuda if values["provider"] == "cuda" else None)


# --- progress lines ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Progress:
    """Whether a long command prints progress lines on stderr, and the callbacks that print them."""

    show: bool

    def log(self, start: float):
        """A ``log(line)`` callback (``[  12.3 s] line``), or None when progress is off."""
        from .output import log_line

        return log_line(start) if self.show else None

    def bar(self, label: str):
        """A ``progress(done, total, seconds)`` callback, or None when progress is off."""
        from .output import progress_line

        return progress_line(label) if self.show else None


class ProgressArgs(OptionGroup):
    """Progress: progress lines on stderr (on a terminal by default)."""

    dest = "progress"

    def options(self) -> list[Option]:
        return [option("--quiet", "-q", is_flag=True, help="No progress lines (they are shown on a terminal only)."),
                option("--progress", "force_progress", is_flag=True,
                       help="Progress lines on stderr even when it is no terminal.")]

    def parse(self, values: dict[str, Any]) -> Progress:
        import sys

        return Progress(values["force_progress"] or (not values["quiet"] and sys.stderr.isatty()))


# --- generation --------------------------------------------------------------------------------------------------

def seed_option(help: str, default: int | None = None) -> click.Option:
    """``--seed``, the same for every command: an integer >= 0."""
    return option("--seed", type=Int(minimum=0), default=default, show_default=default is not None,
                  help=f"{help} An integer >= 0.")


class SamplingArgs(OptionGroup):
    """Sampling: how the next token is chosen (greedy unless --temperature > 0)."""

    dest = "sampling"

    def options(self) -> list[Option]:
        return [option("--temperature", default=0.0, show_default=True, type=float, help="0 is greedy; > 0 samples."),
                option("--top-k", type=Int(), help="Sample from the k most likely tokens (needs --temperature > 0)."),
                option("--top-p", default=1.0, show_default=True, type=float,
                       help="Sample from the most likely tokens up to this probability, in (0, 1] (needs "
                            "--temperature > 0)."),
                seed_option("Seed of the sampling (the same seed repeats the same text).")]

    def parse(self, values: dict[str, Any]):
        from ..generate.sampling import SamplingConfig

        return SamplingConfig(values["temperature"], values["top_k"], values["top_p"], values["seed"])


@dataclasses.dataclass(frozen=True)
class Prompts:
    """What ``run`` generates from: text prompts (``texts``) or token ids (``ids``), one per sequence of the
    batch; with ``chat``, each text is a user turn after the optional ``system`` message; ``stop`` strings end a
    sequence."""

    texts: tuple[str, ...]
    ids: tuple[list[int], ...]
    chat: bool
    system: str | None
    stop: tuple[str, ...]


class PromptArgs(OptionGroup):
    """Prompts: the text or token ids ``run`` starts from, and the strings that stop it."""

    dest = "prompts"

    def options(self) -> list[Option]:
        return [option("--prompt", "texts", multiple=True,
                       help="A text prompt (needs an artifact exported from a checkpoint with its tokenizer); repeat "
                            "for a batch."),
                option("--prompt-ids", "ids", type=TokenIds(), multiple=True,
                       help="Comma-separated token ids of one prompt; repeat for a batch."),
                option("--chat", is_flag=True, help="Apply the checkpoint's chat template to each --prompt (a user "
                                                     "turn)."),
                option("--system", help="With --chat: a system message before each prompt."),
                option("--stop", multiple=True, help="Stop a sequence when its text contains this string; "
                                                     "repeatable.")]

    def parse(self, values: dict[str, Any]) -> Prompts:
        prompts = Prompts(**values)
        if bool(prompts.texts) == bool(prompts.ids):  # a malformed command line: click's usage error (exit 2)
            raise click.UsageError("give --prompt (text) or --prompt-ids (token ids), not both" if prompts.texts
                                   else "give a prompt: --prompt TEXT or --prompt-ids 1,2,3")
        if (prompts.chat or prompts.system is not None) and not prompts.texts:
            raise InputError("--chat and --system apply to --prompt")
        return prompts
