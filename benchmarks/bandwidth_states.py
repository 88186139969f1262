"""python benchmarks/bandwidth_states.py [--probes 20] [--every 5] [--threads 2] [--mib 512] [--json FILE]: the read
bandwidth this machine gives over time, as a series of mla-deploy's own probes (the bench's bound,
:func:`mla_deploy.bench.machine.read_bandwidth`: several kernels, threads pinned, huge pages advised), one every
``--every`` seconds.

Why: on the development machine the bandwidth moves between two states that last seconds to minutes (about 36 and
about 64 GB/s with 2 threads), so an engine timed in one state and its peer in the other differ by up to 1.8x
whatever their code. This prints each probe's best kernel and figure, then the median, the lowest and highest, and
how many probes lay nearer the highest than the lowest; ``benchmarks/compare_llama_cpp.sh --rounds`` is the answer to it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def _at_least(minimum: int, kind=int):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a number >= {minimum}, got {text!r}")
        return value
    return parse


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/bandwidth_states.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--probes", type=_at_least(1), default=20, help="how many probes (default 20)")
    p.add_argument("--every", type=_at_least(0, float), default=5.0, help="seconds between probes (default 5)")
    p.add_argument("--threads", type=_at_least(1), default=2, help="threads (default 2)")
    p.add_argument("--mib", type=_at_least(1), default=512, help="the probe's buffer in MiB (default 512)")
    p.add_argument("--json", type=Path, default=None, help="also write the series to this file")
    args = p.parse_args(argv)
    from mla_deploy.bench.machine import read_bandwidth

    series = []
    for i in range(args.probes):
        if i:
            time.sleep(args.every)
        probe = read_bandwidth(args.threads, args.mib)
        series.append({"seconds": round(time.monotonic(), 1), "read_gbps": round(probe["read_gbps"], 2),
                       "kernel": probe["read_kernel"]})
        print(f"probe {i + 1:3d}: {probe['read_gbps']:6.1f} GB/s ({probe['read_kernel']})", flush=True)
    values = sorted(s["read_gbps"] for s in series)
    low, high = values[0], values[-1]
    median = statistics.median(values)
    nearer_high = sum(1 for v in values if v - low > high - v)
    print(f"{len(values)} probes, {args.threads} threads, {args.mib} MiB: median {median:.1f} GB/s, lowest {low:.1f}, "
          f"highest {high:.1f}; {nearer_high} of {len(values)} nearer the highest")
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "mib": args.mib, "every": args.every,
                                         "series": series}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
