"""TensorRT optimisation profiles from a recipe's ``[build]`` ranges and an artifact's manifest (pure Python).

Every symbolic axis of :mod:`mla_deploy.io_spec` gets a ``(min, opt, max)`` range per graph role:

=========================== ========================================= =====================================
axis                        prefill                                   decode
=========================== ========================================= =====================================
``batch_size``              ``[build] batch``                         ``[build] batch``
``sequence_length``         ``[build] prompt_length``                 ``(1, 1, 1)``
``past_sequence_length``    ``(0, 0, max of [build] past_length)``    ``[build] past_length`` (concat)
``total_sequence_length``   past + sequence, element-wise             past + sequence, element-wise
``max_cache_length``        the manifest's ``max_cache_length`` for min = opt = max (static)
=========================== ========================================= =====================================

Fixed sizes (the latent width, ``1`` of the static cache's head axis) are kept as they are.
"""

from __future__ import annotations

from typing import Any

from ..errors import ArtifactError, ConfigError
from ..io_spec import BATCH, CAPACITY, PAST, SEQ, TOTAL
from ..recipe import BuildSettings

Range = tuple[int, int, int]
Shapes = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def axis_ranges(role: str, build: BuildSettings, cache_mode: str, capacity: int | None) -> dict[str, Range]:
    """``(min, opt, max)`` of every symbolic axis for ``role`` (``prefill`` or ``decode``).

    Raises:
        ConfigError: a static cache without a capacity, or a prompt range beyond the capacity.
    """
    if role not in ("prefill", "decode"):
        raise ConfigError(f"unknown graph role {role!r}; expected prefill or decode")
    seq: Range = tuple(build.prompt_length) if role == "prefill" else (1, 1, 1)
    ranges: dict[str, Range] = {BATCH: tuple(build.batch), SEQ: seq}
    if cache_mode == "static":
        if not capacity or capacity < 1:
            raise ConfigError("a static-cache artifact needs max_cache_length in its manifest")
        if build.prompt_length[2] > capacity:
            raise ConfigError(f"[build] prompt_length max {build.prompt_length[2]} exceeds the static cache "
                              f"capacity {capacity}")
        ranges[CAPACITY] = (capacity, capacity, capacity)
    else:
        past: Range = tuple(build.past_length) if role == "decode" else (0, 0, build.past_length[2])
        ranges[PAST] = past
        ranges[TOTAL] = tuple(p + s for p, s in zip(past, seq))
    return ranges


def input_shapes(shape: list | tuple, ranges: dict[str, Range], name: str = "?") -> Shapes:
    """``(min, opt, max)`` shapes of one input whose shape mixes ints and axis names.

    Raises:
        ArtifactError: an axis name that ``ranges`` does not know.
    """
    out: list[list[int]] = [[], [], []]
    for dim in shape:
        if isinstance(dim, str):
            if dim not in ranges:
                raise ArtifactError(f"input {name} has the axis {dim!r}, which no [build] range covers")
            values = ranges[dim]
        else:
            values = (int(dim),) * 3
        for i in range(3):
            out[i].append(int(values[i]))
    return tuple(out[0]), tuple(out[1]), tuple(out[2])


def build_settings_from_manifest(manifest: dict[str, Any]) -> BuildSettings:
    """The ``[build]`` section recorded in a manifest's recipe (defaults when there is none)."""
    raw = dict(manifest.get("recipe", {}).get("build", {}) or {})
    try:
        return BuildSettings(**raw)
    except TypeError as exc:
        raise ArtifactError(f"manifest.json [build]: {exc}") from None


def engine_profiles(manifest: dict[str, Any], build: BuildSettings | None = None) -> dict[str, dict[str, Shapes]]:
    """One profile per graph role: ``{role: {input name: (min, opt, max)}}``, in graph input order.

    Args:
        manifest: an artifact's ``manifest.json`` (its ``graphs``, ``cache`` and ``max_cache_length``).
        build: the ranges (default: the ``[build]`` section the manifest's recipe recorded).
    """
    build = build or build_settings_from_manifest(manifest)
    mode = manifest["cache"]["mode"]
    capacity = manifest.get("max_cache_length")
    profiles = {}
    for role, graph in manifest["graphs"].items():
        ranges = axis_ranges(role, build, mode, capacity)
        profiles[role] = {t["name"]: input_shapes(t["shape"], ranges, t["name"]) for t in graph["inputs"]}
    return profiles


def profiles_to_json(profiles: dict[str, dict[str, Shapes]]) -> dict:
    """``{role: {input: {"min": [...], "opt": [...], "max": [...]}}}`` for ``build.json``."""
    return {role: {name: dict(zip(("min", "opt", "max"), (list(s) for s in shapes))) for name, shapes in prof.items()}
            for role, prof in profiles.items()}


def polygraphy_profile(profile: dict[str, Shapes]):
    """A ``polygraphy.backend.trt.Profile`` (imports polygraphy, not TensorRT)."""
    from polygraphy.backend.trt import Profile

    out = Profile()
    for name, (lo, opt, hi) in profile.items():
        out.add(name, min=lo, opt=opt, max=hi)
    return out
