"""TensorRT optimisation profiles from a recipe's ``[build]`` ranges and an artifact's manifest (pure Python).

Every symbolic axis of :mod:`mla_deploy.io_spec` gets a ``(min, opt, max)`` range per graph role, as the cache
layout decides (:meth:`mla_deploy.cache_layout.CacheLayout.axis_ranges`):

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

from typing import TYPE_CHECKING

from ..cache_layout import CacheLayout, get_layout
from ..errors import ArtifactError
from ..recipe import BuildSettings

if TYPE_CHECKING:
    from ..artifact import Manifest

Range = tuple[int, int, int]
Shapes = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def axis_ranges(role: str, build: BuildSettings, layout: CacheLayout | str, capacity: int | None) -> dict[str, Range]:
    """``(min, opt, max)`` of every symbolic axis for ``role`` (``prefill`` or ``decode``): the layout's
    :meth:`~mla_deploy.cache_layout.CacheLayout.axis_ranges`.

    Args:
        layout: the artifact's cache layout (or its mode name).
        capacity: the artifact's capacity (a fixed-capacity layout needs one).
    Raises:
        ConfigError: an unknown role, a static cache without a capacity, or a prompt range beyond the capacity.
    """
    return get_layout(layout).axis_ranges(role, build, capacity)


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


def engine_profiles(manifest: Manifest, build: BuildSettings | None = None) -> dict[str, dict[str, Shapes]]:
    """One profile per graph role: ``{role: {input name: (min, opt, max)}}``, in graph input order.

    Args:
        manifest: an artifact's :class:`~mla_deploy.artifact.Manifest` (its graphs, cache layout and capacity).
        build: the ranges (default: the ``[build]`` section the manifest's recipe recorded).
    Raises:
        ConfigError: ranges that do not fit the layout. ArtifactError: an input axis no range covers.
    """
    build = build or manifest.build_settings()
    profiles = {}
    for role, graph in manifest.graphs.items():
        ranges = axis_ranges(role, build, manifest.layout, manifest.capacity)
        profiles[role] = {t.name: input_shapes(t.shape, ranges, t.name) for t in graph.inputs}
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
