"""The engine base (mla_deploy.engines.base): prompt padding, the generation loop (mla_deploy.generate.loop) over a
toy NumPy engine on the base, both cache layouts giving the same tokens through it on a real artifact, capacity refusals
that come from the layout, and the TensorRT engine standing on the base alone."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from artifacts import tiny_artifact
from mla_deploy.cache_layout import CONCAT, STATIC
from mla_deploy.engines.base import Engine, prefill_chunk_size, prefill_chunks
from mla_deploy.ort.engine import OrtEngine
from mla_deploy.generate.loop import Generation
from mla_deploy.generate.request import check_ids, pad_prompts
from mla_deploy.errors import CacheCapacityError, InputError, ShapeError

PROMPTS = [[3, 14, 15, 92, 65, 35, 89], [27, 18, 28, 18]]  # lengths 7 and 4
V, C = 16, 2


# padding and ids ----------------------------------------------------------------------------------------
def test_pad_prompts_right_pads_and_reports_lengths():
    ids, valid, lengths = pad_prompts([[5, 6, 7], [9], [1, 2]], vocab_size=10)
    assert ids.dtype == valid.dtype == lengths.dtype == np.int64
    assert ids.tolist() == [[5, 6, 7], [9, 0, 0], [1, 2, 0]]
    assert valid.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert lengths.tolist() == [3, 1, 2]


@pytest.mark.parametrize("prompts,message", [([], "at least one token"), ([[1], []], "at least one token"),
                                             ([[1, 10]], "token id 10 is outside"),
                                             ([[-1, 2]], "token id -1 is outside")])
def test_pad_prompts_errors(prompts, message):
    with pytest.raises(InputError, match=message):
        pad_prompts(prompts, vocab_size=10)


def test_check_ids():
    check_ids(np.zeros((2, 0), np.int64), 4)  # nothing to check
    check_ids(np.array([[0, 3]]), 4)
    with pytest.raises(InputError, match=r"token id 4 is outside the vocabulary \[0, 4\)"):
        check_ids(np.array([[0, 4, 5]]), 4)


# the loop over a toy engine -------------------------------------------------------------------------------
class ToyEngine(Engine):
    """A NumPy runtime on the base: the next token is ``(id + 1) % V``; the cache row of a token is
    ``[id, position]``. Records every run."""

    provider = "toy"

    def __init__(self, layout, capacity=None):
        config = SimpleNamespace(latent_dim=C, num_hidden_layers=2, num_attention_heads=1, vocab_size=V, is_sparse=False)
        manifest = SimpleNamespace(config=config, layout=layout, precision="fp32", capacity=capacity)
        super().__init__("toy", manifest)
        self.runs, self.indices = [], []

    def _allocate(self, shape):
        return np.zeros(shape, np.float32)

    def _run(self, role, ids, positions, logits_index, control, state):
        self.runs.append((role, ids.copy(), positions.copy(), control.copy()))
        self.indices.append(logits_index.copy())
        logits = np.eye(V, dtype=np.float32)[(np.take_along_axis(ids, logits_index, axis=1) + 1) % V]
        rows = np.stack([ids, positions], axis=-1).astype(np.float32)  # [B, S, C]
        presents = []
        for cache in state.caches:
            if self.layout.in_place:
                for b, start in enumerate(state.lengths):
                    cache[b, 0, start: start + ids.shape[1]] = rows[b]
                presents.append(cache)
            else:
                presents.append(np.concatenate((cache, rows), axis=1))
        return logits, presents


@pytest.mark.parametrize("layout", [CONCAT, STATIC], ids=["concat", "static"])
def test_generate_is_prefill_then_decode_steps(layout):
    engine = ToyEngine(layout, capacity=16)
    result = engine.generate([[3, 4, 5], [7]], max_new_tokens=4)
    assert isinstance(result, Generation)
    assert result.tokens == [[6, 7, 8, 9], [8, 9, 10, 11]]  # each sequence continues from its own last token
    assert result.decode_steps == 3 and result.provider == "toy" and len(engine.runs) == 4
    role, ids, positions, control = engine.runs[0]
    assert role == "prefill" and ids.tolist() == [[3, 4, 5], [7, 0, 0]] and positions.tolist() == [[0, 1, 2]] * 2
    assert [run[0] for run in engine.runs[1:]] == ["decode"] * 3
    assert [run[2][:, 0].tolist() for run in engine.runs[1:]] == [[3, 1], [4, 2], [5, 3]]  # own positions
    if layout.in_place:
        assert control.tolist() == [0, 0] and engine.runs[1][3].tolist() == [3, 1]  # write indices = rows held
    else:
        assert control.tolist() == [[1, 1, 1], [1, 0, 0]]  # the mask of the padded prompt
        assert engine.runs[1][3].tolist() == [[1, 1, 1, 1], [1, 0, 0, 1]]
    assert result.tokens_per_second > 0
    # each step asks for one row of logits: the prefill for each sequence's last real token
    assert [index.tolist() for index in engine.indices] == [[[2], [0]]] + [[[0], [0]]] * 3
    info = engine.info()
    assert info["cache_mode"] == layout.mode and info["capacity"] == (16 if layout.has_capacity else None)


def test_generation_sizes_a_static_cache_to_the_request():
    """Each decode step attends over every slot of a static cache: generation allocates the rows the request
    needs (prompt + new tokens - 1), not the whole capacity, and a step past the state's own capacity is refused."""
    engine = ToyEngine(STATIC, capacity=64)
    shapes = []
    engine._allocate = lambda shape: shapes.append(shape) or np.zeros(shape, np.float32)
    result = engine.generate([[3, 4, 5], [7]], max_new_tokens=4)
    assert result.tokens == [[6, 7, 8, 9], [8, 9, 10, 11]]
    assert shapes == [(2, 1, 6, C)] * 2  # 3 + 4 - 1 rows per layer
    state = engine.new_state(1, rows=2)
    assert state.capacity == 2 and engine.new_state(1).capacity == 64 and engine.new_state(1, rows=999).capacity == 64
    with pytest.raises(CacheCapacityError, match="capacity 2"):
        engine.step("prefill", np.array([[1, 2, 3]]), np.array([[0, 1, 2]]), state)


def test_logits_index_picks_rows_and_is_checked():
    engine = ToyEngine(CONCAT)
    ids = np.array([[3, 4, 5], [7, 8, 9]])
    pos = np.broadcast_to(np.arange(3), ids.shape)
    out = engine.forward("prefill", ids, pos, engine.new_state(2), logits_index=[[2, 0], [1, 1]])
    assert out["logits"].argmax(-1).tolist() == [[6, 4], [9, 9]]
    assert engine.forward("prefill", ids, pos, engine.new_state(2))["logits"].shape == (2, 3, V)  # default: all
    with pytest.raises(InputError, match=r"logits_index holds 3, outside the step's positions 0\.\.2"):
        engine.step("prefill", ids, pos, engine.new_state(2), logits_index=[[3], [0]])
    with pytest.raises(InputError, match="logits_index holds -1"):
        engine.step("prefill", ids, pos, engine.new_state(2), logits_index=[[-1], [0]])
    with pytest.raises(ShapeError, match=r"logits_index \[1, 1\] must be \[2, K\]"):
        engine.step("prefill", ids, pos, engine.new_state(2), logits_index=[[0]])


@pytest.mark.parametrize("layout", [CONCAT, STATIC], ids=["concat", "static"])
def test_each_sequence_stops_at_an_eos_id_and_the_batch_goes_on(layout):
    engine = ToyEngine(layout, capacity=16)
    result = engine.generate([[3], [9, 9]], max_new_tokens=6, eos_ids=[5, 99])
    assert result.tokens == [[4, 5], [10, 11, 12, 13, 14, 15]]  # the EOS id is kept as the last token
    assert result.finish_reasons == ["eos", "length"] and result.decode_steps == 5
    decoded = [run[1][:, 0].tolist() for run in engine.runs[1:]]
    assert [row[1] for row in decoded] == [10, 11, 12, 13, 14]  # the other sequence goes on
    assert result.sequence_decode_seconds[0] <= result.sequence_decode_seconds[1] == result.decode_seconds
    assert result.tokens_per_second == pytest.approx((1 + 5) / result.decode_seconds)
    assert ToyEngine(layout, capacity=16).generate([[3], [4]], 6, eos_ids=[5, 6]).decode_steps == 1  # all done


def test_stream_yields_each_step_and_stops_a_finished_sequence():
    engine = ToyEngine(CONCAT)
    stream = engine.stream([[1], [7]], max_new_tokens=5)
    steps = []
    for step in stream:
        steps.append(step)
        if step.index == 1:
            stream.finish(0)  # as a stop string does
    assert [s.tokens for s in steps] == [(2, 8), (3, 9), (None, 10), (None, 11), (None, 12)]
    assert steps[1].finished == (None, None) and steps[2].finished == ("stop", None)
    assert steps[-1].finished == ("stop", "length")
    result = stream.result()
    assert result.tokens == [[2, 3], [8, 9, 10, 11, 12]] and result.finish_reasons == ["stop", "length"]


def test_sampling_in_the_loop_is_seeded_and_top_k_1_is_greedy():
    from mla_deploy.generate.sampling import SamplingConfig

    class Noisy(ToyEngine):  # logits with a clear maximum at (id + 1) % V and noise elsewhere
        def _run(self, role, ids, positions, logits_index, control, state):
            logits, presents = super()._run(role, ids, positions, logits_index, control, state)
            return logits * 3 + np.random.default_rng(int(ids.sum())).normal(size=logits.shape), presents

    greedy = Noisy(CONCAT).generate([[3, 4, 5], [7]], 10)
    assert Noisy(CONCAT).generate([[3, 4, 5], [7]], 10, SamplingConfig(2.0, top_k=1, seed=0)).tokens == greedy.tokens
    hot = SamplingConfig(3.0, seed=5)
    first = Noisy(CONCAT).generate([[3, 4, 5], [7]], 10, hot).tokens
    assert Noisy(CONCAT).generate([[3, 4, 5], [7]], 10, hot).tokens == first != greedy.tokens


@pytest.mark.parametrize("layout", [CONCAT, STATIC], ids=["concat", "static"])
def test_forward_returns_the_rows_held(layout):
    engine = ToyEngine(layout, capacity=8)
    state = engine.new_state(2)
    ids, valid, _ = pad_prompts([[3, 4, 5], [7]], V)
    out = engine.forward("prefill", ids, np.broadcast_to(np.arange(3), ids.shape), state, valid)
    assert out["logits"].shape == (2, 3, V) and state.lengths.tolist() == [3, 1]
    rows = out["present_latent.1"]
    assert rows.shape == (2, 3, C)  # concat: every slot, padding included; static: slots 0 .. max(lengths)
    keep = layout.slot_valid(state, rows.shape[1])
    assert keep.tolist() == [[True] * 3, [True, False, False]]
    assert rows[1, 0].tolist() == [7, 0] and rows[0, :, 1].tolist() == [0, 1, 2]


def test_step_errors_are_typed():
    engine = ToyEngine(CONCAT)
    state = engine.new_state(2)
    with pytest.raises(ShapeError, match=r"must both be \[2, S\]"):
        engine.step("prefill", np.ones((1, 2), np.int64), np.zeros((1, 2), np.int64), state)
    with pytest.raises(ShapeError, match="valid"):
        engine.step("prefill", np.ones((2, 2), np.int64), np.zeros((2, 2), np.int64), state, np.ones((2, 3)))
    with pytest.raises(InputError, match="outside the vocabulary"):
        engine.step("prefill", np.full((2, 1), V), np.zeros((2, 1), np.int64), state)
    with pytest.raises(InputError, match="max_new_tokens"):
        engine.generate([[1]], 0)
    assert engine.runs == []  # nothing ran


def test_capacity_refusals_come_from_the_layout():
    """The engine's refusals are the layout's own: a fixed-capacity layout refuses, a growing one never does."""
    engine = ToyEngine(STATIC, capacity=8)
    with pytest.raises(CacheCapacityError) as by_layout:
        STATIC.check_request(7, 4, 8)
    with pytest.raises(CacheCapacityError) as by_engine:
        engine.generate([[1] * 7], 4)
    assert str(by_engine.value) == str(by_layout.value) and "capacity 8" in str(by_layout.value)
    state = engine.new_state(1)
    with pytest.raises(CacheCapacityError, match="0 cached \\+ 9 new tokens exceed the static cache capacity 8"):
        engine.step("prefill", np.ones((1, 9), np.int64), np.arange(9)[None], state)
    assert engine.runs == []
    CONCAT.check_request(1000, 1000, None)  # a growing cache has no capacity to refuse
    assert len(ToyEngine(CONCAT).generate([[1] * 20], 20).tokens[0]) == 20


# the real ONNX Runtime engine through the shared loop --------------------------------------------------------
def test_concat_and_static_artifacts_generate_the_same_tokens():
    from mla_deploy.ort.engine import OrtEngine

    engines = [OrtEngine(tiny_artifact(mode), threads=1) for mode in ("concat", "static")]
    assert [e.layout for e in engines] == [CONCAT, STATIC]
    results = [e.generate(PROMPTS, 12) for e in engines]
    assert results[0].tokens == results[1].tokens
    assert all(r.decode_steps == 11 and len(r.tokens) == 2 for r in results)
    states = [e.new_state(2) for e in engines]
    ids, valid, _ = pad_prompts(PROMPTS, engines[0].config.vocab_size)
    positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    outs = [e.forward("prefill", ids, positions, s, valid) for e, s in zip(engines, states)]
    for layer in range(engines[0].config.num_hidden_layers):  # the real rows agree once padding is dropped
        kept = [o[f"present_latent.{layer}"][e.layout.slot_valid(s, o[f"present_latent.{layer}"].shape[1])]
                for e, s, o in zip(engines, states, outs)]
        np.testing.assert_allclose(kept[0], kept[1], atol=1e-5, rtol=0)


# the TensorRT engine stands on the base alone ----------------------------------------------------------------
def _imported_modules(path: Path) -> set[str]:
    package = "mla_deploy.engines"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found |= {module, *(f"{module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def test_trt_engine_imports_nothing_from_the_ort_engine():
    import mla_deploy.trt.engine as trt_engine

    imported = _imported_modules(Path(trt_engine.__file__))
    assert "mla_deploy.engines.base" in imported  # the loop comes from the base
    assert not [m for m in imported if m.startswith(("mla_deploy.ort.engine", "mla_deploy.runtime"))]
    assert issubclass(trt_engine.TrtEngine, Engine)
    for name in ("generate", "stream", "step", "forward", "prefill", "decode"):  # not redefined: the base's
        assert name not in vars(trt_engine.TrtEngine)


# prefill in chunks ----------------------------------------------------------------------------------------
def test_prefill_chunks_cut_each_row_from_its_end():
    """Rows of 10, 4 and 1 tokens in chunks of 4: the longest takes 2 + 4 + 4, the others sit out until their one
    chunk; every row's tokens are covered once, in order, and every row ends in the last call."""
    plan = prefill_chunks(np.array([10, 4, 1]), 4)
    assert [(s.tolist(), c.tolist()) for s, c in plan] == [([0, 0, 0], [2, 0, 0]), ([2, 0, 0], [4, 0, 0]),
                                                           ([6, 0, 0], [4, 4, 1])]
    for lengths, chunk in (([7, 7], 7), ([130, 64, 65, 1], 64), ([5], 1), ([9, 3], 2)):
        plan = prefill_chunks(np.array(lengths), chunk)
        assert len(plan) == -(-max(lengths) // chunk)
        for b, length in enumerate(lengths):
            taken = [i for start, count in plan for i in range(start[b], start[b] + count[b])]
            assert taken == list(range(length)) and plan[-1][1][b] >= 1
            assert all(count[b] <= chunk for _, count in plan)


def test_prefill_chunk_size_keeps_one_layers_scores_within_the_budget():
    """DeepSeek-V2-Lite's 16 heads: a 4096-token prompt in one call (1 GiB of float32 scores), 8192 in chunks of 2048;
    32 such prompts in chunks of 128; V3's 128 heads, 4096 tokens: 512; never under 64 tokens, never above the width."""
    assert prefill_chunk_size(1, 16, 4096) == 4096 and prefill_chunk_size(1, 16, 8192) == 2048
    assert prefill_chunk_size(32, 16, 4096) == 128 and prefill_chunk_size(1, 128, 4096) == 512
    assert prefill_chunk_size(64, 128, 32768) == 64 and prefill_chunk_size(1, 16, 7) == 7
    for batch, heads, width in ((1, 16, 4097), (3, 16, 9000), (2, 128, 3000)):
        chunk = prefill_chunk_size(batch, heads, width)
        assert chunk % 64 == 0 and 4 * batch * heads * chunk * width <= 1 << 30 < 4 * batch * heads * (chunk + 64) * width


@pytest.mark.parametrize("mode", ["static", "concat"])
@pytest.mark.parametrize("form", ["CC", "A_CC"])
def test_prefill_in_chunks_equals_one_call(mode, form):
    """Prompts of 40, 29, 3 and 1 tokens prefilled in chunks of 1, 7 and 16 tokens (each chunk a call of the prefill
    graph over the rows the earlier ones cached): the last tokens' logits and the cached rows equal one call's to
    float32 rounding, and 8 greedy tokens after it are the same; the chunks are really separate calls."""
    root = tiny_artifact(mode, **({} if form == "CC" else {"prefill_form": form}))  # the tiny preset: CC
    one = OrtEngine(root, threads=1)
    lengths = np.array([40, 29, 3, 1])
    ids = np.random.default_rng(0).integers(0, one.vocab_size, size=(len(lengths), 40))
    prompts = [ids[b, :n].tolist() for b, n in enumerate(lengths)]
    state = one.new_state(len(lengths), 48)
    want = one.to_host(one.prefill(ids, lengths, state))
    held = [one.layout.held(one.to_host(c), state) for c in state.caches]
    tokens = one.generate(prompts, 8).tokens
    for chunk in (1, 7, 16):
        engine = OrtEngine(root, threads=1, prefill_chunk=chunk)
        calls = []
        step = engine.step
        engine.step = lambda *args, **kwargs: calls.append(args[1].shape) or step(*args, **kwargs)
        chunked = engine.new_state(len(lengths), 48)
        got = engine.to_host(engine.prefill(ids, lengths, chunked))
        assert calls == [(len(lengths), chunk)] * -(-40 // chunk)
        assert chunked.lengths.tolist() == lengths.tolist()
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
        keep = one.layout.slot_valid(state, held[0].shape[1])
        for i, cache in enumerate(chunked.caches):
            rows = engine.layout.held(engine.to_host(cache), chunked)
            mine = engine.layout.slot_valid(chunked, rows.shape[1])
            for b in range(len(lengths)):  # the real tokens' rows, in order (a concat cache also keeps padding slots)
                np.testing.assert_allclose(rows[b][mine[b]], held[i][b][keep[b]], rtol=0, atol=1e-5)
        assert engine.generate(prompts, 8).tokens == tokens


@pytest.mark.parametrize("chunk", [0, -3, "abc", "128", 2.5, True])
def test_prefill_chunk_that_is_no_whole_number_of_tokens_is_refused(chunk):
    """Python callers too: a string or a float was a ValueError or was truncated, never the one-line error."""
    with pytest.raises(InputError, match="prefill chunk must be a whole number of tokens, at least 1"):
        OrtEngine(tiny_artifact("static"), threads=1, prefill_chunk=chunk)
    assert OrtEngine(tiny_artifact("static"), threads=1, prefill_chunk=np.int64(4)).prefill_chunk == 4
