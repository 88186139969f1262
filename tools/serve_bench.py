"""The serving benchmark: start `mla-deploy serve` on an artifact, drive it through real HTTP with the `openai`
client at several concurrencies, print one table.

    python tools/serve_bench.py ARTIFACT [--concurrency 1,4,16] [--requests 3] [--prompt-length 16]
        [--max-tokens 48] [--threads N] [--max-cache-length N] [--json FILE]

Each of ``c`` clients sends ``--requests`` streamed completions one after another (token-id prompts of
``--prompt-length`` ids drawn from the tokenizer's vocabulary, seeded; greedy; exactly ``--max-tokens`` new tokens
unless a sequence meets its end-of-sequence id), after one warm-up request. Per concurrency: generated tokens
per second of wall time for all clients together, its ratio to concurrency 1, mean time to first token and mean
inter-token latency (the server's histograms: when a token reaches its request), the mean rows per decode step,
and the client's request latency p50/p90. At concurrency 1 it also reports the server's own overhead: the share
of the wall time not spent in engine steps (HTTP, tokenization, scheduling, the client's turn-around).
The server runs with ``--max-batch`` = the largest concurrency.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np

COUNTERS = ("mla_deploy_time_to_first_token_seconds_sum", "mla_deploy_time_to_first_token_seconds_count",
            "mla_deploy_inter_token_latency_seconds_sum", "mla_deploy_inter_token_latency_seconds_count",
            "mla_deploy_decode_rows_total", "mla_deploy_decode_steps_total", "mla_deploy_engine_seconds_total",
            "mla_deploy_generated_tokens_total")


def ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",")]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"positive integers, comma-separated, got {text!r}")
    return values


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact")
    p.add_argument("--concurrency", type=ints, default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=3, help="requests per client, one after another")
    p.add_argument("--prompt-length", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=None, help="the server's ONNX Runtime threads")
    p.add_argument("--max-cache-length", type=int, default=None, help="the server's tokens per row")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    return p


class Server:
    """A `mla-deploy serve` process on a free port of 127.0.0.1 (stopped with SIGTERM)."""

    def __init__(self, args):
        argv = [sys.executable, "-m", "mla_deploy", "serve", args.artifact, "--port", "0",
                "--max-batch", str(max(args.concurrency))]
        argv += ["--threads", str(args.threads)] if args.threads else []
        argv += ["--max-cache-length", str(args.max_cache_length)] if args.max_cache_length else []
        self.process = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
        line = self.process.stderr.readline()
        match = re.search(r"serving (\S+) at (http://\S+/v1)", line)
        if not match:
            self.process.wait(10)
            sys.exit(f"serve_bench: the server did not start: {(line + self.process.stderr.read()).strip()}")
        self.model, self.base = match.group(1), match.group(2)

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(self.base[: -len("/v1")] + "/metrics", timeout=60).read().decode()
        return {name: float(re.search(rf"^{name} (\S+)$", text, re.M).group(1)) for name in COUNTERS}

    def stop(self) -> int:
        self.process.terminate()
        return self.process.wait(120)


def load(server: Server, clients: int, args, vocabulary: int, rng: np.random.Generator) -> dict:
    """One concurrency: ``clients`` threads, ``args.requests`` streamed requests each. Returns the table's row."""
    from openai import OpenAI

    prompts = rng.integers(0, vocabulary, (clients, args.requests, args.prompt_length)).tolist()
    latencies, tokens, errors, lock = [], [0], [], threading.Lock()

    def client(i: int) -> None:
        api = OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=3600)
        for prompt in prompts[i]:
            start = time.perf_counter()
            try:
                stream = api.completions.create(model=server.model, prompt=prompt, max_tokens=args.max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True})
                used = sum(chunk.usage.completion_tokens for chunk in stream if chunk.usage)
            except Exception as exc:  # counted and shown: a benchmark reports failures, it does not hide them
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}")
                continue
            with lock:
                latencies.append(time.perf_counter() - start)
                tokens[0] += used

    before = server.metrics()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    delta = {k: v - before[k] for k, v in server.metrics().items()}
    mean = lambda name: delta[f"{name}_sum"] / delta[f"{name}_count"] if delta[f"{name}_count"] else float("nan")  # noqa: E731
    return {"concurrency": clients, "requests": clients * args.requests, "errors": len(errors),
            "first_error": errors[0] if errors else None, "tokens": tokens[0], "seconds": wall,
            "tokens_per_second": tokens[0] / wall,
            "ttft_ms": 1e3 * mean("mla_deploy_time_to_first_token_seconds"),
            "inter_token_ms": 1e3 * mean("mla_deploy_inter_token_latency_seconds"),
            "rows_per_step": delta["mla_deploy_decode_rows_total"] / max(1.0, delta["mla_deploy_decode_steps_total"]),
            "engine_share": delta["mla_deploy_engine_seconds_total"] / wall,
            "latency_p50_s": float(np.percentile(latencies, 50)) if latencies else float("nan"),
            "latency_p90_s": float(np.percentile(latencies, 90)) if latencies else float("nan")}


def table(rows: list[dict]) -> str:
    single = next((r["tokens_per_second"] for r in rows if r["concurrency"] == 1), None)
    lines = ["| concurrency | tok/s (all clients) | x concurrency 1 | mean TTFT ms | mean inter-token ms | rows/step | "
             "request p50 s | request p90 s | errors |", "|" + "---|" * 9]
    for r in rows:
        ratio = f"{r['tokens_per_second'] / single:.2f}x" if single else ""
        lines.append(f"| {r['concurrency']} | {r['tokens_per_second']:.1f} | {ratio} | {r['ttft_ms']:.0f} | "
                     f"{r['inter_token_ms']:.1f} | {r['rows_per_step']:.1f} | {r['latency_p50_s']:.2f} | "
                     f"{r['latency_p90_s']:.2f} | {r['errors']} |")
    one = next((r for r in rows if r["concurrency"] == 1), None)
    if one is not None:
        lines.append(f"\nat concurrency 1 the engine's steps took {100 * one['engine_share']:.1f}% of the wall time: "
                     f"the server's own overhead (HTTP, tokenization, scheduling, the client) is "
                     f"{100 * (1 - one['engine_share']):.1f}%")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    from mla_deploy.artifact import load_manifest
    from mla_deploy.generate import load_tokenizer

    tokenizer = load_tokenizer(args.artifact)
    if tokenizer is None:
        sys.exit(f"serve_bench: {args.artifact} has no tokenizer files (mla-deploy serve needs them)")
    vocabulary = min(tokenizer.backend.get_vocab_size(), load_manifest(args.artifact).config.vocab_size)
    server = Server(args)
    try:
        rng = np.random.default_rng(args.seed)
        load(server, 1, argparse.Namespace(**{**vars(args), "requests": 1}), vocabulary, rng)  # warm-up
        rows = [load(server, c, args, vocabulary, rng) for c in args.concurrency]
    finally:
        status = server.stop()
    print(table(rows))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)
    if status != 0:
        print(f"serve_bench: the server exited {status} at SIGTERM", file=sys.stderr)
    return 1 if status != 0 or any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
