"""The artifact manifest: ``manifest.json`` as a frozen, typed record, and its load and save.

An artifact directory holds ``prefill.onnx`` and ``decode.onnx`` (and their external weights), the
reference weights of a preset export, ``manifest.json``, and later what other commands add (``trt/``,
``validation/``). Every reader goes through :func:`load_manifest` (format, fields, files present and whole)
or :func:`mla_deploy.artifact.check_artifact` (also hashes and graph I/O); nothing reads the JSON by key.

The JSON layout (format ``mla-deploy-artifact``, version 1) is unchanged from the first release, so older
artifacts load.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .. import expert_forms
from ..cache_layout import CacheLayout, get_layout
from ..config import MLAConfig
from ..errors import ArtifactError, ConfigError, MLADeployError
from ..io_spec import PRECISIONS, ROLES, TensorSpec
from ..quant import FLOAT, Quantization, from_manifest
from .files import atomic_write_text
from .tokenizer_files import TokenizerFiles

MANIFEST = "manifest.json"
FORMAT = "mla-deploy-artifact"
# 2: the language model's graphs take ``logits_index`` and return logits only for the positions it names
FORMAT_VERSION = 2
SUPPORTED_FORMAT_VERSIONS = (2,)
REFERENCE_WEIGHTS = "reference.safetensors"
#: the file that makes a folder an onnxruntime-genai model (``export --target genai``; no mla-deploy artifact)
GENAI_CONFIG = "genai_config.json"


@dataclass(frozen=True)
class WeightsSource:
    """Where an artifact's weights came from, so validation can rebuild the PyTorch original.

    Attributes:
        kind: ``random`` (a preset's seeded weights), ``hf`` (a Hugging Face checkpoint) or ``in-memory``
            (a model handed to the Python API: no reference can be rebuilt).
        file: the reference weights file inside the artifact (``reference.safetensors``), if any.
        path: the checkpoint folder (``hf``).
        seed, std: the random weights' seed and standard deviation (``random``: validation rebuilds them).
        files: ``hf``: what identifies the checkpoint's files, ``({"file", "bytes", "sampled_sha256"}, ...)``
            (:meth:`mla_deploy.checkpoint.CheckpointTensors.identity`), so validation refuses a checkpoint that
            changed since the export.
    """

    kind: str = "in-memory"
    file: str | None = None
    path: str | None = None
    seed: int | None = None
    std: float | None = None
    files: tuple | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in (("kind", self.kind), ("seed", self.seed), ("std", self.std), ("file", self.file),
                                 ("path", self.path)) if v is not None}
        if self.files is not None:
            out["files"] = [dict(f) for f in self.files]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "WeightsSource":
        data = dict(data or {})
        unknown = sorted(set(data) - {"kind", "file", "path", "seed", "std", "files"})
        if unknown:
            raise ArtifactError(f"manifest.json [weights]: unknown field(s) {', '.join(unknown)}")
        if data.get("files") is not None:
            data["files"] = tuple(dict(f) for f in data["files"])
        return cls(**data)


#: a graph's ``attention``: ONNX ops, or the TensorRT plugin's node (:data:`PLUGIN_DOMAIN` ``::`` :data:`PLUGIN_OP`)
ATTENTIONS = ("standard", "plugin")
#: the TensorRT decode-attention plugin's ONNX node (``plugins/mla_decode``; written by
#: :mod:`mla_deploy.exporter.decode_plugin`)
PLUGIN_DOMAIN, PLUGIN_OP = "mla_deploy", "MlaDecode"


@dataclass(frozen=True)
class GraphEntry:
    """One exported graph.

    Attributes:
        role: ``prefill`` or ``decode``.
        file: the ``.onnx`` file name inside the artifact.
        form: the attention form it computes (``CC``, ``A_CC``, ...).
        attention: ``standard`` (ONNX ops) or ``plugin`` (one ``mla_deploy::MlaDecode`` node per layer).
        experts: the routed experts' graph form (:mod:`mla_deploy.expert_forms`): ``fused`` (one ONNX Runtime
            ``MoE``/``QMoE`` node per MoE layer) or ``branches`` (standard ops; an entry without it, written before
            the choice existed).
        inputs, outputs: the graph's I/O contract.
        external_data: the side file holding its weights, or None.
        bytes: size of ``file``.
        sha256: hex digest of ``file``.
    """

    role: str
    file: str
    form: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    attention: str = "standard"
    experts: str = expert_forms.LEGACY
    external_data: str | None = None
    bytes: int = 0
    sha256: str = ""

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    @property
    def uses_plugin(self) -> bool:
        """The graph holds the TensorRT ``MlaDecode`` plugin node (ONNX Runtime cannot run it)."""
        return self.attention == "plugin"

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "form": self.form, "attention": self.attention, "experts": self.experts,
                "inputs": [t.to_dict() for t in self.inputs], "outputs": [t.to_dict() for t in self.outputs],
                "external_data": self.external_data, "bytes": self.bytes, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, role: str, data: Mapping[str, Any]) -> "GraphEntry":
        try:
            return cls(role=role, file=str(data["file"]), form=str(data.get("form", "")),
                       inputs=tuple(TensorSpec.from_dict(t) for t in data.get("inputs", [])),
                       outputs=tuple(TensorSpec.from_dict(t) for t in data.get("outputs", [])),
                       attention=str(data.get("attention", "standard")),
                       experts=_experts_form(role, data.get("experts", expert_forms.LEGACY)),
                       external_data=_optional_name(data.get("external_data")),
                       bytes=int(data.get("bytes", 0)), sha256=str(data.get("sha256", "")))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ArtifactError(f"manifest.json: the {role} graph entry is malformed ({type(exc).__name__}: {exc})") from None


def _optional_name(value: Any) -> str | None:
    """A graph entry's file name that may be absent (``external_data``): None or a string. Raises: TypeError."""
    if value is not None and not isinstance(value, str):
        raise TypeError(f"expected a file name, got {value!r}")
    return value


def _experts_form(role: str, form: Any) -> str:
    """A graph entry's ``experts`` (:data:`mla_deploy.expert_forms.FORMS`). Raises: ArtifactError otherwise."""
    if form not in expert_forms.FORMS:
        raise ArtifactError(f"manifest.json: the {role} graph's experts must be {' or '.join(expert_forms.FORMS)}, "
                            f"got {form!r}")
    return str(form)


@dataclass(frozen=True)
class Manifest:
    """``manifest.json`` of an artifact.

    Attributes:
        name: the recipe's (or checkpoint folder's) name.
        fingerprint: identity of the model (dimensions and weights source); a re-export of the same model
            into the same folder keeps it.
        model: the model's dimensions.
        weights: where the weights came from.
        precision: ``fp32``, ``fp16`` or ``bf16`` (every float input, output and weight of the graphs).
        opset: the ONNX opset.
        cache: the layout description (:meth:`CacheLayout.describe`), ``cache["mode"]`` the mode.
        max_cache_length: the static cache's capacity (None for a growing cache).
        graphs: ``{role: GraphEntry}``.
        recipe: the resolved recipe as plain data (its ``[build]`` and ``[validate]`` are read back).
        versions: what produced the artifact.
        created: ISO time of the export.
        format_version: the manifest format's version.
        weights_data: the graphs' shared weights file, ``{"file", "bytes", "sha256"}``; None when the weights are
            inside the graph files (small models).
        tokenizer: the tokenizer files copied from the checkpoint (:class:`TokenizerFiles`); None: ids only.
            Optional in format version 1: a manifest without it loads, and one with it loads in older readers.
        quantization: what the export did to the weights (:class:`mla_deploy.quant.Quantization`, parsed once from
            the JSON record by :func:`mla_deploy.quant.from_manifest`): :data:`~mla_deploy.quant.FLOAT` (no record:
            the weights are in ``precision``), or the scheme, format and checkpoint keys quantized. Optional: older
            readers run such graphs unaware.
    """

    name: str
    fingerprint: str
    model: MLAConfig
    weights: WeightsSource
    precision: str
    opset: int
    cache: dict
    max_cache_length: int | None
    graphs: dict
    recipe: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    created: str = ""
    format_version: int = FORMAT_VERSION
    weights_data: dict | None = None
    tokenizer: TokenizerFiles | None = None
    quantization: Quantization = FLOAT

    # derived ------------------------------------------------------------------------------------
    @property
    def config(self) -> MLAConfig:
        """The model config (same as :attr:`model`)."""
        return self.model

    @property
    def layout(self) -> CacheLayout:
        """The cache layout the graphs were exported with."""
        return get_layout(self.cache.get("mode"))

    @property
    def dtype(self) -> str:
        """The numpy-style name of the graphs' float type."""
        return PRECISIONS[self.precision]

    @property
    def capacity(self) -> int | None:
        """Static cache rows per sequence (None for a growing cache)."""
        return self.layout.manifest_capacity(self.max_cache_length)

    def graph(self, role: str) -> GraphEntry:
        """The graph of ``role``. Raises: ArtifactError when the artifact has none."""
        try:
            return self.graphs[role]
        except KeyError:
            raise ArtifactError(f"the artifact has no {role} graph; it has {', '.join(self.graphs) or 'none'}") from None

    @property
    def uses_plugin(self) -> bool:
        """Some graph holds the TensorRT ``MlaDecode`` plugin node."""
        return any(g.uses_plugin for g in self.graphs.values())

    def build_settings(self):
        """The ``[build]`` section of the recorded recipe (defaults when absent)."""
        from ..recipe import BuildSettings

        return self._section("build", BuildSettings)

    def validate_settings(self):
        """The ``[validate]`` section of the recorded recipe (defaults when absent)."""
        from ..recipe import ValidateSettings

        return self._section("validate", ValidateSettings)

    def _section(self, key: str, cls):
        raw = dict((self.recipe or {}).get(key) or {})
        try:
            return cls(**raw)
        except (TypeError, ValueError, MLADeployError) as exc:
            raise ArtifactError(f"manifest.json [{key}]: {exc}") from None

    # (de)serialisation --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "format_version": self.format_version, "name": self.name,
            "fingerprint": self.fingerprint, "model": self.model.to_dict(), "weights": self.weights.to_dict(),
            "precision": self.precision, "dtype": self.dtype, "opset": self.opset, "cache": self.cache,
            "max_cache_length": self.max_cache_length,
            "graphs": {role: g.to_dict() for role, g in self.graphs.items()},
            "recipe": self.recipe, "versions": self.versions, "created": self.created,
            **({"weights_data": self.weights_data} if self.weights_data is not None else {}),
            **({"tokenizer": self.tokenizer.to_dict()} if self.tokenizer is not None else {}),
            **self.quantization.to_manifest(),
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = MANIFEST) -> "Manifest":
        """Parse a manifest's JSON data.

        Raises:
            ArtifactError: not an mla-deploy manifest, an unsupported version, a missing or malformed field.
        """
        version = _format_version(data, source)
        for key in ("model", "graphs", "precision", "cache"):
            if key not in data:
                raise ArtifactError(f"{source} lacks the field {key!r}")
        try:
            model = MLAConfig.from_dict(data["model"], source=f"{source} [model]")
        except ConfigError as exc:
            raise ArtifactError(str(exc)) from None
        if data["precision"] not in PRECISIONS:
            raise ArtifactError(f"{source}: precision {data['precision']!r} is not one of {', '.join(PRECISIONS)}")
        if "dtype" in data and data["dtype"] != PRECISIONS[data["precision"]]:
            raise ArtifactError(f"{source}: dtype {data['dtype']!r} is not {PRECISIONS[data['precision']]!r}, the "
                                f"element type of precision {data['precision']} (edited?)")
        cache = data["cache"]
        if not isinstance(cache, dict):
            raise ArtifactError(f"{source}: [cache] is not a table")
        try:
            get_layout(cache.get("mode"))
        except ConfigError as exc:
            raise ArtifactError(f"{source}: {exc}") from None
        graphs = data["graphs"]
        if not isinstance(graphs, dict):
            raise ArtifactError(f"{source}: [graphs] is not a table")
        for role in graphs:
            if role not in ROLES:
                raise ArtifactError(f"{source}: unknown graph role {role!r} (expected {', '.join(ROLES)})")
        try:
            opset = int(data.get("opset", 0))
        except (TypeError, ValueError):
            raise ArtifactError(f"{source}: opset {data.get('opset')!r} is not an integer") from None
        capacity = data.get("max_cache_length")
        if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1):
            raise ArtifactError(f"{source}: max_cache_length {capacity!r} is not a positive integer")
        for key in ("weights", "recipe", "versions"):
            if not isinstance(data.get(key) or {}, dict):
                raise ArtifactError(f"{source}: [{key}] is not a table")
        try:
            return cls(
                name=str(data.get("name", "")), fingerprint=str(data.get("fingerprint", "")), model=model,
                weights=WeightsSource.from_dict(data.get("weights")), precision=data["precision"], opset=opset,
                cache=dict(cache), max_cache_length=capacity,
                graphs={role: GraphEntry.from_dict(role, g) for role, g in graphs.items()},
                recipe=dict(data.get("recipe") or {}), versions=dict(data.get("versions") or {}),
                created=str(data.get("created", "")), format_version=version,
                weights_data=_weights_data(data, source),
                tokenizer=None if data.get("tokenizer") is None else TokenizerFiles.from_dict(data["tokenizer"], source),
                quantization=from_manifest(data.get("quantization"), source))
        except (TypeError, ValueError, AttributeError, KeyError) as exc:  # a field of another type than written
            raise ArtifactError(f"{source}: a field is malformed ({type(exc).__name__}: {exc})") from None

    def save(self, folder: str | Path) -> Path:
        """Write ``folder/manifest.json`` atomically; returns its path."""
        return atomic_write_text(Path(folder) / MANIFEST, json.dumps(self.to_dict(), indent=2) + "\n")


def _format_version(data: Any, source: str) -> int:
    """The manifest's ``format_version``. Raises: ArtifactError: no mla-deploy manifest, or a version not read here."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ArtifactError(f"{source} is not an mla-deploy manifest")
    version = data.get("format_version")
    if isinstance(version, int) and 0 < version < min(SUPPORTED_FORMAT_VERSIONS):
        raise ArtifactError(f"{source}: format_version {version} was written by an older mla-deploy, whose graphs "
                            f"this one cannot run; export the model again")
    if version not in SUPPORTED_FORMAT_VERSIONS:
        raise ArtifactError(f"{source}: format_version {version!r} is not supported "
                            f"(this mla-deploy reads {', '.join(map(str, SUPPORTED_FORMAT_VERSIONS))})")
    return version


def _weights_data(data: dict, source: str) -> dict | None:
    record = data.get("weights_data")
    if record is None:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("file"), str) or not isinstance(record.get("bytes"), int):
        raise ArtifactError(f"{source}: weights_data must name a file and its bytes")
    return dict(record)


def now() -> str:
    """The current UTC time as the manifest records it."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def read_fingerprint(folder: str | Path) -> str | None:
    """The fingerprint recorded in ``folder/manifest.json``, or None when there is no readable one."""
    try:
        return json.loads((Path(folder) / MANIFEST).read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


def load_manifest(artifact: str | Path) -> Manifest:
    """The manifest of ``artifact`` after checking its format and its graph files' presence and sizes.

    Raises:
        ArtifactError: no such directory, no or unreadable manifest, a graph file missing or truncated.
    """
    root = Path(artifact)
    if not root.is_dir():
        raise ArtifactError(f"no artifact directory at {root}")
    path = root / MANIFEST
    if not path.is_file():
        if (root / GENAI_CONFIG).is_file():
            raise ArtifactError(f"{root} is an onnxruntime-genai folder (export --target genai), not an mla-deploy "
                                f"artifact: run it with onnxruntime-genai, onnxruntime_genai.Model('{root}') (the "
                                f"[genai] extra installs it)")
        raise ArtifactError(f"{root} holds no {MANIFEST}; export into it first (mla-deploy export ... --out {root})")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: arrays nested past Python's stack
        raise ArtifactError(f"{path} is not readable JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
    manifest = Manifest.from_dict(data, source=str(path))
    for role, graph in manifest.graphs.items():
        file = root / graph.file
        if not file.is_file():
            raise ArtifactError(f"{role} graph {file} is missing")
        size = file.stat().st_size
        if graph.bytes and size != graph.bytes:
            raise ArtifactError(f"{role} graph {file} has {size} bytes, the manifest says {graph.bytes} "
                                f"(truncated or replaced)")
        if graph.external_data and not (root / graph.external_data).is_file():
            raise ArtifactError(f"{role} graph's weights {root / graph.external_data} are missing")
    if manifest.weights_data is not None:
        data = root / manifest.weights_data["file"]
        if not data.is_file():
            raise ArtifactError(f"the weights file {data} is missing")
        if data.stat().st_size != manifest.weights_data["bytes"]:
            raise ArtifactError(f"the weights file {data} has {data.stat().st_size} bytes, the manifest says "
                                f"{manifest.weights_data['bytes']} (truncated or replaced)")
    if manifest.tokenizer is not None:
        manifest.tokenizer.check(root, verify_hashes=False)
    return manifest
