"""The bench's runners compute the same function on the same inputs (in process, tiny shapes): transformers'
V2 and V3 attention (eager and sdpa) with a directly filled DynamicCache, and this project's CD and absorbed
stacks; the runners are idempotent (every call is the same step)."""

from __future__ import annotations

import numpy as np
import pytest

from mla_deploy.bench.inputs import make_inputs
from mla_deploy.bench.torch_paths import TorchRunner
from mla_deploy.recipe import load_recipe

pytest.importorskip("transformers")


def _run(runner, inputs, calls=2):
    runner.setup(inputs)
    outs = []
    for _ in range(calls):
        runner.step()
        outs.append(runner.output())
    checks = runner.checks()
    runner.teardown()
    return outs, checks


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_transformers_attention_matches_ours(model_type):
    from mla_deploy.bench.hf_path import HFRunner

    config = load_recipe("tiny").model.replace(model_type=model_type)
    inputs = make_inputs(config, 2, context=12, batch=2, seed=3)
    (ref, again), _ = _run(TorchRunner(config, 2, 3, "CD"), inputs)
    assert np.array_equal(ref, again)
    (absorbed, _), _ = _run(TorchRunner(config, 2, 3, "A_CC"), inputs)
    assert np.abs(absorbed - ref).max() <= 1e-5 * np.abs(ref).max()
    for impl in ("eager", "sdpa"):
        (out, again), checks = _run(HFRunner(config, 2, 3, impl), inputs)
        assert checks["cache_rows_after_step"] == 12  # cropped back: the next call is the same step
        assert np.array_equal(out, again)
        assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max(), (model_type, impl)


def test_inputs_are_reproducible():
    config = load_recipe("tiny").model
    a, b = make_inputs(config, 2, 8, 2, seed=1), make_inputs(config, 2, 8, 2, seed=1)
    assert all(np.array_equal(x.numpy(), y.numpy()) for x, y in zip([a.hidden, *a.latent], [b.hidden, *b.latent]))
    c = make_inputs(config, 2, 8, 2, seed=2)
    assert not np.array_equal(a.hidden.numpy(), c.hidden.numpy())


@pytest.fixture(scope="module")
def tiny_static_graph(tmp_path_factory):
    from mla_deploy.bench.graph import export_stack
    from mla_deploy.bench.stack import build_stack

    config = load_recipe("tiny").model
    path = export_stack(build_stack(config, 2, "A_CC", seed=5), "static", tmp_path_factory.mktemp("g") / "s.onnx")
    return config, str(path)


def test_static_graph_updates_the_cache_in_place(tiny_static_graph, capfd):
    """The ORT static runner binds one buffer as past and present: the new row lands in that buffer, the past
    rows stay, ONNX Runtime logs no copy; its output equals the PyTorch absorbed stack's. Negative control: a
    separate present buffer makes ONNX Runtime log the cache copy, which the bench counts."""
    import onnxruntime as ort

    from mla_deploy.bench.ort_path import COPY_WARNING, OrtRunner
    from mla_deploy.io_spec import present_name

    config, graph = tiny_static_graph
    inputs = make_inputs(config, 2, context=20, batch=2, seed=5)
    (ref, _), _ = _run(TorchRunner(config, 2, 5, "A_CC"), inputs)
    runner = OrtRunner(graph, "static", threads=1, margin=8)
    (out, again), checks = _run(runner, inputs)
    assert checks["in_place"] and checks["past_rows_unchanged"] and checks["rows_after_T_untouched"]
    assert np.array_equal(out, again) and np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()
    assert COPY_WARNING not in capfd.readouterr().err

    runner.setup(inputs)
    for i in range(2):
        runner.io.bind_ortvalue_output(present_name(i), ort.OrtValue.ortvalue_from_numpy(runner.buffers[i].copy()))
    runner.step()
    assert not runner.checks()["in_place"]  # the row went to the other buffer
    runner.teardown()
    assert COPY_WARNING in capfd.readouterr().err
