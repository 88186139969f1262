"""python -m llama_compare.burst_worker ARTIFACT THREADS CAPACITY: our side of the interleaved decode
(:mod:`.interleaved`), one process holding the engine open across bursts, as ``llama-stepper`` holds llama.cpp's.

It opens ``ARTIFACT`` as ``mla-deploy run`` does (:class:`~mla_deploy.ort.engine.OrtEngine`, its CPU engine
where built, its weights faulted in; a cache of ``CAPACITY`` rows where the layout has one), warms it as
:mod:`.paired_worker` does (:func:`~.paired_worker.open_warm`), prints ``{"ready": true}`` and answers requests on
standard input, one per line: ``DEPTH N`` times ``N`` decode steps of random tokens after a context of
``max(DEPTH, 1)`` random tokens and prints ``{"ns": T, "n_gen": N, "depth": DEPTH}``. The context is prefilled
(untimed) the first time a depth is asked for and kept: a later burst at the same depth starts again from it (a
fixed-capacity cache's lengths set back; the rows a burst wrote after it are written over), as ``llama-stepper``
removes its burst's tokens; a growing cache is prefilled again before each burst. A bad request or an engine error
prints ``{"error": "..."}``; end of input ends the process.
"""

from __future__ import annotations

import json
import sys

from . import paired_worker


class Bursts:
    """Timed bursts of decode steps on one engine, each after a kept context (see the module)."""

    def __init__(self, engine, seed: int = 0):
        import numpy as np

        self.engine, self.rng = engine, np.random.default_rng(seed)
        self.state = self.depth = self.lengths = None

    def burst(self, depth: int, steps: int) -> dict:
        """``steps`` timed decode steps of random tokens after ``depth`` tokens of context (at least one).

        Returns: ``{"ns", "n_gen", "depth"}``, ``ns`` the steps' own time, each ended by reading its logits.
        Raises: ValueError: the burst does not fit the engine's cache."""
        import numpy as np

        engine = self.engine
        rows = paired_worker.rows_for(depth, steps)
        if engine.capacity and rows > engine.capacity:
            raise ValueError(f"a burst of {steps} after {depth} tokens needs {rows} cache rows; the engine holds "
                             f"{engine.capacity}")
        if depth != self.depth or not engine.capacity:  # a growing (concat) cache cannot be set back: prefill again
            prompt = max(depth, 1)
            self.state = engine.new_state(1, rows)  # as large as the burst needs, as bench model's points
            engine.to_host(engine.prefill(self.rng.integers(0, engine.vocab_size, (1, prompt)), np.array([prompt]),
                                          self.state))
            self.depth, self.lengths = depth, self.state.lengths.copy()
        else:
            self.state.lengths[:] = self.lengths
        seconds = paired_worker.timed_steps(engine, self.state, self.rng.integers(0, engine.vocab_size, steps))
        return {"ns": round(seconds * 1e9), "n_gen": steps, "depth": depth}


def serve(bursts: Bursts, lines, write) -> None:
    """Answer each request line (``DEPTH N``) of ``lines`` with one JSON line through ``write``."""
    from mla_deploy.errors import MLADeployError

    for line in lines:
        try:
            depth, steps = (int(v) for v in line.split())
            if depth < 0 or steps < 1:
                raise ValueError
        except ValueError:
            write({"error": f"bad request (DEPTH N): {line.strip()[:60]!r}"})
            continue
        try:
            write(bursts.burst(depth, steps))
        except (MLADeployError, ValueError) as exc:
            write({"error": f"{type(exc).__name__}: {exc}"})


def main(argv: list[str]) -> int:
    from mla_deploy.errors import MLADeployError

    def write(reply: dict) -> None:
        print(json.dumps(reply), flush=True)

    artifact, (threads, capacity) = argv[0], map(int, argv[1:3])
    try:
        engine = paired_worker.open_warm(artifact, threads, capacity)
    except MLADeployError as exc:
        write({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    write({"ready": True})
    serve(Bursts(engine), sys.stdin, write)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
