"""The engine's device path, run on ONNX Runtime's CPU provider (the same binding and token-choice code the CUDA
provider runs): bindings made once and refreshed in place, caches reused per (batch, capacity), greedy and sampled
tokens chosen by the token-choice graphs equal to the host's through the generation loop, and the CUDA provider's
options as the engine would pass them."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from artifacts import tiny_artifact
from mla_deploy.errors import PlacementError
from mla_deploy.generate.sampling import SamplingConfig, draw, token_probabilities
from mla_deploy.ort import choice
from mla_deploy.ort.binding import DeviceLogits
from mla_deploy.ort.cuda import EAGER, MAX_GRAPHS, CudaOptions, CudaSession, GraphIds, placement_error, providers
from mla_deploy.ort.engine import OrtEngine

PROMPTS = [[3, 14, 15, 92, 65, 35, 89], [27, 18, 28, 18]]
SAMPLINGS = [SamplingConfig(1.0, seed=1), SamplingConfig(0.7, top_k=5, seed=2), SamplingConfig(1.3, top_p=0.8, seed=3),
             SamplingConfig(1.0, top_k=20, top_p=0.5, seed=4)]


@pytest.fixture(scope="module")
def engines():
    root = tiny_artifact("static")
    device = OrtEngine(root, threads=1, capacity=96)
    device.choose_tokens_on_device()
    return OrtEngine(root, threads=1, capacity=96), device


def test_a_decode_binds_once_and_its_buffers_keep_their_addresses(engines):
    """32 decode steps make one decode binding whose inputs, logits and caches stay at the same addresses; a new
    state of a dropped one's shape gets its caches, so a second generation of the same shape makes no binding."""
    _, engine = engines
    state = engine.new_state(2, rows=40)
    engine.prefill(np.array([p + [0] * (7 - len(p)) for p in PROMPTS]), np.array([7, 4]), state)
    made = engine.bindings.made
    tokens = np.array([1, 2])
    seen = set()
    for _ in range(32):
        logits = engine.decode(tokens, state)
        tokens = engine.argmax(logits)
        (step,) = [s for k, s in engine.bindings.kept.items() if k[0] == "decode"]
        seen.add((id(step.binding), step.logits.data_ptr(), *(v.data_ptr() for v in step.inputs.values()),
                  *(c.data_ptr() for c in state.caches)))
    assert engine.bindings.made == made + 1 and len(seen) == 1
    caches = [c.data_ptr() for c in state.caches]
    del state, logits
    again = engine.new_state(2, rows=40)
    assert [c.data_ptr() for c in again.caches] == caches
    del again
    first = engine.generate(PROMPTS, 8)
    made = engine.bindings.made
    assert engine.generate(PROMPTS, 8).tokens == first.tokens
    assert engine.bindings.made == made  # the second generation's state got the first's caches, and its bindings


def test_device_greedy_equals_the_hosts_through_the_loop(engines):
    host, device = engines
    assert host.info()["token_choice"] == "host" and device.info()["token_choice"] == "device"
    assert device.generate(PROMPTS, 24).tokens == host.generate(PROMPTS, 24).tokens


@pytest.mark.parametrize("config", SAMPLINGS, ids=lambda c: f"t{c.temperature}-k{c.top_k}-p{c.top_p}")
def test_device_sampling_equals_the_hosts_draws_under_the_same_seed(engines, config):
    """The loop hands the engine the sampler's uniforms; the device graph and the host's float64 draw pick the same
    tokens from them (30 steps x 2 sequences; only a uniform within float32 rounding of a boundary could differ)."""
    host, device = engines
    want = host.generate(PROMPTS, 30, config).tokens
    assert device.generate(PROMPTS, 30, config).tokens == want
    assert device.generate(PROMPTS, 30, SamplingConfig(config.temperature, config.top_k, config.top_p,
                                                       config.seed + 10)).tokens != want


def test_device_argmax_keeps_the_first_of_equal_maxima(engines):
    _, engine = engines
    logits = np.zeros((3, engine.vocab_size), np.float32)
    logits[0, [5, 9]] = 2.0
    logits[1] = -3.0
    logits[1, [0, 100]] = -1.0
    logits[2, -1] = 7.0
    value = engine.ort.OrtValue.ortvalue_from_numpy(logits)
    got = engine.argmax(DeviceLogits(engine, value, logits.shape))
    assert got.tolist() == logits.argmax(-1).tolist() == [5, 0, engine.vocab_size - 1]


def _session(model):
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("config", SAMPLINGS, ids=lambda c: f"t{c.temperature}-k{c.top_k}-p{c.top_p}")
def test_the_sampling_graph_inverts_the_hosts_cumulative(config):
    """Uniforms halfway between the host's cumulative boundaries pick, in the graph, exactly the tokens the host's
    draw picks: the graph's distribution is the host's, token for token (fp16 logits, 257 tokens, ties included)."""
    from onnx import TensorProto

    rng = np.random.default_rng(0)
    row = rng.normal(size=257).astype(np.float16)
    row[[3, 40, 41]] = row.max()  # equal maxima: the order among them is the stable sort's
    cumulative = np.cumsum(token_probabilities(row, config))
    edges = np.concatenate(([0.0], cumulative[np.flatnonzero(np.diff(np.concatenate(([0.0], cumulative))) > 0)]))
    uniforms = ((edges[:-1] + edges[1:]) / 2 / cumulative[-1]).astype(np.float32)
    batch = len(uniforms)
    session = _session(choice.sampling_graph(batch, row.size, TensorProto.FLOAT16, config.top_k))
    got = session.run(None, {"logits": np.tile(row, (batch, 1)), "temperature": np.array([config.temperature], np.float32),
                             "top_p": np.array([config.top_p], np.float32), "uniforms": uniforms})[0]
    want = draw(np.tile(row, (batch, 1)), config, uniforms.astype(np.float64))
    assert got.tolist() == want.tolist()
    assert sorted(set(want.tolist())) == sorted(np.flatnonzero(token_probabilities(row, config)).tolist())


def test_the_greedy_graph_on_fp16_and_bf16_logits():
    import ml_dtypes
    from onnx import TensorProto

    logits = np.random.default_rng(1).normal(size=(4, 300)).astype(np.float32)
    logits[2, [7, 8]] = 9.0
    assert (_session(choice.greedy_graph(4, 300, TensorProto.FLOAT16)).run(None, {"logits": logits.astype(np.float16)})[0]
            == logits.astype(np.float16).argmax(-1)).all()
    from mla_deploy.ort.engine import ortvalue

    bf16 = logits.astype(ml_dtypes.bfloat16)
    session = _session(choice.greedy_graph(4, 300, TensorProto.BFLOAT16))
    import onnxruntime as ort

    out = session.run_with_ort_values(None, {"logits": ortvalue(ort, bf16)})[0].numpy()
    assert out.tolist() == bf16.astype(np.float32).argmax(-1).tolist()


def test_the_cuda_provider_options_and_session_entries():
    fp32 = CudaOptions().provider("fp32", capture=True)
    assert fp32 == ("CUDAExecutionProvider", {"device_id": "0", "enable_cuda_graph": "1", "use_tf32": "0"})
    assert CudaOptions(cuda_graph=False, device_id=1).provider("bf16", capture=True)[1] == {
        "device_id": "1", "enable_cuda_graph": "0"}
    assert CudaOptions().provider("fp16", capture=False)[1]["enable_cuda_graph"] == "0"  # a prefill-only session
    assert CudaOptions().session_entries() == {"session.disable_cpu_ep_fallback": "1"}
    assert CudaOptions(fpa_intb=True, strict_placement=False).session_entries() == {"ep.cuda.fpa_intb_gemm": "1"}
    assert CudaOptions(fpa_intb=False).session_entries()["ep.cuda.fpa_intb_gemm"] == "0"
    # ONNX Runtime refuses the CPU provider listed beside disable_cpu_ep_fallback (checked on this CPU build)
    assert providers("CUDAExecutionProvider", CudaSession(CudaOptions(), "fp16"), True) == [
        CudaOptions().provider("fp16", True)]
    assert providers("CUDAExecutionProvider", CudaSession(CudaOptions(strict_placement=False)), False)[-1] == \
        "CPUExecutionProvider"
    assert providers("CPUExecutionProvider", None, False) == ["CPUExecutionProvider"]
    assert CudaOptions().session_entries(strict=False) == {}  # the session that lists the CPU nodes
    assert CudaSession(CudaOptions(cuda_graph=False), capture=True).capturing is False


def test_graph_ids_one_per_binding_within_the_limit_and_failures_say_why():
    ids = GraphIds(True)
    assert [ids.id_for(("decode", b)) for b in (1, 8, 1)] == [1, 2, 1]
    for b in range(100, 100 + MAX_GRAPHS):
        ids.id_for(("decode", b))
    assert ids.id_for(("decode", 999)) == EAGER and len(ids.ids) == MAX_GRAPHS
    ids.capture_failed(("decode", 8), "Memcpy node in the graph")
    assert ids.id_for(("decode", 8)) == EAGER and "Memcpy node in the graph" in ids.describe()
    off = GraphIds(False, "the concat cache grows every step")
    assert off.id_for(("decode", 1)) == EAGER and off.describe() == "off (the concat cache grows every step)"


def test_a_node_off_the_gpu_is_refused_in_one_line():
    error = placement_error("decode.onnx", collections.Counter({"NonZero": 192, "Shape": 4, "Gather": 2}))
    assert isinstance(error, PlacementError) and "\n" not in str(error)
    assert str(error).startswith("decode.onnx has 198 nodes ONNX Runtime's CUDA provider cannot run (NonZero x192, "
                                 "Shape x4, Gather x2)")
    assert "--allow-cpu-nodes" in str(error)
