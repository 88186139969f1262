"""The PyTorch reference of an artifact: the original (non-absorbed, ``CC``) model in float32.

Rebuilt from the artifact itself: the manifest's model config (:attr:`Manifest.config
<mla_deploy.artifact.Manifest.config>`) and its weights: a preset export's random weights rebuilt from their seed
and std (``kind == "random"``; artifacts of earlier versions stored them in ``reference.safetensors``, named by
``manifest.weights.file``, which is still read), or, for ``kind == "hf"``, the Hugging Face checkpoint at
``manifest.weights.path``, refused if its files changed since the export (their sizes and sampled hashes are recorded).
"""

from __future__ import annotations

from pathlib import Path

from ..artifact import Manifest
from ..errors import ArtifactError, CheckpointError, InputError


def load_reference_model(artifact_dir: str | Path, manifest: Manifest, quantized: bool = True):
    """The fp32 ``CC``-form :class:`~mla_deploy.model.decoder.MLAForCausalLM` an artifact was exported from.

    ``quantized`` (artifacts with quantized weights): the tensors the artifact holds quantized are replaced by
    their quantized-then-dequantized values (:meth:`mla_deploy.quant.Quantization.dequantize_state`), the weights
    the graphs compute with; False: the unquantized original.

    Raises:
        ArtifactError: no reference weights (an in-memory export), a missing or mismatched weights file,
            a checkpoint whose config differs from the manifest's.
        InputError: the fp32 reference does not fit the available memory (:func:`require_memory`).
    """
    require_memory(manifest.config)
    weights = manifest.weights
    if weights.file:
        model = _from_file(Path(artifact_dir) / weights.file, manifest)
    elif weights.kind == "random":
        from ..model import build_model

        if weights.seed is None or weights.std is None:
            raise ArtifactError("manifest.json records random weights without their seed and std")
        model = build_model(manifest.config, "CC", std=weights.std, seed=weights.seed)  # the export's own draw
    elif weights.kind == "hf":
        model = _from_checkpoint(manifest)
    else:
        raise ArtifactError(f"manifest.json records weights of kind {weights.kind!r} and no reference file: "
                            f"there is nothing to validate against")
    model = model.float().eval()
    state = model.state_dict()
    missing = manifest.quantization.unknown_keys(state)
    if missing:
        raise ArtifactError(f"manifest.json quantizes {missing[0]}, which the model does not have")
    if quantized:
        manifest.quantization.dequantize_state(state, manifest.config)  # float weights: nothing to do
    return model


def require_memory(config) -> None:
    """Refuse, before reading any weight, a reference that cannot fit this machine's available memory (building it
    anyway ends with the kernel killing the process: a full-size DeepSeek-V2-Lite is 59 GiB in fp32).

    Raises:
        InputError: naming what it needs and what is available."""
    from ..host import available_memory
    from ..weight_bytes import PROCESS_OVERHEAD, weight_groups

    need, available = weight_groups(config, 4).total_bytes + PROCESS_OVERHEAD, available_memory()
    if available is not None and need > available:
        raise InputError(f"validating {config.name} needs its fp32 PyTorch reference, about {need / 2**30:.1f} GiB, "
                         f"and {available / 2**30:.1f} GiB are available; validate on a machine with that much memory "
                         f"(here: a preset's first layers, `export --preset NAME --layers N`)")


def _from_file(path: Path, manifest: Manifest):
    """The model of the reference weights file ``path`` (artifacts of earlier versions)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from ..model.decoder import MLAForCausalLM

    if not path.is_file():
        raise ArtifactError(f"the reference weights {path} named by manifest.json are missing")
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise ArtifactError(f"{path} is not a readable safetensors file ({exc})") from None
    model = MLAForCausalLM(manifest.config, "CC")
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise ArtifactError(f"{path} does not hold the weights of the manifest's model: {first}") from None
    return model


def _from_checkpoint(manifest: Manifest):
    """The Hugging Face checkpoint the manifest names, refused if it changed since the export."""
    import torch

    from ..checkpoint import CheckpointTensors, load_checkpoint

    weights = manifest.weights
    path = Path(str(weights.path or ""))
    if not weights.path or not path.exists():
        raise ArtifactError(f"the checkpoint {weights.path!r} named by manifest.json is not there; "
                            f"the PyTorch reference needs it")
    if weights.files is not None:
        try:
            now = CheckpointTensors(path).identity()
        except CheckpointError as exc:
            raise ArtifactError(f"the reference checkpoint cannot be read: {exc}") from None
        if [dict(f) for f in weights.files] != now:
            raise ArtifactError(f"the checkpoint at {path} changed since the export (its files differ from those "
                                f"manifest.json records); re-export it or validate against the original")
    try:
        model = load_checkpoint(path, form="CC", dtype=torch.float32)
    except CheckpointError as exc:
        raise ArtifactError(f"the reference checkpoint cannot be loaded: {exc}") from None
    ours = {k: v for k, v in manifest.config.to_dict().items() if k != "name"}
    theirs = {k: v for k, v in model.config.to_dict().items() if k != "name"}
    if ours != theirs:
        diff = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
        raise ArtifactError(f"the checkpoint at {path} does not match manifest.json's model ({', '.join(diff)})")
    return model
