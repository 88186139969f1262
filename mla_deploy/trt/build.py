"""Build TensorRT engines from an artifact with Polygraphy: one engine per graph file (``<artifact>/trt/model.engine``
with a prefill and a decode profile, or ``prefill.engine`` and ``decode.engine``), ``timing.cache`` and
``build.json``.

Precision: TensorRT 11 networks are always strongly typed (the ONNX graphs carry the dtype; the FP16/BF16
builder flags no longer exist), so the network is parsed with ``strongly_typed=True``. On TensorRT 10 the
network is weakly typed by default and the manifest's precision turns on ``fp16`` or ``bf16`` in
``CreateConfig`` (``strongly_typed=True`` can be asked for instead). Everything is written under a
temporary folder beside ``trt/`` and swapped into place at the end (:func:`~mla_deploy.artifact.atomic_dir`).

``build.json`` is TensorRT's build record (a plain dict, format ``mla-deploy-trt-build``), not the artifact's
manifest; :func:`read_build_record` reads it back.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from ..artifact import Manifest, atomic_dir, atomic_write_text, load_manifest, now, sha256_file
from ..errors import ArtifactError, ConfigError, ExportError, RuntimeMissingError
from ..expert_forms import require_tensorrt as require_experts_for_tensorrt
from ..recipe import BuildSettings
from .profiles import engine_profiles, polygraphy_profile, profiles_to_json

TRT_DIR = "trt"
BUILD_RECORD = "build.json"
TIMING_CACHE = "timing.cache"
RECORD_FORMAT = "mla-deploy-trt-build"
RECORD_VERSION = 2  # 2: engines keyed by file, each with one profile per role it serves ("roles")


def require_tensorrt():
    """The ``tensorrt`` module and the name of CUDA device 0.

    Raises:
        RuntimeMissingError: one line naming what is missing (TensorRT, a CUDA GPU, or both).
    """
    missing, trt = [], None
    try:
        import tensorrt as trt
    except Exception as exc:  # ImportError, or OSError when its libraries cannot be loaded
        reason = "not installed" if isinstance(exc, ModuleNotFoundError) else f"not importable ({exc})"
        missing.append(f"TensorRT is {reason} (pip install tensorrt-cu12 or tensorrt-cu13, matching your CUDA)")
    import torch

    if not torch.cuda.is_available():
        missing.append("no CUDA GPU is visible (torch.cuda.is_available() is False)")
    if missing:
        raise RuntimeMissingError("TensorRT engines need TensorRT and an NVIDIA GPU: " + "; ".join(missing))
    return trt, torch.cuda.get_device_name(0)


def trt_major(version: str) -> int:
    """The major version of a TensorRT version string (``"10.13.0.35"`` -> 10)."""
    try:
        return int(str(version).split(".")[0])
    except ValueError:
        raise RuntimeMissingError(f"cannot read the TensorRT version {version!r}") from None


def precision_flags(precision: str, trt_version: str, strongly_typed: bool | None = None) -> dict[str, bool]:
    """How to build for ``precision`` (``fp32``/``fp16``/``bf16``) on ``trt_version``.

    Returns: ``{"strongly_typed": ..., "fp16": ..., "bf16": ...}`` for ``NetworkFromOnnxPath``/``CreateConfig``.
    Raises: ConfigError: a weakly typed build asked of TensorRT >= 11, or TensorRT older than 10.
    """
    major = trt_major(trt_version)
    if major < 10:
        raise ConfigError(f"TensorRT {trt_version} is too old; mla-deploy needs TensorRT 10 or newer")
    if major >= 11:
        if strongly_typed is False:
            raise ConfigError(f"TensorRT {trt_version} builds strongly typed networks only")
        return {"strongly_typed": True, "fp16": False, "bf16": False}
    if strongly_typed:
        return {"strongly_typed": True, "fp16": False, "bf16": False}
    return {"strongly_typed": False, "fp16": precision == "fp16", "bf16": precision == "bf16"}


def build_plan(manifest: Manifest, build: BuildSettings | None, trt_version: str,
               strongly_typed: bool | None = None, roles: tuple[str, ...] | None = None) -> dict[str, dict]:
    """What to build: one engine per graph file, with one optimisation profile per role the file serves.

    A graph that serves prefill and decode (``model.onnx``) becomes one engine, ``model.engine``, with the prefill
    profile at index 0 and the decode profile at index 1: the GPU holds its weights once, and each role runs in an
    execution context of its own profile. Two graphs (``prefill.onnx``, ``decode.onnx``) become two engines.

    Args:
        manifest: the artifact's manifest.
        build: profile ranges (default: the manifest's recorded ``[build]``).
        trt_version: the TensorRT version (decides the precision handling, :func:`precision_flags`).
        roles: the roles to build for (default: all of the manifest's).
    Returns:
        ``{engine file: {"onnx", "engine", "roles": [role, ...], "profiles": [profile, ...], "attention",
        strongly_typed/fp16/bf16}}``, profile ``i`` serving ``roles[i]``.
    Raises:
        ConfigError: a role the artifact has no graph for, or ranges that do not fit.
    """
    flags = precision_flags(manifest.precision, trt_version, strongly_typed)
    profiles = engine_profiles(manifest, build)
    roles = roles or tuple(manifest.graphs)
    unknown = [r for r in roles if r not in manifest.graphs]
    if unknown:
        raise ConfigError(f"the artifact has no {', '.join(unknown)} graph; it has {', '.join(manifest.graphs)}")
    plan: dict[str, dict] = {}
    for role in roles:
        graph = manifest.graphs[role]
        engine = f"{Path(graph.file).stem}.engine"
        spec = plan.setdefault(engine, {"onnx": graph.file, "engine": engine, "roles": [], "profiles": [],
                                        "attention": graph.attention, **flags})
        spec["roles"].append(role)
        spec["profiles"].append(profiles[role])
    return plan


def role_profiles(plan: dict[str, dict]) -> dict[str, dict]:
    """``{role: {"engine": file, "profile": index}}``: where each role runs in a :func:`build_plan`."""
    return {role: {"engine": engine, "profile": i} for engine, spec in plan.items() for i, role in enumerate(spec["roles"])}


def build_record(manifest: Manifest, plan: dict[str, dict], engines: dict[str, dict], trt_version: str,
                 gpu: str, workspace_mib: int, timing_cache: str | None) -> dict[str, Any]:
    """The content of ``build.json``."""
    from polygraphy import __version__ as polygraphy_version

    first = next(iter(plan.values()))
    return {
        "format": RECORD_FORMAT, "format_version": RECORD_VERSION, "fingerprint": manifest.fingerprint,
        "tensorrt": trt_version, "polygraphy": polygraphy_version, "gpu": gpu, "precision": manifest.precision,
        "strongly_typed": first["strongly_typed"],
        "precision_flags": [f for f in ("fp16", "bf16") if first[f]],
        "profiles": profiles_to_json({role: spec["profiles"][i] for spec in plan.values()
                                      for i, role in enumerate(spec["roles"])}),
        "engines": engines, "roles": role_profiles(plan), "workspace_mib": workspace_mib, "timing_cache": timing_cache,
        "build_seconds": round(sum(e.get("build_seconds", 0.0) for e in engines.values()), 3),
        "created": now(),
    }


def write_build_record(folder: str | Path, record: dict[str, Any]) -> Path:
    """Write ``build.json`` into ``folder`` atomically; returns its path."""
    return atomic_write_text(Path(folder) / BUILD_RECORD, json.dumps(record, indent=2) + "\n")


def read_build_record(artifact: str | Path) -> dict[str, Any]:
    """``<artifact>/trt/build.json``. Raises: ArtifactError: missing or unreadable."""
    path = Path(artifact) / TRT_DIR / BUILD_RECORD
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{path.parent} holds no engines; run `mla-deploy build {artifact}` first") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{path} is not readable JSON ({exc})") from None
    if record.get("format") != RECORD_FORMAT:
        raise ArtifactError(f"{path} is not an mla-deploy build record")
    if record.get("format_version") != RECORD_VERSION:
        raise ArtifactError(f"{path} was written by another mla-deploy (format_version "
                            f"{record.get('format_version')!r}); run `mla-deploy build {artifact}` again")
    return record


def _build_one(trt, spec: dict, root: Path, tmp: Path, cache: Path | None, workspace_mib: int,
               optimization_level: int | None) -> dict[str, Any]:
    from polygraphy.backend.trt import (CreateConfig, EngineBytesFromNetwork, EngineFromBytes, NetworkFromOnnxPath,
                                        SaveEngine)

    network = NetworkFromOnnxPath(str(root / spec["onnx"]), strongly_typed=spec["strongly_typed"])
    config = CreateConfig(fp16=spec["fp16"] or None, bf16=spec["bf16"] or None,
                          profiles=[polygraphy_profile(profile) for profile in spec["profiles"]],
                          memory_pool_limits={trt.MemoryPoolType.WORKSPACE: workspace_mib << 20},
                          load_timing_cache=str(cache) if cache is not None and cache.is_file() else None,
                          builder_optimization_level=optimization_level)
    start = time.perf_counter()
    serialized = EngineBytesFromNetwork(network, config, save_timing_cache=str(cache) if cache else None)()
    seconds = time.perf_counter() - start
    path = tmp / spec["engine"]
    engine = SaveEngine(EngineFromBytes(serialized), str(path))()  # deserialised once: the plan loads
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    outputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
    aliased = {}
    if hasattr(engine, "get_aliased_input_tensor"):  # TensorRT >= 10.15
        aliased = {n: engine.get_aliased_input_tensor(n) for n in outputs if engine.get_aliased_input_tensor(n)}
    return {"file": spec["engine"], "onnx": spec["onnx"], "roles": list(spec["roles"]),
            "bytes": path.stat().st_size, "sha256": sha256_file(path),
            "build_seconds": round(seconds, 3), "attention": spec["attention"], "aliased_outputs": aliased}


def check_buildable(manifest: Manifest, root: Path) -> None:
    """Refuse an artifact TensorRT could never parse, before TensorRT is looked for.

    Raises:
        ArtifactError: its routed experts are ONNX Runtime's fused ``MoE``/``QMoE`` operators
            (:func:`mla_deploy.expert_forms.require_tensorrt`), or its quantized weights are in a format TensorRT
            cannot parse (ONNX Runtime's ``MatMulNBits``: :attr:`mla_deploy.quant.WeightFormat.tensorrt`).
    """
    for entry in manifest.graphs.values():
        require_experts_for_tensorrt(entry.experts, str(root), manifest.config.is_moe)
    manifest.quantization.require_tensorrt(str(root))


def build_engines(artifact: str | Path, build: BuildSettings | None = None, strongly_typed: bool | None = None,
                  timing_cache: bool = True, optimization_level: int | None = None) -> dict[str, Any]:
    """Build the engines of ``artifact`` and return the build record (also written to ``trt/build.json``).

    Args:
        artifact: an export directory (``manifest.json``, ``prefill.onnx``, ``decode.onnx``).
        build: profile ranges and workspace (default: the ``[build]`` section recorded in the manifest).
        strongly_typed: None: strongly typed on TensorRT >= 11, precision flags on 10; True/False to choose on 10.
        timing_cache: reuse and update ``trt/timing.cache``.
        optimization_level: TensorRT's builder optimisation level (0..5; None: its default).
    Raises:
        RuntimeMissingError: no TensorRT or no GPU (checked first). ArtifactError: a bad artifact, or one whose
            quantized weights are ONNX Runtime's MatMulNBits (:func:`check_buildable`).
        ConfigError: profile ranges that do not fit. ExportError: TensorRT failed to parse or build a graph.
    """
    trt, gpu = require_tensorrt()
    root = Path(artifact)
    manifest = load_manifest(root)
    check_buildable(manifest, root)
    build = build or manifest.build_settings()
    plan = build_plan(manifest, build, trt.__version__, strongly_typed)
    if any(manifest.graphs[role].uses_plugin for spec in plan.values() for role in spec["roles"]):
        from .plugin_loader import register_mla_decode_plugin

        register_mla_decode_plugin()
    out = root / TRT_DIR
    with atomic_dir(out) as tmp:
        cache = tmp / TIMING_CACHE if timing_cache else None
        if cache is not None and (out / TIMING_CACHE).is_file():
            shutil.copyfile(out / TIMING_CACHE, cache)
        engines = {}
        for file, spec in plan.items():
            try:
                engines[file] = _build_one(trt, spec, root, tmp, cache, build.workspace_mib, optimization_level)
            except OSError:  # a full disk, a file-size limit: the OS's own words, not a failed build
                raise
            except Exception as exc:  # Polygraphy raises PolygraphyException with TensorRT's log above it
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise ExportError(f"TensorRT could not build {file} ({' and '.join(spec['roles'])}) from "
                                  f"{spec['onnx']}: {first}") from exc
        record = build_record(manifest, plan, engines, trt.__version__, gpu, build.workspace_mib,
                              TIMING_CACHE if cache is not None and cache.is_file() else None)
        write_build_record(tmp, record)
        for lock in tmp.glob("*.lock"):  # Polygraphy's timing-cache lock files; this folder is ours alone
            lock.unlink()
    return record
