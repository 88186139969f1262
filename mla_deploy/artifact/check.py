"""Integrity checks of an exported artifact directory, callable from any command that reads one.

:func:`check_artifact` goes further than :func:`~mla_deploy.artifact.manifest.load_manifest` (format, files
present, sizes): every graph's sha256 equals the manifest's, the manifest's inputs and outputs are those the
I/O contract (:meth:`mla_deploy.cache_layout.CacheLayout.io`) gives for its model config, cache layout and
precision, and each ONNX file's own graph inputs and outputs (names, element types, shapes) equal the
manifest's. The manifest's records of what the graphs were exported with are compared with what they hold: the
quantization record (:class:`mla_deploy.quant.Quantization`) with the quantized weights the graph files' nodes and
initializers hold (:func:`mla_deploy.quant.observe_graphs`, read without the weights), and the static cache's
capacity with the recorded recipe's. Any mismatch is an :class:`~mla_deploy.errors.ArtifactError` with a
one-line message.
"""

from __future__ import annotations

from pathlib import Path

from .. import expert_forms
from ..cache_layout import STATIC
from ..errors import ArtifactError
from ..io_spec import ROLES
from ..quant import layout_disagreement, observe_graphs
from ..recipe import GRAPH_FORMS
from .files import sha256_file
from .manifest import ATTENTIONS, MANIFEST, PLUGIN_DOMAIN, PLUGIN_OP, GraphEntry, Manifest, load_manifest


def check_artifact(artifact_dir: str | Path, verify_hashes: bool = True, check_graphs: bool = True,
                   verify_weights: bool = False) -> Manifest:
    """Check that an artifact is whole and self-consistent; return its manifest.

    Args:
        artifact_dir: the export directory (holding ``manifest.json``).
        verify_hashes: compare each graph file's and tokenizer file's sha256 with the manifest's (reads every byte
            of the graphs).
        check_graphs: parse each ONNX file (without external weights) and compare its I/O and its quantized
            weights with the manifest's.
        verify_weights: also hash the shared weights file (reads all of it: minutes for a full-size model; its
            size is always checked).
    Returns:
        the :class:`~mla_deploy.artifact.manifest.Manifest`.
    Raises:
        ArtifactError: a missing, truncated or replaced file; a manifest that does not describe the graphs or
            its own model config (a quantization record or a cache capacity edited included); a file that is not ONNX.
    """
    root = Path(artifact_dir)
    manifest = load_manifest(root)
    _check_capacity(manifest, root / MANIFEST)
    config, layout, precision = manifest.config, manifest.layout, manifest.precision
    inputs, outputs = layout.io(config, precision)
    layers = manifest.cache.get("layers")
    if isinstance(layers, list) and len(layers) != config.num_hidden_layers:
        raise ArtifactError(f"{MANIFEST}: cache lists {len(layers)} layers, the model has {config.num_hidden_layers}")
    expected = {"inputs": [t.to_dict() for t in inputs], "outputs": [t.to_dict() for t in outputs]}
    for role in ROLES:
        graph = manifest.graphs.get(role)
        if graph is None:
            raise ArtifactError(f"{MANIFEST} names no {role} graph")
        recorded = {"inputs": [t.to_dict() for t in graph.inputs], "outputs": [t.to_dict() for t in graph.outputs]}
        for kind in ("inputs", "outputs"):
            _same_io(f"{MANIFEST} {role} {kind}", recorded[kind], expected[kind],
                     f"the I/O contract of its model ({config.num_hidden_layers} layers, {layout.mode} cache, {precision})")
        path = root / graph.file
        if verify_hashes and graph.sha256 and sha256_file(path) != graph.sha256:
            raise ArtifactError(f"{role} graph {path} does not match the sha256 in {MANIFEST} (modified or replaced)")
    _check_descriptions(manifest)
    if check_graphs:
        _check_graph_files(root, manifest)
    if manifest.tokenizer is not None and verify_hashes:
        manifest.tokenizer.check(root, verify_hashes=True)
    data = manifest.weights_data
    if verify_weights and data is not None and data.get("sha256"):
        path = root / data["file"]
        if sha256_file(path) != data["sha256"]:
            raise ArtifactError(f"the weights file {path} does not match the sha256 in {MANIFEST} (modified)")
    return manifest


def _same_io(label: str, actual, expected: list[dict], against: str) -> None:
    if not isinstance(actual, list):
        raise ArtifactError(f"{label} are missing")
    names = [t.get("name") for t in actual]
    want = [t["name"] for t in expected]
    if names != want:
        diff = next((f"{a!r} where {b!r} is expected" for a, b in zip(names, want) if a != b),
                    f"{len(names)} tensors where {len(want)} are expected")
        raise ArtifactError(f"{label} do not match {against}: {diff}")
    for have, spec in zip(actual, expected):
        if have.get("dtype") != spec["dtype"] or list(have.get("shape", [])) != spec["shape"]:
            raise ArtifactError(f"{label}: {spec['name']} is {have.get('dtype')} {have.get('shape')}, "
                                f"{against} gives {spec['dtype']} {spec['shape']}")


#: the [cache] entries that describe the layout to a reader of the manifest (:meth:`CacheLayout.describe`)
_CACHE_FACTS = ("width", "channels", "sequence_axis", "layers", "aliased")


def _check_descriptions(manifest: Manifest) -> None:
    """What the manifest says about its cache and its graphs' attention forms must be what its model, layout and
    recorded recipe give: a reader of the manifest (another runtime) takes the cache's width and channel split from
    it. Entries an older manifest lacks are not compared."""
    config, layout = manifest.config, manifest.layout
    described = layout.describe(config)
    for key in _CACHE_FACTS:
        if key in manifest.cache and manifest.cache[key] != described[key]:
            raise ArtifactError(f"{MANIFEST}: cache {key} is {manifest.cache[key]!r}, but its model and {layout.mode} "
                                f"cache give {described[key]!r} (edited?)")
    export = manifest.recipe.get("export") if isinstance(manifest.recipe.get("export"), dict) else {}
    for role, graph in manifest.graphs.items():
        if graph.attention not in ATTENTIONS:
            raise ArtifactError(f"{MANIFEST}: the {role} graph's attention is {graph.attention!r}, not "
                                f"{' or '.join(ATTENTIONS)} (edited?)")
        recorded = export.get(f"{role}_form")
        if graph.form not in GRAPH_FORMS.get(role, ()) or (recorded is not None and graph.form != recorded):
            want = f"the {recorded!r} of its recorded recipe" if recorded is not None else " or ".join(GRAPH_FORMS[role])
            raise ArtifactError(f"{MANIFEST}: the {role} graph's form is {graph.form!r}, not {want} (edited?)")


def _check_capacity(manifest: Manifest, path: Path) -> None:
    """A static cache's capacity must be the one its graphs were exported with (the recorded recipe's
    ``[export] max_cache_length``; nothing to compare when the recipe is not recorded)."""
    recorded = (manifest.recipe.get("export") or {}).get("max_cache_length")
    if manifest.layout.mode == STATIC.mode and manifest.capacity is None:
        raise ArtifactError(f"{path}: a static cache needs its max_cache_length, and the manifest has none (edited?); "
                            f"export again")
    if manifest.capacity is not None and recorded is not None and recorded != manifest.capacity:
        raise ArtifactError(f"{path}: max_cache_length {manifest.capacity} is not the {recorded} its graphs were "
                            f"exported with (recipe.export.max_cache_length; edited?); export again with "
                            f"--max-cache-length {manifest.capacity}")


def _check_graph_files(root: Path, manifest: Manifest) -> None:
    """Each graph file's own I/O equals the manifest's, and the quantized weights they hold its record's."""
    models = {}
    for role, graph in manifest.graphs.items():
        if graph.file not in models:  # prefill and decode may be one file
            models[graph.file] = _check_onnx_io(root / graph.file, role, graph)
        plugins = _plugin_nodes(models[graph.file])
        if (plugins > 0) != graph.uses_plugin:
            raise ArtifactError(f"{root / MANIFEST} says its {role} graph's attention is {graph.attention!r}, but "
                                f"{graph.file} holds {plugins} {PLUGIN_OP} plugin nodes (edited?); export again")
        # a MoE model cut to its first (dense) layers, `export --layers N`, has no expert to fuse
        moe = any(manifest.config.is_moe_layer(i) for i in range(manifest.config.decoder_layers))
        reason = (expert_forms.disagreement(graph.experts, models[graph.file], moe)
                  or layout_disagreement(models[graph.file], manifest.precision))
        if reason:
            raise ArtifactError(f"{root / MANIFEST} does not describe its {role} graph {graph.file}: {reason} "
                                f"(edited?); export again")
    disagreement = manifest.quantization.disagreement(observe_graphs(models.values()))
    if disagreement:
        raise ArtifactError(f"{root / MANIFEST} does not describe its graphs: {disagreement} (edited?); export again")


def _plugin_nodes(model) -> int:
    """How many TensorRT decode-attention plugin nodes ``model`` holds (in its graph or its local functions)."""
    nodes = list(model.graph.node) + [n for f in model.functions for n in f.node]
    return sum(1 for n in nodes if (n.domain, n.op_type) == (PLUGIN_DOMAIN, PLUGIN_OP))


def _check_onnx_io(path: Path, role: str, graph: GraphEntry):
    """The ONNX file's graph inputs/outputs (name, element type, shape) must equal the manifest's; returns the
    ``ModelProto`` (its external weights not loaded)."""
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError, onnx's own errors
        raise ArtifactError(f"{role} graph {path} is not a readable ONNX file ({type(exc).__name__})") from None
    for kind, values in (("inputs", model.graph.input), ("outputs", model.graph.output)):
        actual = [_value_dict(v) for v in values]
        _same_io(f"{path.name} graph {kind}", actual, [t.to_dict() for t in getattr(graph, kind)], MANIFEST)
    return model


def _value_dict(value) -> dict:
    import onnx

    elem = value.type.tensor_type.elem_type
    try:
        dtype = "bfloat16" if elem == onnx.TensorProto.BFLOAT16 else onnx.helper.tensor_dtype_to_np_dtype(elem).name
    except (KeyError, ValueError, TypeError):
        dtype = f"onnx-elem-type-{elem}"
    shape = [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
    return {"name": value.name, "dtype": dtype, "shape": shape}
