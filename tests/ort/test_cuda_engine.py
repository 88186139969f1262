"""The engine on ONNX Runtime's CUDA provider (marked ``gpu`` and ``ort_cuda``; skipped where the provider does not
load): decode replaying a CUDA graph per batch gives the same tokens as decode without one, greedy and sampled,
over repeated generations on the same buffers; the tokens chosen on the device equal the host's choice from the
same logits."""

from __future__ import annotations

import numpy as np
import pytest

from artifacts import tiny_artifact
from mla_deploy.errors import RuntimeMissingError
from mla_deploy.generate.sampling import SamplingConfig
from mla_deploy.ort.cuda import CudaOptions

pytestmark = [pytest.mark.gpu, pytest.mark.ort_cuda]

PROMPTS = [[3, 14, 15, 92, 65, 35, 89], [27, 18, 28, 18]]


def _require_cuda_provider():
    import onnxruntime as ort

    from mla_deploy.ort.cuda import require_cuda

    try:
        require_cuda(ort)
    except RuntimeMissingError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def engines():
    _require_cuda_provider()
    from mla_deploy.ort.engine import OrtEngine

    root = tiny_artifact("static", "fp16")
    graph = OrtEngine(root, provider="cuda", capacity=64)
    eager = OrtEngine(root, provider="cuda", capacity=64, cuda=CudaOptions(cuda_graph=False))
    return graph, eager


def test_cuda_graph_replay_gives_the_same_tokens_as_without(engines):
    graph, eager = engines
    assert eager.info()["cuda_graph"] == "off"
    want = eager.generate(PROMPTS, 24).tokens
    assert graph.generate(PROMPTS, 24).tokens == want  # captured at the first decode step, then replayed
    assert graph.generate(PROMPTS, 24).tokens == want  # the same buffers: the captured graph replays from step 1
    assert graph.generate(PROMPTS[:1], 24).tokens == [want[0]]  # another batch: a graph of its own
    described = graph.info()["cuda_graph"]
    assert described.startswith("on, 2 captured") and "failed" not in described, described
    for config in (SamplingConfig(1.0, seed=3), SamplingConfig(0.8, top_k=20, top_p=0.9, seed=4)):
        assert graph.generate(PROMPTS, 24, config).tokens == eager.generate(PROMPTS, 24, config).tokens


def test_device_token_choice_equals_the_hosts_from_the_same_logits(engines):
    graph, _ = engines
    assert graph.info()["token_choice"] == "device"
    state = graph.new_state(2, rows=32)
    ids = np.array([p + [0] * (7 - len(p)) for p in PROMPTS])
    logits = graph.prefill(ids, np.array([7, 4]), state)
    assert graph.argmax(logits).tolist() == graph.to_host(logits).argmax(-1).tolist()
    from mla_deploy.generate.sampling import draw

    config, uniforms = SamplingConfig(1.0, top_k=50, seed=0), np.array([0.25, 0.75])
    assert graph.sample(logits, config, uniforms).tolist() == draw(graph.to_host(logits), config, uniforms).tolist()
