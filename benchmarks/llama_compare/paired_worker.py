"""python -m llama_compare.paired_worker ARTIFACT THREADS CAPACITY CONTEXT STEPS SEED: our side of one paired
decode (:mod:`.paired`), a fresh process per pair as llama-bench is.

It opens ``ARTIFACT`` as ``mla-deploy run`` does (:class:`~mla_deploy.ort.engine.OrtEngine`, its CPU engine
where built, its weights faulted in; a cache of ``CAPACITY`` rows where the layout has one), warms it (twice a
64-token prompt and 32 decode steps of random tokens: a first window after the engine opened ran at about 60% of the
later ones' speed on a 4-layer V2-Lite int4 engine), then times one window (:func:`window`) and prints one line,
``{"tokens_per_s": x, "steps": N, "seconds": t}``, or ``{"error": "..."}`` with exit status 1.
"""

from __future__ import annotations

import json
import sys
import time


def rows_for(context: int, steps: int) -> int:
    """The cache rows a :func:`window` after ``context`` tokens fills: its prompt (at least one token) and its
    steps."""
    return max(context, 1) + steps


def window(engine, context: int, steps: int, seed: int) -> dict:
    """``steps`` timed decode steps of random tokens after an untimed prompt of ``max(context, 1)`` random tokens,
    batch 1, as llama-bench's ``tg`` test after ``-d context``.

    Returns: ``{"tokens_per_s", "steps", "seconds"}`` (the steps' own time, each ended by reading its logits)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    vocab = engine.vocab_size
    prompt = max(context, 1)
    state = engine.new_state(1, rows_for(context, steps))
    engine.to_host(engine.prefill(rng.integers(0, vocab, (1, prompt)), np.array([prompt]), state))
    seconds = timed_steps(engine, state, rng.integers(0, vocab, steps))
    return {"tokens_per_s": steps / seconds, "steps": steps, "seconds": seconds}


def timed_steps(engine, state, tokens) -> float:
    """One decode step per token of ``tokens`` (batch 1) on ``state``; returns the steps' own seconds, each ended
    by reading its logits (what a window or a burst times)."""
    import numpy as np

    seconds = 0.0
    for token in tokens:
        start = time.perf_counter()
        engine.to_host(engine.decode(np.array([token]), state))
        seconds += time.perf_counter() - start
    return seconds


def open_warm(artifact: str, threads: int, capacity: int, seed: int = 0):
    """The engine as ``mla-deploy run`` opens it (a cache of ``capacity`` rows), warmed by two untimed windows (a
    64-token prompt and 32 steps, or what the cache holds). Raises what :class:`OrtEngine` raises."""
    from mla_deploy.ort.engine import OrtEngine

    engine = OrtEngine(artifact, threads=threads, capacity=capacity)
    room = engine.capacity or 96  # a static cache's rows (a small test model's may be fewer than 96)
    warm = min(64, room // 2)
    for warm_seed in (seed + 1, seed + 2):
        window(engine, warm, min(32, room - warm), warm_seed)
    return engine


def main(argv: list[str]) -> int:
    from mla_deploy.errors import MLADeployError

    artifact, (threads, capacity, context, steps, seed) = argv[0], map(int, argv[1:6])
    try:
        engine = open_warm(artifact, threads, capacity, seed)
        reply = window(engine, context, steps, seed)
    except MLADeployError as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
