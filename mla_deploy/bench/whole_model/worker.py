"""One process of the whole-model bench: one role over a list of points. Run by the driver through the shared
harness (:mod:`..harness`) as ``python -m mla_deploy.bench.whole_model.worker JOB.json``; the result file is
rewritten after every point, so a process the kernel kills (out of memory) leaves what it finished and names the
point it was on.

Roles:

* ``ours``: :class:`~mla_deploy.engines.OrtEngine` on the artifact; times ``step("prefill")`` of the prompt and
  ``step("decode")`` + greedy choice per token after filling the context with prefill steps in chunks;
  records the tokens it fed.
* ``transformers``: ``AutoModelForCausalLM.from_pretrained(checkpoint, dtype=float32)``; times ``generate``
  (one new token for a prefill point; for a decode point, one call whose streamer timestamps every token).
* ``routing``: the PyTorch reference (absorbed form) on the same tokens (``ours``' tokens replayed, else its
  own greedy ones), with a forward hook on every MoE router recording the experts each step routes to.

* ``probe``: one bandwidth and GEMM probe (:func:`~..machine.probe`), in a process of its own so that the
  ONNX Runtime process never imports torch (its resident memory is what a user of the engine pays).

Each prints one progress line per point on stdout.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time

import numpy as np

from ... import host
from .. import machine
from ..harness import Results, failure, load_job, pin_torch_threads
from .cost import fill_chunk, point_bytes
from .spec import CONTEXT, PREFILL, WholeModelSpec, chunks, parse_point, prompt_ids, prompt_tokens


def _say(line: str) -> None:
    print(line, flush=True)


def _positions(batch: int, start: int, stop: int) -> np.ndarray:
    return np.ascontiguousarray(np.broadcast_to(np.arange(start, stop, dtype=np.int64), (batch, stop - start)))


def _last(batch: int, steps: int) -> np.ndarray:
    """``logits_index [B, 1]``: the logits of each sequence's last new token only (what generation needs)."""
    return np.full((batch, 1), steps - 1, dtype=np.int64)


class OursPath:
    """The exported artifact in ONNX Runtime. Args: the job (artifact folder, threads, capacity)."""

    def __init__(self, job: dict, spec: WholeModelSpec):
        from ...ort import OrtEngine

        self.engine = OrtEngine(job["artifact"], threads=spec.threads, capacity=job["capacity"], use_engine=spec.engine)
        self.spec, self.config = spec, self.engine.config
        self.itemsize = np.dtype(self.engine.dtype).itemsize
        info = self.engine.info()
        self.info = {"provider": self.engine.provider, "graphs": info["graphs"], "huge_pages": info["huge_pages"],
                     "mapped_weights": info.get("mapped_weights"),
                     "precision": self.engine.precision, "scales_half": info.get("scales_half", False),
                     **self.engine.manifest.quantization.run_info(),
                     "cache_mode": self.engine.cache_mode, "intra_op_threads": spec.threads,
                     "capacity": "the rows each point needs" if self.engine.layout.has_capacity else None}

    #: untimed prefills at most, and how close two in a row must be to call the weights warm
    WARM_RUNS, WARM_AGREE = 4, 0.1

    def warm(self) -> list[float]:
        """Untimed prefills of ``--prompt-length`` tokens before the first point, until two in a row take within
        10% of each other (at most :data:`WARM_RUNS`), so every point reads warm weights (the page cache, first
        touch of the mapped weights, a kernel's packing on first use), as llama-bench's points do after its prompt
        test in the same process. Without it the first decode steps in a fresh process read each newly routed
        expert cold: 2-10x slower, measured here on 4 layers of V2-Lite; a full-size engine read from disk took
        21.7 s for its first prefill and 12.8 s for its second. Returns each prefill's seconds."""
        ids = prompt_ids(self.config.vocab_size, 1, self.spec.prompt_length, self.spec.seed, PREFILL)
        seconds: list[float] = []
        while len(seconds) < self.WARM_RUNS:
            start = time.perf_counter()
            self.engine.step("prefill", ids, _positions(1, 0, ids.shape[1]), self._new_state(1, ids.shape[1]),
                             logits_index=_last(1, ids.shape[1]))
            seconds.append(time.perf_counter() - start)
            if len(seconds) >= 2 and abs(seconds[-1] - seconds[-2]) <= self.WARM_AGREE * seconds[-2]:
                break
        return seconds

    def _new_state(self, batch: int, rows: int):
        """An empty cache for ``batch`` sequences of at most ``rows`` rows: a fixed-capacity cache is made exactly
        that large (its steps attend to every slot, so a larger one would slow them down)."""
        return self.engine.new_state(batch, rows)

    def _greedy(self, logits) -> np.ndarray:
        return np.asarray(logits)[:, -1].argmax(-1).astype(np.int64)

    def _fill(self, ids: np.ndarray, state, chunk: int) -> np.ndarray:
        """Prefill ``ids [B, N]`` into ``state`` in chunks; returns the greedy next token ``[B]``."""
        for start, stop in chunks(ids.shape[1], chunk):
            logits = self.engine.step("prefill", ids[:, start:stop], _positions(len(ids), start, stop), state,
                                      logits_index=_last(len(ids), stop - start))
        return self._greedy(logits)

    def fits(self, batch: int, rows: int, chunk: int) -> tuple[int, bool]:
        need = point_bytes(self.config, batch, rows, chunk, self.itemsize)
        available = host.available_memory()
        return need, available is None or need <= self.spec.memory_fraction * available

    def prefill(self, batch: int) -> dict:
        spec = self.spec
        ids = prompt_ids(self.config.vocab_size, batch, spec.prompt_length, spec.seed, PREFILL)
        positions = _positions(batch, 0, spec.prompt_length)
        times = []
        for i in range(spec.warmup + spec.repeat):
            state = self._new_state(batch, spec.prompt_length)
            start = time.perf_counter()
            token = self._greedy(self.engine.step("prefill", ids, positions, state,
                                                  logits_index=_last(batch, spec.prompt_length)))
            if i >= spec.warmup:
                times.append(time.perf_counter() - start)
            del state
        return {"times_s": times, "first_tokens": token.tolist()}

    def decode(self, context: int, batch: int) -> dict:
        spec = self.spec
        prompt = prompt_ids(self.config.vocab_size, batch, prompt_tokens(context), spec.seed, CONTEXT)
        state = self._new_state(batch, prompt.shape[1] + spec.steps)
        start = time.perf_counter()
        token = self._fill(prompt, state, fill_chunk(self.config, batch, prompt.shape[1], self.itemsize))
        fill = time.perf_counter() - start
        fed, times, rows = [], [], []
        for i in range(spec.steps):
            fed.append(token)
            held = int(state.lengths.max())
            start = time.perf_counter()
            logits = self.engine.step("decode", token[:, None], state.lengths[:, None].copy(), state,
                                      logits_index=_last(batch, 1))
            token = self._greedy(logits)
            if i >= spec.warmup:
                times.append(time.perf_counter() - start)
                rows.append(held)
        return {"times_s": times, "fill_seconds": fill, "cache_rows": rows,
                "tokens": np.stack(fed, axis=1).tolist(), "next_tokens": token.tolist()}


class _Stamps:
    """A transformers streamer that records when each ``put`` arrives (the prompt first, then each token)."""

    def __init__(self):
        self.times, self.tokens = [], []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())
        self.tokens.append(value.reshape(value.shape[0], -1)[:, -1].tolist() if value.dim() > 1 else value.tolist())

    def end(self) -> None:
        pass


class TransformersPath:
    """transformers' own model and ``generate``. Args: the job (checkpoint folder)."""

    def __init__(self, job: dict, spec: WholeModelSpec):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        self.torch, self.spec = torch, spec
        self.model = AutoModelForCausalLM.from_pretrained(job["checkpoint"], dtype=torch.float32).eval()
        generation = self.model.generation_config
        generation.eos_token_id = None  # random weights: never stop early
        generation.pad_token_id = 0
        generation.do_sample = False
        self.vocab = self.model.config.vocab_size
        self.info = {"transformers": transformers.__version__, "torch_threads": torch.get_num_threads(),
                     "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
                     "class": type(self.model).__name__}

    def _generate(self, ids: np.ndarray, new: int, streamer=None):
        torch = self.torch
        ids = torch.from_numpy(ids)
        with torch.inference_mode():
            return self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                       do_sample=False, streamer=streamer)

    def prefill(self, batch: int) -> dict:
        spec = self.spec
        ids = prompt_ids(self.vocab, batch, spec.prompt_length, spec.seed, PREFILL)
        times = []
        for i in range(spec.warmup + spec.repeat):
            start = time.perf_counter()
            out = self._generate(ids, 1)
            if i >= spec.warmup:
                times.append(time.perf_counter() - start)
        return {"times_s": times, "first_tokens": out[:, -1].tolist()}

    def decode(self, context: int, batch: int) -> dict:
        spec = self.spec
        prompt = prompt_ids(self.vocab, batch, prompt_tokens(context), spec.seed, CONTEXT)
        stamps = _Stamps()
        start = time.perf_counter()
        self._generate(prompt, 1 + spec.steps, stamps)
        # put 0: the prompt; put 1: the first token (after the prefill); put j + 1: the token of decode step j
        if len(stamps.times) != 2 + spec.steps:
            raise RuntimeError(f"generate streamed {len(stamps.times)} times, expected {2 + spec.steps}")
        steps = np.diff(stamps.times[1:]).tolist()
        held = prompt.shape[1]
        return {"times_s": steps[spec.warmup:], "fill_seconds": stamps.times[1] - start,
                "cache_rows": [held + i for i in range(spec.warmup, spec.steps)],
                "tokens": np.array(stamps.tokens[1:-1]).T.tolist(), "next_tokens": stamps.tokens[-1]}


class RoutingPath:
    """The PyTorch reference with a hook on every MoE router. Args: the job (artifact, ``ours``' tokens)."""

    def __init__(self, job: dict, spec: WholeModelSpec):
        import torch

        from ...artifact import load_manifest
        from ...model import convert_form
        from ...model.layers import Router
        from ...validate.reference import load_reference_model

        manifest = load_manifest(job["artifact"])
        self.torch, self.spec, self.config = torch, spec, manifest.config
        self.model = convert_form(load_reference_model(job["artifact"], manifest), "A_CC")
        self.replay = job.get("tokens") or {}
        self.layers, self.seen = [], {}
        for name, module in self.model.named_modules():
            if isinstance(module, Router):
                index = int(name.split(".")[2])  # model.layers.{i}.mlp.gate
                self.layers.append(index)
                module.register_forward_hook(self._hook(index))
        self.info = {"reference": f"mla-deploy PyTorch model, absorbed A_CC form, float32 "
                                  f"({manifest.weights.kind} weights), concat cache", "moe_layers": self.layers}

    def _hook(self, index: int):
        def record(module, args, output) -> None:
            self.seen.setdefault(index, []).append(output[1].flatten())

        return record

    def _run(self, ids: np.ndarray, start: int, past):
        torch = self.torch
        positions = torch.from_numpy(_positions(len(ids), start, start + ids.shape[1]))
        with torch.inference_mode():
            logits, past = self.model(torch.from_numpy(np.ascontiguousarray(ids)), positions, past)
        return logits[:, -1].argmax(-1).numpy().astype(np.int64), past

    def _distinct(self) -> list[int]:
        """Distinct experts per MoE layer since the last call (then forgets them)."""
        torch = self.torch
        counts = [int(torch.unique(torch.cat(self.seen.get(i, [torch.empty(0, dtype=torch.long)]))).numel())
                  for i in self.layers]
        self.seen = {}
        return counts

    def _fill(self, ids: np.ndarray) -> tuple[np.ndarray, list]:
        past = self.model.empty_cache(len(ids), 0)
        for start, stop in chunks(ids.shape[1], fill_chunk(self.config, len(ids), ids.shape[1])):
            token, past = self._run(ids[:, start:stop], start, past)
        return token, past

    def prefill(self, batch: int) -> dict:
        ids = prompt_ids(self.config.vocab_size, batch, self.spec.prompt_length, self.spec.seed, PREFILL)
        self.seen = {}
        token, _ = self._fill(ids)
        return {"distinct_experts": [self._distinct()], "distinct_ids": [len(np.unique(ids))],
                "first_tokens": token.tolist()}

    def decode(self, context: int, batch: int) -> dict:
        spec = self.spec
        prompt = prompt_ids(self.config.vocab_size, batch, prompt_tokens(context), spec.seed, CONTEXT)
        token, past = self._fill(prompt)
        replay = self.replay.get(f"decode/T{context}/B{batch}")
        fed = np.asarray(replay, dtype=np.int64) if replay is not None else None
        self._distinct()
        experts, ids, agree, tokens = [], [], [], []
        for i in range(spec.steps):
            step = fed[:, i] if fed is not None else token
            agree.append(int((step == token).sum()))  # the reference's greedy choice against what was fed
            tokens.append(step)
            token, past = self._run(step[:, None], prompt.shape[1] + i, past)
            experts.append(self._distinct())
            ids.append(len(np.unique(step)))
        return {"distinct_experts": experts[spec.warmup:], "distinct_ids": ids[spec.warmup:],
                "replayed": fed is not None, "tokens_agreeing": sum(agree), "tokens_compared": batch * spec.steps,
                "tokens": np.stack(tokens, axis=1).tolist()}


ROLES = {"ours": OursPath, "transformers": TransformersPath, "routing": RoutingPath}


def run_point(path, key: str) -> dict:
    """One point of ``path`` (a role object): its record, with the peak resident memory during the point."""
    kind, batch, context = parse_point(key)
    record: dict = {"point": key}
    if hasattr(path, "fits"):
        rows = path.spec.prompt_length if kind == "prefill" else prompt_tokens(context) + path.spec.steps
        chunk = path.spec.prompt_length if kind == "prefill" else fill_chunk(path.config, batch, rows, path.itemsize)
        need, ok = path.fits(batch, rows, chunk)
        if not ok:
            available = host.available_memory() or 0
            return {**record, "status": "does not fit",
                    "detail": f"the point needs about {need / 2**30:.1f} GiB beside the weights, "
                              f"{available / 2**30:.1f} GiB available"}
    gc.collect()
    record["peak_is_per_point"] = machine.reset_peak()
    start = time.perf_counter()
    try:
        out = path.prefill(batch) if kind == "prefill" else path.decode(context, batch)
        record.update(status="ok", **out)
    except (MemoryError, RuntimeError) as exc:  # torch and ONNX Runtime report failures as RuntimeError
        record.update(failure(exc))
    record["seconds"] = time.perf_counter() - start
    record["peak_rss_bytes"] = machine.peak_bytes()
    gc.collect()
    return record


def _summary(role: str, record: dict) -> str:
    line = f"{role}: {record['point']}: {record['status']}"
    if record["status"] != "ok":
        return f"{line} ({record.get('detail')})"
    if record.get("times_s"):
        line += f", median {statistics.median(record['times_s']) * 1e3:.2f} ms over {len(record['times_s'])} call(s)"
    return f"{line} ({record['seconds']:.1f} s)"


def main(job_file: str) -> int:
    job = load_job(job_file)
    spec = WholeModelSpec.from_dict(job["spec"])
    role = job["role"]
    name = job.get("name", role)
    result = Results(job, role=role)
    if role == "probe":  # its own process, so the ONNX Runtime process never loads torch
        result.data["probes"].append({**machine.probe(spec.threads, spec.probe_mib),
                                      "loadavg_1min": machine.load_average()})
        return result.finish()
    if role != "ours":
        pin_torch_threads(spec.threads)
    start = time.perf_counter()
    path = ROLES[role](job, spec)
    result.data.update(load_seconds=time.perf_counter() - start, peak_rss_after_load_bytes=machine.peak_bytes(),
                       info=path.info)
    _say(f"{name}: loaded in {result.data['load_seconds']:.1f} s, resident "
         f"{result.data['peak_rss_after_load_bytes'] / 2**30:.2f} GiB")
    if hasattr(path, "warm"):
        runs = path.warm()
        result.data["warm_seconds"] = [round(s, 3) for s in runs]
        _say(f"{name}: weights warmed by {len(runs)} untimed prefill(s): {', '.join(f'{s:.1f}' for s in runs)} s")
    result.run(name, job["points"], lambda key: run_point(path, key), lambda record: _say(_summary(name, record)))
    return result.finish()


if __name__ == "__main__":  # pragma: no cover - run by the driver
    sys.exit(main(sys.argv[1]))
