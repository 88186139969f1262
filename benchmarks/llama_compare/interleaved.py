"""Interleaved decode (``--interleave N``): both engines held open side by side, each timing a burst of ``-n``
decode steps in turn, ``N`` times per precision and context, the ratio taken between each two neighbouring bursts.

Why: this machine's read bandwidth moves between states (about 36 and 64 GB/s with 2 threads on the development
machine) that last seconds to minutes (``benchmarks/bandwidth_states.py``). A round (:mod:`.steps`) runs each engine's
whole bench minutes apart and a pair (:mod:`.paired`) opens each engine afresh, so both still meet different states
often: about half the pairs did. A burst takes a fraction of a second to a few seconds, so two neighbouring bursts
nearly always run at one bandwidth, and the median of many neighbours' ratios leaves the few that straddle a change
out. What the pairs cannot show, whether one engine is ahead by a few percent, these can.

Ours: the rounds' export of the precision (:meth:`.Settings.ours_artifact`) in a :mod:`.burst_worker` process (the
huge-page setting of mla-deploy's command line; weights faulted in, engine warmed). llama.cpp: ``llama-stepper``
(``stepper.cpp``, compiled against the build's own libraries by the ``stepper`` step), which times exactly what
``llama-bench -p 0 -n N -d DEPTH`` times (its ``test_gen`` after an untimed context of random tokens; llama-bench's
model and context settings and threadpool), with the model held open. Each keeps the context of a depth and starts
each burst again from it, as llama-bench does between its repetitions. A pause of :data:`PAUSE` before each burst
lets the other engine's threads stop spinning. Both warm with two untimed bursts at each
context; the order alternates (ours first in even bursts); a read probe before and after each series says which
state the machine was in.

Both engines are resident together, so the machine must hold both: 4 layers of V2-Lite at any precision do here,
the 27-layer int4 engine (10 GB) beside its Q4_0 file (8.9 GB) in 24 GiB only just.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from . import paired, paired_worker
from .settings import PRECISIONS, CompareError, Settings
from .table import section_markdown, section_text

HERE = Path(__file__).resolve().parent
#: llama.cpp's side, compiled by :func:`.steps.stepper`
STEPPER_SOURCE = HERE / "stepper.cpp"
#: seconds between two bursts: an engine's threads keep spinning for a while after its burst (llama.cpp's threadpool
#: polls for work for milliseconds at its default --poll 50, ONNX Runtime's workers spin too), and that spinning must
#: not run beside the other engine's burst on the same cores
PAUSE = 0.2


def stepper_path(s: Settings) -> Path:
    """Where the build keeps ``llama-stepper``, named by its source's digest: a changed source is compiled again."""
    digest = hashlib.sha256(STEPPER_SOURCE.read_bytes()).hexdigest()[:12]
    return s.build / "bin" / f"llama-stepper-{digest}"


class Worker:
    """A process answering ``DEPTH N`` requests with one JSON line each (``{"ns", "n_gen", "depth"}`` or
    ``{"error"}``), after a first ``{"ready": true}`` line; its standard error goes to ``log``."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict | None = None):
        self.name, self.log = name, log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._err = open(log, "w")
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
                                         text=True, env=env)
        except OSError as exc:
            self._err.close()
            raise CompareError(f"{name}: cannot run {argv[0]}: {exc.strerror}") from None
        self._reply("ready")

    def _reply(self, key: str) -> dict:
        line = self.proc.stdout.readline()
        try:
            reply = json.loads(line) if line.strip() else {}
        except ValueError:
            reply = {"error": f"unreadable reply {line.strip()[:80]!r}"}
        if key not in reply:
            self.close()
            why = reply.get("error") or self._last_error() or f"exited ({self.proc.returncode})"
            raise CompareError(f"{self.name}: {why}; log: {self.log}")
        return reply

    def _last_error(self) -> str:
        self._err.flush()
        lines = self.log.read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else ""

    def burst(self, depth: int, steps: int) -> float:
        """Tokens/s of ``steps`` decode steps after ``depth`` tokens; :class:`CompareError` when it fails."""
        try:
            self.proc.stdin.write(f"{depth} {steps}\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # the process is gone: _reply says why
        reply = self._reply("ns")
        return reply["n_gen"] / (reply["ns"] / 1e9)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._err.close()


def ours_worker(s: Settings, weights: str, capacity: int) -> Worker:
    argv = [sys.executable, "-m", "llama_compare.burst_worker", str(s.ours_artifact(weights)), str(s.threads),
            str(capacity)]
    return Worker(f"our burst worker ({weights})", argv, s.logs / f"interleaved-ours-{weights}.log",
                  paired.worker_environment())


def llama_worker(s: Settings, gguf: Path, n_ctx: int) -> Worker:
    argv = [str(stepper_path(s)), str(gguf), str(s.threads), str(n_ctx)]
    return Worker(f"llama-stepper ({gguf.name})", argv, s.logs / f"interleaved-llama-{gguf.stem}.log")


def summarize(bursts: list[dict], ours_bytes: float | None = None, llama_bytes: float | None = None) -> dict:
    """One precision and context's bursts (``{"ours_tokens_per_s", "llama_tokens_per_s"}`` each, neighbours).

    Returns: ``{"bursts", "ratio" (median of ours / llama.cpp over the neighbours), "quartiles" ([lower, upper]
    of those ratios), "ratio_range" ([lowest, highest]), "ahead" (how many ratios are at least 1), "ours_tokens_per_s",
    "llama_tokens_per_s" (medians), "ours_gbps", "llama_gbps" (the medians times the bytes a step reads, None
    where those are unknown)}``."""
    ratios = [b["ours_tokens_per_s"] / b["llama_tokens_per_s"] for b in bursts]
    out = {"bursts": len(bursts), "ratios": ratios, "ratio": statistics.median(ratios),
           "quartiles": statistics.quantiles(ratios, n=4)[::2] if len(ratios) > 1 else [ratios[0]] * 2,
           "ratio_range": [min(ratios), max(ratios)], "ahead": sum(r >= 1 for r in ratios)}
    for side, size in (("ours", ours_bytes), ("llama", llama_bytes)):
        speed = statistics.median(b[f"{side}_tokens_per_s"] for b in bursts)
        out[f"{side}_tokens_per_s"] = speed
        out[f"{side}_gbps"] = speed * size / 1e9 if size else None
    return out


def run(s: Settings, key: str, rows: list[dict], probe, echo) -> list[dict]:
    """``s.interleave`` neighbouring bursts per precision and context (the table's ``rows`` give each side's bytes
    per decode step); ``probe()``: one read-bandwidth probe (``{"read_gbps", ...}``). Returns one entry per precision
    and context: ``{"weights", "llama_type", "context", "probes" [before, after], "bursts": [...], **summarize()}``."""
    capacity = max(paired_worker.rows_for(c, s.generate) for c in s.contexts)
    out = []
    for weights in s.precisions:
        kind = PRECISIONS[weights]
        llama = ours = None
        try:
            llama = llama_worker(s, s.gguf(key, kind), capacity)
            ours = ours_worker(s, weights, capacity)
            for context in s.contexts:
                row = next((r for r in rows if r["weights"] == weights and r["context"] == context), {})
                for side in (ours, llama, ours, llama):  # untimed: the context, then a warm burst each
                    side.burst(context, s.generate)
                probes, bursts = [probe()["read_gbps"]], []
                for i in range(s.interleave):
                    order = [("ours", ours), ("llama", llama)][:: 1 if i % 2 == 0 else -1]
                    speed = {}
                    for side, worker in order:
                        time.sleep(PAUSE)
                        speed[side] = worker.burst(context, s.generate)
                    bursts.append({"first": order[0][0], "ours_tokens_per_s": speed["ours"],
                                   "llama_tokens_per_s": speed["llama"]})
                probes.append(probe()["read_gbps"])
                entry = {"weights": weights, "llama_type": kind, "context": context, "probes": probes,
                         "bursts": bursts, **summarize(bursts, row.get("ours_bytes_per_token"),
                                                       row.get("llama_bytes_per_token"))}
                out.append(entry)
                echo(f"[compare] interleaved {weights} @ {context}: {len(bursts)} neighbours, ours "
                     f"{entry['ours_tokens_per_s']:.1f}, llama.cpp {entry['llama_tokens_per_s']:.1f} tok/s, "
                     f"{entry['ratio']:.2f}x (middle half {entry['quartiles'][0]:.2f}-{entry['quartiles'][1]:.2f}x), "
                     f"probes {probes[0]:.1f}/{probes[1]:.1f} GB/s")
        finally:
            for worker in (ours, llama):
                if worker is not None:
                    worker.close()
    return out


HEAD = ("weights", "context", "neighbours", "ours tok/s", "llama.cpp tok/s", "ours / llama.cpp", "middle half",
        "lowest-highest", "ours ahead in", "ours GB/s", "llama.cpp GB/s", "probed GB/s (before, after)")


def _gbps(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def cells(entries: list[dict]) -> list[tuple[str, ...]]:
    return [(f"{e['weights']} / {e['llama_type']}", str(e["context"]), str(e["bursts"]),
             f"{e['ours_tokens_per_s']:.1f}", f"{e['llama_tokens_per_s']:.1f}", f"{e['ratio']:.2f}x",
             f"{e['quartiles'][0]:.2f}-{e['quartiles'][1]:.2f}x",
             f"{e['ratio_range'][0]:.2f}-{e['ratio_range'][1]:.2f}x", f"{e['ahead']} of {e['bursts']}",
             _gbps(e["ours_gbps"]), _gbps(e["llama_gbps"]), f"{e['probes'][0]:.1f}, {e['probes'][1]:.1f}")
            for e in entries]


TITLE = "Interleaved decode: both engines held open, a burst each in turn, the ratio taken between neighbours"
NOTES = ("Figures are medians over the neighbouring bursts; `middle half`: the ratios' quartiles; `ours ahead in`: the "
         "neighbours whose ratio is at least 1.00x. A burst is `-n` decode steps of random tokens after the context "
         "(llama.cpp: llama-bench's generation test in a process that holds the model open).")


def text(entries: list[dict]) -> str:
    return section_text(TITLE, HEAD, cells(entries), NOTES)


def markdown(entries: list[dict]) -> str:
    return section_markdown(TITLE, HEAD, cells(entries), NOTES)
