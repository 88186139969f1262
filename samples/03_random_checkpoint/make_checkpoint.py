"""Write a checkpoint of a preset's shapes with random weights, in the layout transformers and DeepSeek publish.

    python samples/03_random_checkpoint/make_checkpoint.py OUT [--preset deepseek-v2-lite] [--layers N]
        [--dtype bf16|fp16|fp32] [--shard-gb 5] [--seed 0]

The full DeepSeek-V2-Lite shape (27 layers, 64 experts, 15.7 B parameters) is 31.4 GB in bf16; nothing is held in
memory beyond one tensor. Progress (bytes, rate, time left) goes to stderr.
"""

from __future__ import annotations

import argparse
import sys

from mla_deploy import load_recipe
from mla_deploy.errors import MLADeployError
from mla_deploy.random_checkpoint import DTYPES, write_random_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the checkpoint folder to create")
    parser.add_argument("--preset", default="deepseek-v2-lite", help="shapes of this preset (default: %(default)s)")
    parser.add_argument("--layers", type=int, help="keep the first N decoder layers")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--shard-gb", type=float, default=5.0, help="largest shard in GB (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        config = load_recipe(args.preset).model
        if args.layers is not None:
            config = config.first_layers(args.layers)

        def progress(done: int, total: int, seconds: float) -> None:
            rate = done / max(seconds, 1e-9)
            left = (total - done) / rate if rate else float("nan")
            print(f"\r{done / 1e9:7.2f} / {total / 1e9:.2f} GB  {rate / 1e6:6.0f} MB/s  {left:5.0f} s left",
                  end="", file=sys.stderr, flush=True)

        summary = write_random_checkpoint(config, args.out, dtype=args.dtype, shard_bytes=int(args.shard_gb * 1e9),
                                          seed=args.seed, progress=progress if sys.stderr.isatty() else None)
    except MLADeployError as exc:
        print(f"make_checkpoint: error: {exc}", file=sys.stderr)
        return 1
    if sys.stderr.isatty():
        print(file=sys.stderr)
    print(f"wrote {summary['path']}: {summary['tensors']} tensors, {summary['bytes'] / 1e9:.2f} GB in "
          f"{len(summary['files'])} file(s), {summary['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
