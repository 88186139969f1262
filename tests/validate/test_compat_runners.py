"""The Polygraphy compat layer and the stateful runner protocol, on toy engines (no ONNX, runs in a second).

Two toy engines compute the same function with different cache layouts (concat with padding slots, static
buffer written at per-sequence offsets, garbage in padded rows); through Comparator.run their canonical outputs
are identical. A third is wrong at one decode step and only that step fails. Run this file under every
supported Polygraphy (0.49.x to 0.53.x).
"""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

from mla_deploy.cache_layout import get_layout
from mla_deploy.validate import compat
from mla_deploy.validate.metrics import error_figures, step_masks, top1_agreement
from mla_deploy.validate.runners import EngineRunner
from mla_deploy.validate.trajectory import TrajectoryLoader, canonical_rows, make_trajectory

V, C, LAYERS = 11, 3, 2
GARBAGE = 999.0


class ToyEngine:
    """The engines' protocol over a toy model: row(token, pos, layer) = [token, pos, layer + 1]."""

    def __init__(self, cache_mode: str, capacity: int = 32, bug_at_position: int | None = None):
        self.config = SimpleNamespace(num_hidden_layers=LAYERS, latent_dim=C, is_sparse=False)
        self.layout = get_layout(cache_mode)
        self.cache_mode, self.capacity, self.bug = cache_mode, capacity, bug_at_position
        self.provider = f"toy-{cache_mode}"

    def new_state(self, batch):
        if self.cache_mode == "concat":
            return {"caches": [np.zeros((batch, 0, C), np.float32) for _ in range(LAYERS)],
                    "lengths": np.zeros(batch, np.int64)}
        return {"caches": [np.zeros((batch, self.capacity, C), np.float32) for _ in range(LAYERS)],
                "lengths": np.zeros(batch, np.int64)}

    def forward(self, role, ids, pos, state, valid=None):
        valid = np.ones_like(ids) if valid is None else valid
        batch, steps = ids.shape
        logits = np.sin(ids[..., None] * 0.3 + pos[..., None] * 0.7 + np.arange(V)).astype(np.float32)
        if self.bug is not None:
            logits = logits + 0.5 * (pos[..., None] == self.bug)
        out = {"logits": logits}
        for layer in range(LAYERS):
            rows = np.stack([ids, pos, np.full_like(ids, layer + 1)], axis=-1).astype(np.float32)
            rows[valid == 0] = GARBAGE  # what a runtime leaves in padded slots is not compared
            if self.cache_mode == "concat":
                state["caches"][layer] = np.concatenate((state["caches"][layer], rows), axis=1)
                out[f"present_latent.{layer}"] = state["caches"][layer]
            else:
                for b in range(batch):
                    start = state["lengths"][b]
                    state["caches"][layer][b, start:start + steps] = rows[b]
                held = int((state["lengths"] + steps).max())
                out[f"present_latent.{layer}"] = state["caches"][layer][:, :held]
        state["lengths"] = state["lengths"] + valid.sum(axis=1)
        return out


def _run(engines, steps=4):
    trajectory = make_trajectory(V, batch=3, prompt_length=5, decode_steps=steps, seed=1)
    runners = [EngineRunner(engine, name) for name, engine in engines.items()]
    with compat.quiet():
        results = compat.run_comparator(runners, TrajectoryLoader(trajectory))
    return trajectory, results


def _compare(results, atol=1e-6):
    func = compat.simple_compare_func({"": atol}, {"": atol})
    with compat.quiet():
        return compat.compare(results, [(1, 0)], func)


def test_layouts_give_identical_canonical_outputs():
    trajectory, results = _run({"concat": ToyEngine("concat"), "static": ToyEngine("static")})
    assert compat.runner_names(results) == ["concat", "static"]
    accuracy = _compare(results)
    per_step = compat.pair_results(accuracy, ("static", "concat"))
    assert len(per_step) == 5
    for outputs in per_step:
        for name, result in outputs.items():
            figures = compat.output_figures(result)
            assert figures["passed"] and figures["max_absdiff"] == 0.0, (name, figures)
    steps = compat.iteration_outputs(results, "static")
    lengths = np.array(trajectory.lengths)  # [5, 4, 3]
    rows = steps[2]["present_latent.1"]  # after two decode steps
    assert rows.shape == (3, 7, C) and rows.dtype == np.float32
    for b in range(3):
        n = lengths[b] + 2
        assert np.array_equal(rows[b, :n, 1], np.arange(n))  # positions in time order, no padding holes
        assert not rows[b, n:].any() and not (rows == GARBAGE).any()
    logits0 = steps[0]["logits"]
    assert not logits0[2, 3:].any()  # padded prompt positions are zeroed


def test_a_wrong_step_fails_alone_and_masks_restrict_figures():
    trajectory, results = _run({"ref": ToyEngine("concat"), "bad": ToyEngine("static", bug_at_position=6)})
    verdicts = [{n: bool(r) for n, r in it.items()} for it in compat.pair_results(_compare(results), ("bad", "ref"))]
    # position 6 is decode step 2 of the 5-token prompt, step 3 of the 4-token prompt, step 4 of the 3-token one
    assert [v["logits"] for v in verdicts] == [True, True, False, False, False]
    assert all(v["present_latent.0"] and v["present_latent.1"] for v in verdicts)
    feeds = list(TrajectoryLoader(trajectory))
    masks = step_masks(feeds, len(feeds))
    ref, bad = compat.iteration_outputs(results, "ref"), compat.iteration_outputs(results, "bad")
    fig = error_figures(bad[2]["logits"], ref[2]["logits"], masks[2][0])
    assert fig["count"] == 3 * V and fig["max_abs"] == pytest.approx(0.5, abs=1e-6)
    assert fig["mean_abs"] == pytest.approx(0.5 / 3, abs=1e-6)  # one of three sequences is off
    assert top1_agreement(ref[0]["logits"], ref[0]["logits"], masks[0][0]) == {"agree": 12, "positions": 12, "rate": 1.0}


def test_results_round_trip(tmp_path):
    """RunResults.save/load and the feed dicts' JSON keep every array bit for bit."""
    trajectory, results = _run({"concat": ToyEngine("concat"), "static": ToyEngine("static")}, steps=2)
    compat.save_run_results(results, tmp_path / "run_results.json")
    loaded = compat.load_run_results(tmp_path / "run_results.json")
    assert compat.runner_names(loaded) == ["concat", "static"]
    for name in ("concat", "static"):
        for a, b in zip(compat.iteration_outputs(results, name), compat.iteration_outputs(loaded, name)):
            assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert bool(_compare(loaded))
    feeds = list(TrajectoryLoader(trajectory))
    compat.save_feed_dicts(feeds, tmp_path / "inputs.json")
    back = compat.load_feed_dicts(tmp_path / "inputs.json")
    assert all(np.array_equal(f[k], g[k]) for f, g in zip(feeds, back) for k in f)
    (tmp_path / "other.json").write_text(json.dumps({"not": "results"}))
    with pytest.raises(ValueError):
        compat.load_run_results(tmp_path / "other.json")
    with pytest.raises(FileNotFoundError):
        compat.load_run_results(tmp_path / "missing.json")


def test_accuracy_result_shapes_of_both_generations():
    """first_accuracy_result unwraps 0.53's AccuracyResults and passes 0.49's AccuracyResult through."""
    from polygraphy.comparator import struct

    _, results = _run({"concat": ToyEngine("concat"), "static": ToyEngine("static")}, steps=1)
    func = compat.simple_compare_func({"": 1e-6}, {"": 1e-6})
    from polygraphy.comparator import Comparator

    with compat.quiet(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        raw = Comparator.compare_accuracy(results, comparisons=[(1, 0)], compare_func=func)
    single = compat.first_accuracy_result(raw)
    assert type(single).__name__ == "AccuracyResult"
    assert compat.first_accuracy_result(single) is single
    if hasattr(struct, "AccuracyResults"):  # 0.53.4+
        assert type(raw).__name__ == "AccuracyResults"
        wrapped = struct.AccuracyResults([single])
        assert compat.first_accuracy_result(wrapped) is single
    else:
        assert raw is single


def test_simple_compare_func_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        func = compat.simple_compare_func({"": 1e-3, "logits": 1e-2}, {"": 1e-3}, "elemwise")
    assert callable(func)


def test_canonical_rows_rejects_a_mismatched_mask():
    from mla_deploy.errors import InputError

    with pytest.raises(InputError):
        canonical_rows(np.zeros((2, 3, C)), np.ones((2, 4)))


def test_trajectory_feeds():
    t = make_trajectory(V, batch=2, prompt_length=4, decode_steps=3, seed=0)
    feeds = t.feed_dicts()
    assert [f["step"][0] for f in feeds] == [0, 1, 2, 3]
    assert feeds[0]["input_ids"].shape == (2, 4) and feeds[0]["valid"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert feeds[2]["position_ids"].tolist() == [[5], [4]]  # each sequence continues from its own length
    assert [f["input_ids"][:, 0].tolist() for f in feeds[1:]] == [list(r) for r in t.decode_ids]
    assert make_trajectory(V, 2, 4, 3, seed=0) == t
    from mla_deploy.errors import CacheCapacityError

    with pytest.raises(CacheCapacityError):
        make_trajectory(V, 2, 4, 30, capacity=32)


def test_runner_layout_is_a_cache_layout_not_a_mode_name():
    engine = ToyEngine("static")
    assert EngineRunner(engine, "x").layout is engine.layout
    engine.layout = "static"
    with pytest.raises(TypeError, match="CacheLayout"):
        EngineRunner(engine, "x")
