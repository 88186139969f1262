"""Write a random checkpoint of any MLA model type with transformers' own class, at its config class's defaults.

    python samples/03_random_checkpoint/transformers_checkpoint.py OUT --type glm4_moe_lite [--layers N]
        [--set KEY=VALUE ...] [--seed 0]

The config is transformers' class for ``--type`` at its defaults (the real model's widths; mla-deploy's presets equal
them), cut to the first ``--layers`` decoder layers: per-layer lists (``mlp_layer_types``, ``layer_types``) are cut
with them and ``first_k_dense_replace`` kept within them. ``--set`` changes a key (JSON values: ``--set
hidden_size=64``). The model is built in bfloat16 in memory, so N layers must fit (GLM-4.7-Flash's first 4 layers:
5.3 GB); ``save_pretrained`` writes what transformers itself publishes, which is what llama.cpp's converter and
``mla-deploy export --hf`` read. The folder appears only when complete.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

#: per-layer lists transformers' MLA configs carry, cut with the layers
PER_LAYER = ("mlp_layer_types", "layer_types")


def config_for(model_type: str, layers: int | None, settings: dict):
    """transformers' config of ``model_type`` at its defaults, cut to ``layers`` and changed by ``settings``."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    text = getattr(config, "text_config", None) or config
    if layers is not None:
        if layers > text.num_hidden_layers:
            raise ValueError(f"--layers {layers}: {model_type} has {text.num_hidden_layers}")
        text.num_hidden_layers = layers
        for key in PER_LAYER:
            if isinstance(getattr(text, key, None), list):
                setattr(text, key, getattr(text, key)[:layers])
        if isinstance(getattr(text, "first_k_dense_replace", None), int):
            text.first_k_dense_replace = min(text.first_k_dense_replace, layers)
    for key, value in settings.items():
        if not hasattr(text, key):
            raise ValueError(f"--set {key}: {model_type}'s config has no such key")
        setattr(text, key, value)
    return config


def _setting(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the checkpoint folder to create")
    parser.add_argument("--type", required=True, help="transformers' model_type (glm4_moe_lite, deepseek_v32, ...)")
    parser.add_argument("--layers", type=int, help="keep the first N decoder layers")
    parser.add_argument("--set", type=_setting, action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        print(f"transformers_checkpoint: error: {args.out} exists and is not an empty folder", file=sys.stderr)
        return 1
    if args.layers is not None and args.layers < 1:
        print(f"transformers_checkpoint: error: --layers must be at least 1, got {args.layers}", file=sys.stderr)
        return 1
    import torch
    from transformers import AutoModelForCausalLM

    try:
        config = config_for(args.type, args.layers, dict(args.set))
    except (ValueError, KeyError) as exc:
        print(f"transformers_checkpoint: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    torch.manual_seed(args.seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: a float32 model would need twice the memory
    try:
        model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(default)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{args.out.name}.", dir=args.out.parent))
    try:
        model.save_pretrained(tmp, max_shard_size="5GB")
        if args.out.exists():
            args.out.rmdir()
        tmp.rename(args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: {config.model_type}, {params / 1e9:.2f} B parameters, bf16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
