"""The serving benchmark: start `mla-deploy serve` on an artifact (and, with --llama-server, llama.cpp's
`llama-server` on a GGUF of the same checkpoint), drive each through real HTTP with the `openai` client at several
concurrencies, and run the same prompts through `mla-deploy run` as one batch (no server); print one table.

    python benchmarks/serve_bench.py ARTIFACT [--concurrency 1,4,16,64] [--requests 3] [--prompt-length 16]
        [--max-tokens 48] [--threads N] [--max-cache-length N] [--llama-server BIN --gguf FILE] [--no-run]
        [--json FILE]
    python benchmarks/serve_bench.py ARTIFACT --features [--system-length 1000] [--hits 5] [--long-prompt 2000]
        [--long-count 3] [--streams 4] [--prefill-chunk auto,64] [--threads N] [--json FILE]

Each of ``c`` clients sends ``--requests`` streamed completions one after another (token-id prompts of ``--prompt-
length`` ids drawn from the tokenizer's vocabulary, seeded, the same for every server; greedy; exactly ``--max-
tokens`` new tokens unless a sequence meets its end-of-sequence id), after a warm-up (a prompt as long as a row,
whose prefill reads nearly every expert, then one request like the timed ones). The servers run side by side, each
concurrency on each in turn (then through `mla-deploy run`), so that a drift of the machine's speed falls on all
alike. Per server and concurrency: generated tokens per second of wall time for all clients together, its ratio to
the same server at concurrency 1, the mean time to first token and the mean inter-token latency as the client sees
them (the first streamed text; the rest of the stream over its tokens), and the request latency p50/p90. For mla-
deploy also the mean rows per decode step and, at concurrency 1, the server's own overhead: the share of the wall
time not spent in engine steps (HTTP, tokenization, scheduling, the client's turn-around). Each server has as many
rows (``--max-batch``; llama-server's ``-np`` slots) as the largest concurrency, each row ``--prompt-length + --max-
tokens + 8`` tokens unless --max-cache-length says otherwise; both get ``--threads``.

With ``--features`` it measures the prefix cache and chunked prefill instead, two servers of each kind side by side
(token-id prompts drawn from the vocabulary, seeded; greedy):

* prefix cache: a shared system prompt of ``--system-length`` tokens followed by a distinct 16-token question,
  ``--hits`` + 1 requests of one new token each, sent to a server with ``--prefix-cache-mb 0`` and one with the
  prefix cache in turn; the time to first token as the client sees it, the cached server's first request (its miss)
  apart, and the ratio of the uncached server's mean to the cached server's mean over its hits;
* chunked prefill: ``--streams`` clients stream from short prompts; once each has its first tokens (and ``--steady``
  seconds of steady state, long enough for several decode steps), ``--long-count`` prompts of ``--long-prompt``
  tokens arrive one after another (each 0.2 s after the previous one's first token), then the streams close. The
  gaps between the running streams' chunks as the client sees them while the long prompts arrive (p50, p99, the
  largest; the steady state's p50 and p99 before, and its p50 for ``--steady`` seconds after, the streams' rows
  deeper then; and the p99 over either steady p50: the serving target is within 1.5x), on a server with
  ``--prefill-chunk 0`` (a prompt whole) and one per entry of ``--prefill-chunk`` (``auto``: ``--prefill-chunk auto``,
  the time-budgeted chunk; N: ``--prefill-chunk N``), and the long prompts' mean time to first token on each. The
  issue's case is ``--streams 16``.

The ``mla-deploy run`` rows are the engine alone: each client's first prompt, all ``c`` of them as one static
batch (one prefill, then decode steps over every row), timed by ``run --json`` from its prefill to its last token:
what batching gives without a server or sequences joining and leaving.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np

#: the server's counters a row reads (rows per decode step, the engine's share of the wall time)
COUNTERS = ("mla_deploy_decode_rows_total", "mla_deploy_decode_steps_total", "mla_deploy_engine_seconds_total")


def ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"positive integers, comma-separated, got {text!r}")
    return values


def chunk_specs(text: str) -> list[str]:
    """``--prefill-chunk``: comma-separated ``auto`` or positive token counts."""
    specs = [v.strip() for v in text.split(",")]
    if not all(v == "auto" or (v.isdigit() and int(v) > 0) for v in specs):
        raise argparse.ArgumentTypeError(f"auto or positive integers, comma-separated, got {text!r}")
    return specs


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a positive integer, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact")
    p.add_argument("--concurrency", type=ints, default=[1, 4, 16, 64])
    p.add_argument("--requests", type=positive, default=3, help="requests per client, one after another")
    p.add_argument("--prompt-length", type=positive, default=16)
    p.add_argument("--max-tokens", type=positive, default=48)
    p.add_argument("--threads", type=positive, default=None, help="each server's threads")
    p.add_argument("--max-cache-length", type=positive, default=None,
                   help="tokens per row (default: what a request needs, --prompt-length + --max-tokens + 8)")
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary, run beside mla-deploy")
    p.add_argument("--gguf", default=None, help="with --llama-server: the GGUF of the same checkpoint")
    p.add_argument("--no-run", action="store_true", help="leave out the `mla-deploy run` rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    p.add_argument("--features", action="store_true",
                   help="measure the prefix cache and chunked prefill instead of the concurrency table")
    p.add_argument("--system-length", type=positive, default=1000, help="--features: the shared system prompt")
    p.add_argument("--hits", type=positive, default=5, help="--features: requests after the prefix cache's miss")
    p.add_argument("--long-prompt", type=positive, default=2000, help="--features: the prompt arriving mid-stream")
    p.add_argument("--long-count", type=positive, default=3, help="--features: long prompts, one after another")
    p.add_argument("--streams", type=positive, default=4, help="--features: streams running while they arrive")
    p.add_argument("--steady", type=float, default=2.0,
                   help="--features: seconds of the streams' steady state measured before the long prompts arrive")
    p.add_argument("--prefill-chunk", type=chunk_specs, default=["auto"],
                   help="--features: the chunked servers' chunks, beside a server with --prefill-chunk 0 (auto: "
                        "--prefill-chunk auto, the time-budgeted chunk)")
    return p


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MlaServer:
    """A `mla-deploy serve` process on a free port of 127.0.0.1 (stopped with SIGTERM)."""

    name = "mla-deploy"

    def __init__(self, args, rows: int | None = None, tokens: int | None = None, extra: tuple = ()):
        rows = rows or max(args.concurrency)
        argv = [sys.executable, "-m", "mla_deploy", "serve", args.artifact, "--port", "0",
                "--max-batch", str(rows), "--max-queue", str(4 * rows),
                "--max-cache-length", str(tokens or row_tokens(args)), *extra]
        argv += ["--threads", str(args.threads)] if args.threads else []
        self.process = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
        seen = []  # the announcement, after whatever a library printed before it
        while not seen or (seen[-1] and not re.search(r"serving \S+ at http://\S+/v1", seen[-1])):
            seen.append(self.process.stderr.readline())
        match = re.search(r"serving (\S+) at (http://\S+/v1)", seen[-1])
        if not match:
            self.process.wait(10)
            said = last_line("".join(seen), self.process.returncode)
            sys.exit(f"serve_bench: mla-deploy serve did not start: {said}")
        self.model, self.base = match.group(1), match.group(2)

    def metrics(self) -> dict[str, float]:
        return {name: self.counter(name) for name in COUNTERS}

    def counter(self, name: str) -> float:
        text = urllib.request.urlopen(self.base[: -len("/v1")] + "/metrics", timeout=60).read().decode()
        return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))

    def stop(self) -> int:
        self.process.terminate()
        return self.process.wait(120)


class LlamaServer:
    """llama.cpp's ``llama-server`` on a free port of 127.0.0.1: ``-np`` slots as the largest concurrency, each of
    the same tokens as ours (``-c`` is their sum), continuous batching (its default), ``-t``/``-tb`` threads."""

    name = "llama-server"

    def __init__(self, args):
        slots, port = max(args.concurrency), free_port()
        argv = [args.llama_server, "-m", args.gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
                "-c", str(slots * row_tokens(args)), "--no-webui", "--log-disable"]
        argv += ["-t", str(args.threads), "-tb", str(args.threads)] if args.threads else []
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.base, self.model = f"http://127.0.0.1:{port}/v1", "gguf"
        deadline = time.time() + 600
        while time.time() < deadline and self.process.poll() is None:  # 503 while the model loads
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200:
                    return
            except OSError:
                time.sleep(0.5)
        self.process.kill()
        self.process.wait()
        said = last_line(self.process.stderr.read(), self.process.returncode)
        sys.exit(f"serve_bench: llama-server did not start: {said}")

    def metrics(self) -> None:
        return None

    def stop(self) -> int:
        self.process.terminate()
        status = self.process.wait(120)
        return 0 if status in (0, -signal.SIGTERM) else status


def last_line(text: str, status: int | None) -> str:
    """What a process that failed said last (a line), else its exit status."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else f"exit status {status}"


def row_tokens(args) -> int:
    return args.max_cache_length or args.prompt_length + args.max_tokens + 8


def draw_prompts(args, vocabulary: int) -> tuple[list, dict[int, list]]:
    """The warm-up requests, ``[(prompts [1, 1, length], max_tokens)]``, and per concurrency ``c`` its prompts
    ``[c, requests, prompt_length]`` (seeded: the same for every server and for `mla-deploy run`). The warm-up is
    a prompt as long as a row holds (its prefill routes to nearly every expert, so that no server meets a weight
    for the first time while timed, as llama-bench's prompt test does for its points), then a request like the
    timed ones."""
    rng = np.random.default_rng(args.seed)
    warmup = [(rng.integers(0, vocabulary, (1, 1, row_tokens(args) - 2)).tolist(), 1),
              (rng.integers(0, vocabulary, (1, 1, args.prompt_length)).tolist(), args.max_tokens)]
    return warmup, {c: rng.integers(0, vocabulary, (c, args.requests, args.prompt_length)).tolist()
                    for c in args.concurrency}


def load(server, prompts: list, args, max_tokens: int) -> dict:
    """One concurrency: a thread per client of ``prompts [clients, requests, length]``, its requests of
    ``max_tokens`` streamed one after another. Returns the table's row."""
    from openai import OpenAI

    clients = len(prompts)
    latencies, firsts, gaps, tokens, errors, lock = [], [], [], [0], [], threading.Lock()

    def one(api, prompt) -> None:
        start, first, used, last = time.perf_counter(), None, 0, None
        stream = api.completions.create(model=server.model, prompt=prompt, max_tokens=max_tokens,
                                        temperature=0, stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                last = time.perf_counter()
                first = first or last
            used = chunk.usage.completion_tokens if chunk.usage else used
        with lock:
            latencies.append(time.perf_counter() - start)
            tokens[0] += used
            if first is not None:
                firsts.append(first - start)
                if used > 1:
                    gaps.append((last - first) / (used - 1))

    def client(i: int) -> None:
        api = OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=3600)
        for prompt in prompts[i]:
            try:
                one(api, prompt)
            except Exception as exc:  # counted and shown: a benchmark reports failures, it does not hide them
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}")

    before = server.metrics()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    row = {"server": server.name, "concurrency": clients, "requests": sum(map(len, prompts)), "errors": len(errors),
           "first_error": errors[0] if errors else None, "tokens": tokens[0], "seconds": wall,
           "tokens_per_second": tokens[0] / wall, "ttft_ms": 1e3 * mean(firsts), "inter_token_ms": 1e3 * mean(gaps),
           "latency_p50_s": percentile(latencies, 50), "latency_p90_s": percentile(latencies, 90)}
    if before is not None:
        delta = {k: v - before[k] for k, v in server.metrics().items()}
        row["rows_per_step"] = delta["mla_deploy_decode_rows_total"] / max(1.0, delta["mla_deploy_decode_steps_total"])
        row["engine_share"] = delta["mla_deploy_engine_seconds_total"] / wall
    return row


def mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else float("nan")


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def table(rows: list[dict]) -> str:
    single = {r["server"]: r["tokens_per_second"] for r in rows if r["concurrency"] == 1}
    theirs = {r["concurrency"]: r["tokens_per_second"] for r in rows if r["server"] == "llama-server"}
    lines = ["| server | concurrency | tok/s (all clients) | x concurrency 1 | mla-deploy / llama-server | "
             "mean TTFT ms | mean inter-token ms | rows/step | request p50 s | request p90 s | errors |",
             "|" + "---|" * 11]
    for r in rows:
        ratio = f"{r['tokens_per_second'] / single[r['server']]:.2f}x" if single.get(r["server"]) else ""
        versus = (f"{r['tokens_per_second'] / theirs[r['concurrency']]:.2f}x"
                  if r["server"] == "mla-deploy" and theirs.get(r["concurrency"]) else "")
        steps = f"{r['rows_per_step']:.1f}" if "rows_per_step" in r else ""
        lines.append(f"| {r['server']} | {r['concurrency']} | {r['tokens_per_second']:.1f} | {ratio} | {versus} | "
                     f"{r['ttft_ms']:.0f} | {r['inter_token_ms']:.1f} | {steps} | {r['latency_p50_s']:.2f} | "
                     f"{r['latency_p90_s']:.2f} | {r['errors']} |")
    one = next((r for r in rows if r["concurrency"] == 1 and "engine_share" in r), None)
    if one is not None:
        lines.append(f"\nat concurrency 1 mla-deploy's engine steps took {100 * one['engine_share']:.1f}% of the wall "
                     f"time: the server's own overhead (HTTP, tokenization, scheduling, the client) is "
                     f"{100 * (1 - one['engine_share']):.1f}%")
    return "\n".join(lines)


def bench(args, warmup: list, prompts: dict[int, list]) -> tuple[list[dict], list[int]]:
    """Every server started and warmed up, then each concurrency run on each server in turn (and through `mla-deploy
    run`), so that a drift of the machine's speed during the run falls on all of them alike; the servers stopped.
    Returns the rows and the servers' exit statuses at SIGTERM."""
    servers, rows, statuses = [], [], []
    try:
        for make in (MlaServer, LlamaServer) if args.llama_server else (MlaServer,):
            servers.append(make(args))
            for prompt_set, tokens in warmup:
                load(servers[-1], prompt_set, args, tokens)
        for c in args.concurrency:
            rows += [load(server, prompts[c], args, args.max_tokens) for server in servers]
            rows += [] if args.no_run else [run_batch(args, prompts[c])]
    finally:
        for server in servers:
            statuses.append(server.stop())
            if statuses[-1] != 0:
                print(f"serve_bench: {server.name} exited {statuses[-1]} at SIGTERM", file=sys.stderr)
    order = {"mla-deploy": 0, "llama-server": 1, "mla-deploy run": 2}
    return sorted(rows, key=lambda r: (order[r["server"]], r["concurrency"])), statuses


def run_batch(args, prompts: list) -> dict:
    """`mla-deploy run` over each client's first prompt of ``prompts [clients, requests, prompt_length]`` as one
    batch (greedy, ``--max-tokens`` new tokens each): the table's row, timed by ``run --json``. Its rows hold the
    artifact's whole ``max_cache_length`` (`run` has no shorter row), where the servers' hold a request's tokens."""
    argv = [sys.executable, "-m", "mla_deploy", "run", args.artifact, "--max-new-tokens", str(args.max_tokens),
            "--json"]
    for client in prompts:
        argv += ["--prompt-ids", ",".join(map(str, client[0]))]
    argv += ["--threads", str(args.threads)] if args.threads else []
    result = subprocess.run(argv, capture_output=True, text=True)
    row = {"server": "mla-deploy run", "concurrency": len(prompts), "requests": len(prompts)}
    if result.returncode != 0:
        error = last_line(result.stderr, result.returncode)
        return {**row, "errors": len(prompts), "first_error": error, "tokens": 0, "seconds": float("nan"),
                "tokens_per_second": float("nan"), "ttft_ms": float("nan"), "inter_token_ms": float("nan"),
                "latency_p50_s": float("nan"), "latency_p90_s": float("nan")}
    report = json.loads(result.stdout)
    timings = report["timings"]
    tokens = sum(len(s["tokens"]) for s in report["sequences"])
    seconds = timings["time_to_first_token_s"] + timings["decode_s"]
    return {**row, "errors": 0, "first_error": None, "tokens": tokens, "seconds": seconds,
            "tokens_per_second": tokens / seconds, "ttft_ms": 1e3 * timings["time_to_first_token_s"],
            "inter_token_ms": 1e3 * timings["decode_s"] / max(1, timings["decode_steps"]),
            "latency_p50_s": seconds, "latency_p90_s": seconds}


def first_token(server, prompt: list[int], max_tokens: int = 1) -> float:
    """Seconds from sending a streamed completion of ``prompt`` (one new token by default) to its first event, over
    plain HTTP: the `openai` client's own handling of a body of a thousand ids takes tens of milliseconds here, which
    would hide what the server does."""
    body = json.dumps({"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True}).encode()
    request = urllib.request.Request(server.base + "/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=3600) as reply:
        reply.readline()  # the first event's line
        first = time.perf_counter() - start
        reply.read()
    return first


def prefix_rows(args, vocabulary: int) -> dict:
    """The prefix cache's time to first token on a shared system prompt (see the module docstring)."""
    rng = np.random.default_rng(args.seed)
    system = rng.integers(0, vocabulary, args.system_length).tolist()
    questions = rng.integers(0, vocabulary, (args.hits + 2, 16)).tolist()
    warm = rng.integers(0, vocabulary, args.system_length + 16).tolist()
    tokens = args.system_length + 16 + 2
    servers = {"off": MlaServer(args, 1, tokens, ("--prefix-cache-mb", "0")), "on": MlaServer(args, 1, tokens)}
    times: dict[str, list[float]] = {"off": [], "on": []}
    try:
        for server in servers.values():  # the shapes' first runs, on a prompt that shares nothing with the others
            first_token(server, warm)
        for question in questions[: args.hits + 1]:  # in turn, so that a drift of the machine falls on both
            for name, server in servers.items():
                times[name].append(first_token(server, system + question))
        hits = servers["on"].counter("mla_deploy_prefix_cache_hits_total")
    finally:
        for server in servers.values():
            server.stop()
    off, miss, hit = mean(times["off"][1:]), times["on"][0], mean(times["on"][1:])
    return {"system_tokens": args.system_length, "requests": args.hits, "ttft_off_ms": 1e3 * off,
            "ttft_miss_ms": 1e3 * miss, "ttft_hit_ms": 1e3 * hit, "speedup": off / hit, "tokens_reused": hits}


def chunk_rows(args, vocabulary: int) -> dict:
    """The running streams' chunk gaps while long prompts arrive, with and without chunked prefill."""
    import threading

    from openai import OpenAI

    rng = np.random.default_rng(args.seed + 1)
    shorts = rng.integers(0, vocabulary, (args.streams, 8)).tolist()
    longs = rng.integers(0, vocabulary, (args.long_count + 1, args.long_prompt)).tolist()
    tokens = args.long_prompt + 8
    servers = {"--prefill-chunk 0": MlaServer(args, args.streams + 1, tokens, ("--prefill-chunk", "0"))}
    for spec in args.prefill_chunk:
        label = "--prefill-chunk auto (time-budgeted)" if spec == "auto" else f"--prefill-chunk {spec}"
        servers[label] = MlaServer(args, args.streams + 1, tokens, ("--prefill-chunk", spec))
    out = {}
    try:
        for server in servers.values():
            first_token(server, longs[-1])  # the long prompt's shapes, once
            first_token(server, shorts[0], 4)
        for name, server in servers.items():
            seen_gaps, phase = {"steady": [], "arriving": [], "after": []}, ["steady"]
            lock, begun = threading.Lock(), [0]
            started, done = threading.Event(), threading.Event()

            def begin() -> None:
                with lock:
                    begun[0] += 1
                    if begun[0] == args.streams:
                        started.set()

            def stream(prompt) -> None:
                # request after request (one may end at an end-of-sequence id) until the long prompts are in; the
                # gaps are those within a request's stream
                api = OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=3600)
                seen = 0
                while not done.is_set():
                    last = None
                    for chunk in api.completions.create(model=server.model, prompt=prompt, max_tokens=tokens - 8,
                                                        temperature=0, stream=True):
                        now = time.perf_counter()
                        if last is not None:
                            with lock:
                                seen_gaps[phase[0]].append(now - last)
                        last, seen = now, seen + 1
                        if seen == 8:
                            begin()
                        if done.is_set():
                            break

            threads = [threading.Thread(target=stream, args=(p,)) for p in shorts]
            for thread in threads:
                thread.start()
            started.wait(600)  # every stream has its first chunks: the long prompts arrive now, one after another
            time.sleep(args.steady)  # the steady state's gaps
            phase[0] = "arriving"
            ttfts = []
            for prompt in longs[: args.long_count]:
                ttfts.append(first_token(server, prompt))
                time.sleep(0.2)
            phase[0] = "after"  # the steady state again, the streams' rows now deeper (a decode step costs more)
            time.sleep(args.steady)
            done.set()
            for thread in threads:
                thread.join()
            steady, gaps, after = seen_gaps["steady"], seen_gaps["arriving"], seen_gaps["after"]
            out[name] = {"steady_p50_ms": 1e3 * percentile(steady, 50), "steady_p99_ms": 1e3 * percentile(steady, 99),
                         "after_p50_ms": 1e3 * percentile(after, 50), "p50_ms": 1e3 * percentile(gaps, 50),
                         "p99_ms": 1e3 * percentile(gaps, 99), "max_ms": 1e3 * max(gaps), "gaps": len(gaps),
                         "long_ttft_ms": 1e3 * mean(ttfts),
                         "p99_over_steady": percentile(gaps, 99) / percentile(steady, 50),
                         "p99_over_after": percentile(gaps, 99) / percentile(after, 50)}
    finally:
        for server in servers.values():
            server.stop()
    whole = out["--prefill-chunk 0"]
    for row in out.values():
        row["p99_vs_whole"] = whole["p99_ms"] / row["p99_ms"]
    return {"long_prompt": args.long_prompt, "long_count": args.long_count, "streams": args.streams, "servers": out}


def features_table(prefix: dict, chunks: dict) -> str:
    lines = [f"## prefix cache: {prefix['system_tokens']}-token shared system prompt, {prefix['requests']} requests",
             "", "| server | mean TTFT ms |", "|---|---|",
             f"| --prefix-cache-mb 0 | {prefix['ttft_off_ms']:.1f} |",
             f"| prefix cache, first request (a miss) | {prefix['ttft_miss_ms']:.1f} |",
             f"| prefix cache, later requests (hits) | {prefix['ttft_hit_ms']:.1f} |", "",
             f"a hit's time to first token is {prefix['speedup']:.1f}x faster than without the prefix cache "
             f"({prefix['tokens_reused']:.0f} prompt tokens reused)", "",
             f"## chunked prefill: {chunks['long_count']} prompts of {chunks['long_prompt']} tokens arriving one after "
             f"another while {chunks['streams']} streams run", "",
             "| server | steady gap p50 ms | steady p99 ms | gap p50 ms | p99 ms | largest ms | steady p50 after ms | "
             "p99 / steady p50 | p99 / steady p50 after | p99 of --prefill-chunk 0 / this p99 | "
             "long prompts' mean TTFT ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in chunks["servers"].items():
        lines.append(f"| {label} | {r['steady_p50_ms']:.1f} | {r['steady_p99_ms']:.1f} | {r['p50_ms']:.1f} | "
                     f"{r['p99_ms']:.1f} | {r['max_ms']:.1f} | {r['after_p50_ms']:.1f} | {r['p99_over_steady']:.2f}x | "
                     f"{r['p99_over_after']:.2f}x | {r['p99_vs_whole']:.1f}x | {r['long_ttft_ms']:.0f} |")
    lines += ["", "the target: the running streams' p99 gap while long prompts arrive within 1.5x of the steady p50. A "
                  "gap is between two streamed pieces of text: a token whose text is not complete yet (part of a "
                  "character) comes with the next one, so a gap may span several decode steps, in the steady state too "
                  "(its p99)"]
    return "\n".join(lines)


def check(args) -> None:
    """Refuse in one line, before anything starts, what would fail later: a row too short for a request, a
    llama-server or GGUF that is not there, a --json file that cannot be written."""
    import os

    if args.max_cache_length is not None and args.max_cache_length < args.prompt_length + args.max_tokens + 2:
        sys.exit(f"serve_bench: --max-cache-length {args.max_cache_length} is shorter than a request needs "
                 f"(--prompt-length + --max-tokens + 2 = {args.prompt_length + args.max_tokens + 2})")
    if args.llama_server and not (os.path.isfile(args.llama_server) and os.access(args.llama_server, os.X_OK)):
        sys.exit(f"serve_bench: --llama-server {args.llama_server} is not an executable file")
    if args.gguf and not os.path.isfile(args.gguf):
        sys.exit(f"serve_bench: --gguf {args.gguf} is not a file")
    if args.json:
        folder = os.path.dirname(os.path.abspath(args.json))
        if os.path.isdir(args.json) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            sys.exit(f"serve_bench: --json {args.json} cannot be written")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    from mla_deploy.artifact import load_manifest
    from mla_deploy.generate import load_tokenizer

    if (args.llama_server is None) != (args.gguf is None):
        sys.exit("serve_bench: --llama-server and --gguf go together")
    check(args)
    from mla_deploy.errors import MLADeployError

    try:
        tokenizer = load_tokenizer(args.artifact)
        manifest = load_manifest(args.artifact)
    except MLADeployError as exc:
        sys.exit(f"serve_bench: {exc}")
    if tokenizer is None:
        sys.exit(f"serve_bench: {args.artifact} has no tokenizer files (mla-deploy serve needs them)")
    vocabulary = min(tokenizer.backend.get_vocab_size(), manifest.config.vocab_size)
    if args.features:
        prefix, chunks = prefix_rows(args, vocabulary), chunk_rows(args, vocabulary)
        print(features_table(prefix, chunks))
        if args.json:
            with open(args.json, "w") as out:
                json.dump({"prefix_cache": prefix, "chunked_prefill": chunks}, out, indent=2)
        return 0
    warmup, prompts = draw_prompts(args, vocabulary)
    rows, statuses = bench(args, warmup, prompts)
    print(table(rows))
    for r in rows:
        if r["errors"]:
            print(f"serve_bench: {r['server']} at concurrency {r['concurrency']}: {r['errors']} failed requests, the "
                  f"first: {r['first_error']}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)
    return 1 if any(statuses) or any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
