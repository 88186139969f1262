"""`mla-deploy serve --provider cuda` (marked ``gpu`` and ``ort_cuda``; skipped where ONNX Runtime's CUDA provider
does not load): continuous batching on the GPU, its CUDA graphs and device token choice, answers each greedy
prompt as `mla-deploy run --provider cuda` does."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("transformers")

from cli_run import cli  # noqa: E402
from mla_deploy.errors import RuntimeMissingError  # noqa: E402
from serving import PROMPTS, Server  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.ort_cuda]


@pytest.fixture(scope="module")
def cuda_server(request):
    """``(server, artifact)``; the provider is checked before the artifact is exported."""
    import onnxruntime as ort

    from mla_deploy.ort.cuda import require_cuda

    try:
        require_cuda(ort)
    except RuntimeMissingError as exc:
        pytest.skip(str(exc))
    artifact = request.getfixturevalue("artifact")
    running = Server(artifact, "--provider", "cuda", "--max-batch", "4")
    yield running, artifact
    assert running.stop() == 0


def test_serving_on_cuda_equals_run_on_cuda(cuda_server):
    cuda_server, artifact = cuda_server
    client = cuda_server.client()
    for prompt in PROMPTS[:4]:
        result = cli("run", artifact, "--prompt", prompt, "--max-new-tokens", "12", "--provider", "cuda", "--json")
        assert result.returncode == 0, result.stderr
        record = json.loads(result.stdout)
        assert record["token_choice"] == "device" and record["cuda_graph"].startswith("on"), record
        want = record["sequences"][0]
        reply = client.completions.create(model=cuda_server.model, prompt=prompt, max_tokens=12, temperature=0)
        assert reply.choices[0].text == want["text"]
        assert reply.usage.completion_tokens == len(want["tokens"])
