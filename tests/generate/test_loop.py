"""The generation loop (mla_deploy.generate.loop) driven through the public engine interface alone: a plain
engine that is no subclass of the engine base and has no private methods generates; one decode step serves
rows at different positions; the ONNX Runtime engine's prefill and decode agree with its general step."""

from __future__ import annotations

import numpy as np
import pytest

from artifacts import tiny_artifact
from mla_deploy.errors import CacheCapacityError, InputError, ShapeError
from mla_deploy.generate import GenerationEngine
from mla_deploy.generate.loop import Generation, decode_step, generate_tokens, prefill_step, stream_tokens
from mla_deploy.generate.sampling import Sampler, SamplingConfig, draw

V = 32


class Rows:
    """The state of :class:`PlainEngine`: the tokens each row holds."""

    def __init__(self, batch: int, rows: int | None):
        self.held: list[list[int]] = [[] for _ in range(batch)]
        self.rows = rows

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(h) for h in self.held], dtype=np.int64)


class PlainEngine:
    """A GenerationEngine written from its protocol only: the next token is ``(sum of the row's tokens) % V``, so
    it depends on every token a row holds and on nothing of the other rows. Records each call."""

    provider = "plain"
    vocab_size = V

    def __init__(self, capacity: int | None = None):
        self.capacity, self.calls = capacity, []

    def check_request(self, prompt_length: int, max_new_tokens: int) -> None:
        if self.capacity is not None and prompt_length + max_new_tokens - 1 > self.capacity:
            raise CacheCapacityError(f"{prompt_length} + {max_new_tokens} do not fit {self.capacity}")

    def new_state(self, batch: int, rows: int | None = None) -> Rows:
        self.calls.append(("new_state", batch, rows))
        return Rows(batch, rows)

    def _logits(self, state: Rows) -> np.ndarray:
        return np.eye(V, dtype=np.float32)[[sum(h) % V for h in state.held]]

    def prefill(self, ids: np.ndarray, lengths: np.ndarray, state: Rows) -> np.ndarray:
        self.calls.append(("prefill", ids.tolist(), lengths.tolist()))
        state.held = [list(map(int, row[:n])) for row, n in zip(ids, lengths)]
        return self._logits(state)

    def decode(self, tokens: np.ndarray, state: Rows) -> np.ndarray:
        self.calls.append(("decode", tokens.tolist(), state.lengths.tolist()))
        for held, token in zip(state.held, tokens.tolist()):
            held.append(token)
        return self._logits(state)

    def argmax(self, logits: np.ndarray) -> np.ndarray:
        return logits.argmax(-1).astype(np.int64)

    def sample(self, logits: np.ndarray, config, uniforms: np.ndarray) -> np.ndarray:
        return draw(logits, config, uniforms)

    def to_host(self, logits: np.ndarray) -> np.ndarray:
        return np.array(logits)

    def synchronize(self) -> None:
        self.calls.append(("synchronize",))

    def info(self) -> dict:
        return {"provider": self.provider}


def continue_sum(prompt: list[int], steps: int) -> list[int]:
    """What PlainEngine generates for ``prompt`` alone."""
    held, out = list(prompt), []
    for _ in range(steps):
        out.append(sum(held) % V)
        held.append(out[-1])
    return out


def test_the_plain_engine_implements_only_the_protocol():
    public = {n for n in vars(GenerationEngine) if not n.startswith("_")} | set(GenerationEngine.__annotations__)
    assert public == {"provider", "vocab_size", "check_request", "new_state", "prefill", "decode", "argmax", "sample",
                      "to_host", "synchronize", "info"}
    assert all(hasattr(PlainEngine(), name) for name in public)


def test_the_loop_drives_an_engine_through_the_protocol_alone():
    engine = PlainEngine()
    prompts = [[3, 4, 5], [7]]
    result = generate_tokens(engine, prompts, max_new_tokens=5)
    assert isinstance(result, Generation) and result.provider == "plain" and result.extra == {"provider": "plain"}
    assert result.tokens == [continue_sum(p, 5) for p in prompts] and result.finish_reasons == ["length"] * 2
    assert engine.calls[0] == ("new_state", 2, 3 + 5 - 1)  # the rows the request needs: the last token is not fed
    assert engine.calls[2] == ("prefill", [[3, 4, 5], [7, 0, 0]], [3, 1])  # right-padded, with each row's length
    decodes = [c for c in engine.calls if c[0] == "decode"]
    assert [c[2] for c in decodes] == [[3, 1], [4, 2], [5, 3], [6, 4]]  # each row at its own position
    assert [c[1] for c in decodes] == [[t[i] for t in result.tokens] for i in range(4)]
    assert engine.calls[1] == engine.calls[-1] == ("synchronize",)  # around the timed steps


def test_eos_and_finish_stop_sequences_and_the_batch_goes_on():
    want, other = continue_sum([1, 2], 6), continue_sum([5], 6)
    assert want[1] not in other
    result = generate_tokens(PlainEngine(), [[1, 2], [5]], 6, eos_ids=[want[1]])
    assert result.tokens == [want[:2], other] and result.finish_reasons == ["eos", "length"]
    assert result.decode_steps == 5  # the batch went on for the other sequence
    stream = stream_tokens(PlainEngine(), [[1], [2]], 4)
    for step in stream:
        if step.index == 0:
            stream.finish(1)
    assert [len(t) for t in stream.result().tokens] == [4, 1] and stream.result().finish_reasons == ["length", "stop"]


def test_decode_step_serves_rows_of_different_sequences_at_different_positions():
    """The step a batching server drives: rows joined at different times, each continues its own sequence."""
    engine, sampler = PlainEngine(), Sampler()
    state = engine.new_state(2)
    first = prefill_step(engine, np.array([[9, 9, 9, 9], [4, 0, 0, 0]]), np.array([4, 1]), state, sampler)
    tokens = [[int(first[0])], [int(first[1])]]
    for _ in range(3):
        nxt = decode_step(engine, np.array([tokens[0][-1], tokens[1][-1]]), state, sampler)
        tokens[0].append(int(nxt[0]))
        tokens[1].append(int(nxt[1]))
    assert tokens == [continue_sum([9, 9, 9, 9], 4), continue_sum([4], 4)]
    assert state.lengths.tolist() == [7, 4]


def test_sampling_is_the_engines_draw_and_a_seed_repeats():
    class Counting(PlainEngine):
        def _logits(self, state):
            rng = np.random.default_rng(int(state.lengths.sum()))
            return rng.normal(size=(len(state.held), V)).astype(np.float32)

        def argmax(self, logits):
            raise AssertionError("a sampled generation must not take the argmax")

    hot = SamplingConfig(temperature=1.5, seed=3)
    first = generate_tokens(Counting(), [[1, 2], [3]], 8, hot).tokens
    assert generate_tokens(Counting(), [[1, 2], [3]], 8, hot).tokens == first
    assert generate_tokens(Counting(), [[1, 2], [3]], 8, SamplingConfig(1.5, seed=4)).tokens != first


def test_requests_are_refused_before_anything_runs():
    engine = PlainEngine(capacity=8)
    with pytest.raises(CacheCapacityError):
        stream_tokens(engine, [[1] * 6], 4)
    with pytest.raises(InputError, match="max_new_tokens"):
        stream_tokens(engine, [[1]], 0)
    with pytest.raises(InputError, match=f"token id {V} is outside"):
        stream_tokens(engine, [[1, V]], 2)
    with pytest.raises(InputError, match="at least one token"):
        stream_tokens(engine, [[1], []], 2)
    assert engine.calls == []


# the ONNX Runtime engine's side of the protocol ----------------------------------------------------------------
@pytest.mark.parametrize("mode", ["concat", "static"])
def test_ort_prefill_and_decode_are_its_step_at_each_rows_last_token(mode):
    from mla_deploy.ort.engine import OrtEngine
    from mla_deploy.generate.request import pad_prompts

    engine = OrtEngine(tiny_artifact(mode), threads=1)
    ids, valid, lengths = pad_prompts([[5, 6, 7, 8], [9, 10]], engine.vocab_size)
    positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    state, reference = engine.new_state(2), engine.new_state(2)
    got = engine.to_host(engine.prefill(ids, lengths, state))
    full = engine.forward("prefill", ids, positions, reference, valid)["logits"]
    np.testing.assert_allclose(got, full[[0, 1], lengths - 1], atol=1e-5, rtol=0)
    assert engine.argmax(got).tolist() == got.argmax(-1).tolist() and state.lengths.tolist() == [4, 2]
    token = engine.argmax(got)
    got = engine.to_host(engine.decode(token, state))
    want = engine.forward("decode", token[:, None], reference.lengths[:, None].copy(), reference)["logits"][:, 0]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert state.lengths.tolist() == [5, 3]
    with pytest.raises(ShapeError, match="lengths"):
        engine.prefill(ids, np.array([4, 0]), engine.new_state(2))
    with pytest.raises(ShapeError, match="one token per row"):
        engine.decode(token[:, None], state)
