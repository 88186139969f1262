"""The ONNX Runtime engine against the PyTorch original: prefill + 64 decode steps, batch 2 of different
lengths, both cache modes; the static cache updated in place; the user errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from artifacts import reference_model, tiny_artifact
from cli_run import cli
from mla_deploy.cache_layout import get_layout
from mla_deploy.errors import ArtifactError, CacheCapacityError, InputError, RuntimeMissingError, ShapeError
from mla_deploy.model import ConcatCache, StaticCache
from mla_deploy.ort.engine import OrtEngine

PROMPTS = [[3, 14, 15, 92, 65, 35, 89], [27, 18, 28, 18]]  # lengths 7 and 4
STEPS = 64


def _padded(prompts):
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), dtype=np.int64)
    valid = np.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, : len(p)], valid[b, : len(p)] = p, 1
    return ids, valid


class TorchTrajectory:
    """The PyTorch original driven with the same protocol as the engine (right padding, per-sequence lengths)."""

    def __init__(self, model, mode: str, batch: int, capacity: int):
        self.model, self.mode = model, mode
        self.past = model.empty_cache(batch, capacity if mode == "static" else 0, layout=get_layout(mode))
        self.lengths = torch.zeros(batch, dtype=torch.long)
        self.key_valid = torch.zeros(batch, 0, dtype=torch.long)

    @torch.no_grad()
    def forward(self, ids, positions, valid):
        ids, positions, valid = (torch.from_numpy(np.ascontiguousarray(a)) for a in (ids, positions, valid))
        if self.mode == "concat":
            self.key_valid = torch.cat((self.key_valid, valid), dim=1)
            cache = ConcatCache(self.key_valid)
        else:
            cache = StaticCache(self.lengths.clone())
        logits, self.past = self.model(ids, positions, self.past, cache)
        self.lengths += valid.sum(1)
        return logits.numpy()


@pytest.mark.parametrize("mode", ["static", "concat"])
def test_engine_matches_pytorch_for_prefill_and_64_decode_steps(mode):
    root = tiny_artifact(mode)
    engine = OrtEngine(root, threads=1, capacity=96)
    reference = TorchTrajectory(reference_model(root), mode, len(PROMPTS), 96)
    state = engine.new_state(len(PROMPTS))
    ids, valid = _padded(PROMPTS)
    positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    got = engine.forward("prefill", ids, positions, state, valid)["logits"]
    want = reference.forward(ids, positions, valid)
    lengths = valid.sum(1)
    rows = np.arange(len(PROMPTS))
    np.testing.assert_allclose(got[rows, lengths - 1], want[rows, lengths - 1], atol=1e-4, rtol=0)
    token = got[rows, lengths - 1].argmax(-1)
    assert (token == want[rows, lengths - 1].argmax(-1)).all()
    worst = 0.0
    for _ in range(STEPS):
        positions = state.lengths[:, None].copy()
        got = engine.forward("decode", token[:, None], positions, state)["logits"][:, -1]
        want = reference.forward(token[:, None], positions, np.ones_like(positions))[:, -1]
        worst = max(worst, float(np.abs(got - want).max()))
        assert (got.argmax(-1) == want.argmax(-1)).all(), "greedy tokens differ"
        token = got.argmax(-1)
    assert worst <= 1e-4, worst
    assert state.lengths.tolist() == [7 + STEPS, 4 + STEPS]


@pytest.mark.parametrize("mode", ["static", "concat"])
def test_logits_index_returns_exactly_the_rows_asked_for(mode):
    """The graph's ``logits_index`` gathers rows before the lm_head: the rows it returns are the full logits' rows,
    in the order asked, and a prefill asked for the last real tokens computes ``[B, 1, V]`` only."""
    root = tiny_artifact(mode)
    engine = OrtEngine(root, threads=1)
    ids, valid = _padded(PROMPTS)
    positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    full = engine.forward("prefill", ids, positions, engine.new_state(2), valid)
    index = np.array([[6, 0, 3], [3, 3, 1]])
    picked = engine.forward("prefill", ids, positions, engine.new_state(2), valid, logits_index=index)
    assert picked["logits"].shape == (2, 3, engine.config.vocab_size)
    np.testing.assert_allclose(picked["logits"], np.take_along_axis(full["logits"], index[..., None], axis=1),
                               rtol=0, atol=1e-6)  # the same rows; a GEMM of other height may round differently
    for name in full:  # the caches do not depend on which logits were asked for
        if name != "logits":
            np.testing.assert_array_equal(picked[name], full[name])


@pytest.mark.parametrize("mode", ["static", "concat"])
def test_generate_equals_stepwise_pytorch_greedy(mode):
    root = tiny_artifact(mode)
    result = OrtEngine(root, threads=1).generate(PROMPTS, 20)
    assert result.provider == "CPUExecutionProvider"
    model = reference_model(root)
    for b, prompt in enumerate(PROMPTS):  # each sequence alone, no padding, full recompute each step
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(20):
                x = torch.tensor([ids])
                logits, _ = model(x, torch.arange(len(ids))[None], model.empty_cache(1))
                ids.append(int(logits[0, -1].argmax()))
        assert result.tokens[b] == ids[len(prompt):]


def test_static_cache_is_updated_in_place(capfd):
    """The buffer bound as past_latent.i is the one written, only the new rows change, and ONNX Runtime does
    not log that it fell back to copying the cache."""
    engine = OrtEngine(tiny_artifact("static"), threads=1, log_severity=1)  # warnings: the fallback logs one
    state = engine.new_state(2)
    ids, valid = _padded(PROMPTS)
    engine.forward("prefill", ids, np.broadcast_to(np.arange(ids.shape[1]), ids.shape), state, valid)
    pointers = [c.data_ptr() for c in state.caches]
    before = [c.numpy().copy() for c in state.caches]
    held = state.lengths.copy()
    capfd.readouterr()
    engine.forward("decode", np.array([[5], [6]]), held[:, None].copy(), state)
    log = capfd.readouterr()
    assert "in-place optimization not activated" not in log.out + log.err
    for layer, cache in enumerate(state.caches):
        assert cache.data_ptr() == pointers[layer]
        after = cache.numpy()
        changed = np.argwhere(np.any(after != before[layer], axis=-1))  # (b, 0, row)
        assert sorted((int(b), int(r)) for b, _, r in changed) == [(0, held[0]), (1, held[1])]
    # control: with a separate output buffer ONNX Runtime copies the cache, and says so in the same log
    session = engine.sessions["decode"]
    binding = session.io_binding()
    for name, value in (("input_ids", np.array([[5], [6]])), ("position_ids", held[:, None] + 1),
                        ("logits_index", np.zeros((2, 1), np.int64)), ("write_indices", held + 1)):
        binding.bind_cpu_input(name, value)
    for i, cache in enumerate(state.caches):
        binding.bind_ortvalue_input(f"past_latent.{i}", cache)
        binding.bind_output(f"present_latent.{i}", "cpu")
    binding.bind_output("logits", "cpu")
    session.run_with_iobinding(binding, engine.run_options)
    log = capfd.readouterr()
    assert "in-place optimization not activated" in log.out + log.err


def test_prompt_longer_than_the_static_capacity_is_refused():
    engine = OrtEngine(tiny_artifact("static"), threads=1, capacity=8)
    with pytest.raises(CacheCapacityError, match="capacity 8"):
        engine.generate([[1] * 7], 4)
    state = engine.new_state(1)
    with pytest.raises(CacheCapacityError):
        engine.forward("prefill", np.ones((1, 9), np.int64), np.arange(9)[None], state)


def test_bad_inputs_are_typed_errors():
    engine = OrtEngine(tiny_artifact("concat"), threads=1)
    with pytest.raises(InputError, match="outside the vocabulary"):
        engine.generate([[1, 2, 999]], 2)
    with pytest.raises(InputError):
        engine.generate([[]], 2)
    state = engine.new_state(1)
    state.caches[0] = np.zeros((1, 0, 7), np.float32)
    with pytest.raises(ShapeError, match="width 7"):
        engine.forward("prefill", np.ones((1, 2), np.int64), np.arange(2)[None], state)
    with pytest.raises(ShapeError):
        engine.forward("prefill", np.ones((2, 2), np.int64), np.arange(2)[None], state)


def test_cuda_provider_without_a_gpu_is_refused_not_silently_cpu():
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: the fallback cannot be provoked")
    with pytest.raises(RuntimeMissingError, match="fell back"):
        OrtEngine(tiny_artifact("static"), provider="cuda")


def test_missing_artifact_is_an_artifact_error(tmp_path):
    with pytest.raises(ArtifactError, match="no artifact directory"):
        OrtEngine(tmp_path / "nothing")
    with pytest.raises(ArtifactError, match="manifest.json"):
        OrtEngine(tmp_path)


def test_fp16_export_runs_on_onnx_runtime_cpu_close_to_fp32():
    """ONNX Runtime's CPU provider runs fp16 graphs (bf16 it cannot: see test_bf16_is_refused_by_ort_cpu)."""
    fp32 = OrtEngine(tiny_artifact("static"), threads=1).generate(PROMPTS, 4)
    fp16 = OrtEngine(tiny_artifact("static", "fp16"), threads=1)
    state = fp16.new_state(2)
    ids, valid = _padded(PROMPTS)
    logits = fp16.forward("prefill", ids, np.broadcast_to(np.arange(ids.shape[1]), ids.shape), state, valid)["logits"]
    reference = TorchTrajectory(reference_model(tiny_artifact("static")), "static", 2, 64)
    want = reference.forward(ids, np.broadcast_to(np.arange(ids.shape[1]), ids.shape), valid)
    rows, last = np.arange(2), valid.sum(1) - 1
    scale = np.abs(want[rows, last]).max()
    assert np.abs(logits[rows, last].astype(np.float32) - want[rows, last]).max() / scale < 2e-2
    assert len(fp32.tokens[0]) == 4


BF16_REFUSAL = ("bf16 artifacts need TensorRT or ONNX Runtime's CUDA provider; ONNX Runtime's CPU provider has no "
                "bf16 kernels (MatMul, Add, Mul, ...); export with --precision fp16 or fp32 to run on the CPU")


def test_bf16_is_refused_by_ort_cpu():
    """What ONNX Runtime 1.31's CPU provider cannot execute: bf16 arithmetic. The engine refuses it before opening a
    session, with one line saying where bf16 runs (not ONNX Runtime's NOT_IMPLEMENTED). The export is still checked
    (tests/exporter/test_export.py); bf16 runs on TensorRT or ONNX Runtime CUDA."""
    with pytest.raises(RuntimeMissingError) as refused:
        OrtEngine(tiny_artifact("static", "bf16"))
    assert str(refused.value) == BF16_REFUSAL


def test_every_command_refuses_bf16_on_the_cpu_in_one_line(tmp_path):
    """run, validate and bench --whole-model meet the engine's refusal up front: that one line, exit 1, no output
    folder made (validate refuses before loading the PyTorch reference, the bench before any worker)."""
    root = tiny_artifact("static", "bf16")
    commands = [("run", root, "--prompt-ids", "1,2,3", "--max-new-tokens", "2"),
                ("validate", root, "--out", tmp_path / "report"),
                ("bench", "--whole-model", "--artifact", root, "--out", tmp_path / "bench", "--no-transformers",
                 "--context", "0", "--batch", "1")]
    for args in commands:
        result = cli(*args)
        assert result.returncode == 1, (args[0], result.stderr)
        assert result.stderr.splitlines() == [f"mla-deploy: error: {BF16_REFUSAL}"], args[0]
    assert not (tmp_path / "report").exists() and not (tmp_path / "bench").exists()


def _identity_session(tmp_path, elem):
    import onnx
    import onnxruntime as ort

    x = onnx.helper.make_tensor_value_info("x", elem, [2, 3])
    y = onnx.helper.make_tensor_value_info("y", elem, [2, 3])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "identity", [x], [y])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.save(model, tmp_path / "identity.onnx")
    return ort, ort.InferenceSession(str(tmp_path / "identity.onnx"), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_bf16_values_cross_onnx_runtime_as_the_cuda_path_moves_them(tmp_path, precision):
    """The calls the CUDA provider's bf16 caches and logits go through (ONNX Runtime 1.31's Python API refuses
    ``ml_dtypes.bfloat16`` arrays: on the GPU every bf16 run failed with "Creation of OrtValues is currently only
    supported from non-string numpy arrays"), on a CPU session that only copies (Identity has bf16 kernels there):
    an OrtValue made from the array, read back, passed through ``run_with_ort_values`` and bound by address with
    :func:`element_type`. The bit patterns come back unchanged."""
    import onnx

    from mla_deploy.ort.engine import element_type, host_array, numpy_dtype, ortvalue

    dtype = numpy_dtype(precision)
    elem = onnx.TensorProto.BFLOAT16 if precision == "bf16" else onnx.TensorProto.FLOAT16
    ort, session = _identity_session(tmp_path, elem)
    array = (np.arange(6, dtype=np.float32).reshape(2, 3) / 7 - 0.3).astype(dtype)
    value = ortvalue(ort, array)
    assert value.data_type() == f"tensor({'bfloat16' if precision == 'bf16' else 'float16'})"
    assert host_array(ort, value).dtype == dtype
    assert host_array(ort, value).view(np.uint16).tolist() == array.view(np.uint16).tolist()
    out = host_array(ort, session.run_with_ort_values(None, {"x": value})[0])
    assert out.view(np.uint16).tolist() == array.view(np.uint16).tolist()
    binding = session.io_binding()
    result = np.zeros_like(array)
    binding.bind_input("x", "cpu", 0, element_type(dtype), list(array.shape), array.ctypes.data)
    binding.bind_output("y", "cpu", 0, element_type(dtype), list(result.shape), result.ctypes.data)
    session.run_with_iobinding(binding)
    assert result.view(np.uint16).tolist() == array.view(np.uint16).tolist()
