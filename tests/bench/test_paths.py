"""The bench's paths compute the same function on the same inputs (in process, tiny shapes): transformers'
V2 and V3 attention (eager and sdpa) with a directly filled DynamicCache, and this project's CD and absorbed
stacks; the paths are idempotent (every call is the same step)."""

from __future__ import annotations

import numpy as np
import pytest

from mla_deploy.bench.attention.inputs import make_inputs
from mla_deploy.bench.attention.torch_paths import TorchPath
from mla_deploy.recipe import load_recipe

pytest.importorskip("transformers")


def _run(timed, inputs, calls=2):
    timed.setup(inputs)
    outs = []
    for _ in range(calls):
        timed.step()
        outs.append(timed.output())
    checks = timed.checks()
    timed.teardown()
    return outs, checks


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_transformers_attention_matches_ours(model_type):
    from mla_deploy.bench.attention.hf_path import HFPath

    config = load_recipe("tiny").model.replace(model_type=model_type)
    inputs = make_inputs(config, 2, context=12, batch=2, seed=3)
    (ref, again), _ = _run(TorchPath(config, 2, 3, "CD"), inputs)
    assert np.array_equal(ref, again)
    (absorbed, _), _ = _run(TorchPath(config, 2, 3, "A_CC"), inputs)
    assert np.abs(absorbed - ref).max() <= 1e-5 * np.abs(ref).max()
    for impl in ("eager", "sdpa"):
        (out, again), checks = _run(HFPath(config, 2, 3, impl), inputs)
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
    from mla_deploy.bench.attention.graph import export_stack
    from mla_deploy.model import build_stack

    config = load_recipe("tiny").model
    path = export_stack(build_stack(config, 2, "A_CC", seed=5), "static", tmp_path_factory.mktemp("g") / "s.onnx")
    return config, str(path)


def test_static_graph_updates_the_cache_in_place(tiny_static_graph, capfd):
    """The ORT static path binds one buffer as past and present: the new row lands in that buffer, the past
    rows stay, ONNX Runtime logs no copy; its output equals the PyTorch absorbed stack's. Negative control: a
    separate present buffer makes ONNX Runtime log the cache copy, which the bench counts."""
    import onnxruntime as ort

    from mla_deploy.bench.attention.ort_path import COPY_WARNING, OrtPath
    from mla_deploy.io_spec import present_name

    config, graph = tiny_static_graph
    inputs = make_inputs(config, 2, context=20, batch=2, seed=5)
    (ref, _), _ = _run(TorchPath(config, 2, 5, "A_CC"), inputs)
    timed = OrtPath(graph, "static", threads=1, margin=8)
    (out, again), checks = _run(timed, inputs)
    assert checks["in_place"] and checks["past_rows_unchanged"] and checks["rows_after_T_untouched"]
    assert np.array_equal(out, again) and np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()
    assert COPY_WARNING not in capfd.readouterr().err

    timed.setup(inputs)
    for i in range(2):
        timed.io.bind_ortvalue_output(present_name(i), ort.OrtValue.ortvalue_from_numpy(timed.buffers[i].copy()))
    timed.step()
    assert not timed.checks()["in_place"]  # the row went to the other buffer
    timed.teardown()
    assert COPY_WARNING in capfd.readouterr().err


@pytest.fixture(scope="module")
def tiny_concat_graph(tmp_path_factory):
    from mla_deploy.bench.attention.graph import export_stack
    from mla_deploy.model import build_stack

    config = load_recipe("tiny").model
    path = export_stack(build_stack(config, 2, "A_CC", seed=5), "concat", tmp_path_factory.mktemp("g") / "c.onnx")
    return config, str(path)


def test_concat_graph_writes_the_bound_present(tiny_concat_graph):
    """The ORT concat path: the layout's I/O (an all-ones attention_mask [batch, total] beside the caches), the
    present written into the preallocated buffer, the PyTorch absorbed stack's output."""
    import onnx

    from mla_deploy.bench.attention.ort_path import OrtPath

    config, graph = tiny_concat_graph
    model = onnx.load(graph)
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in list(model.graph.input) + list(model.graph.output)}
    assert dims["attention_mask"] == ["batch_size", "total_sequence_length"]
    assert dims["present_latent.1"] == ["batch_size", "total_sequence_length", config.latent_dim]
    inputs = make_inputs(config, 2, context=20, batch=2, seed=5)
    (ref, _), _ = _run(TorchPath(config, 2, 5, "A_CC"), inputs)
    (out, again), checks = _run(OrtPath(graph, "concat", threads=1, margin=8), inputs)
    assert checks == {"present_written_into_bound_buffer": True}
    assert np.array_equal(out, again) and np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()


def test_tensorrt_profile_comes_from_the_graph_io_and_the_layout():
    """The TensorRT profile of the static bench graph (pure Python): batch [1, B/2, B], the capacity over
    [2, cap/2, cap] (one engine for every point's T + margin), every fixed size and sequence_length 1 as is."""
    from mla_deploy.bench.attention.graph import stack_io
    from mla_deploy.bench.attention.trt_path import engine_profile
    from mla_deploy.cache_layout import STATIC

    config = load_recipe("tiny").model
    d, c = config.hidden_size, config.latent_dim
    profile = engine_profile(stack_io(config, 2, STATIC)[0], STATIC, max_batch=8, max_slots=80)
    cache = ((1, 1, 2, c), (4, 1, 40, c), (8, 1, 80, c))
    assert profile == {"hidden_states": ((1, 1, d), (4, 1, d), (8, 1, d)), "position_ids": ((1, 1), (4, 1), (8, 1)),
                       "write_indices": ((1,), (4,), (8,)), "past_latent.0": cache, "past_latent.1": cache}
