"""`mla-deploy serve --replicas 2`: the same app as a Ray Serve deployment of two replicas on a local Ray cluster,
called through Serve's HTTP proxy with the official `openai` client; and the application builder Ray's own command
line and config files use. Skipped only where Ray is not installed or cannot start here."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'mla-deploy[ray]')")

from serving import PROMPTS, Server, one_line_error  # noqa: E402


@pytest.fixture(scope="module")
def cluster(artifact):
    try:
        running = Server(artifact, "--replicas", "2", "--max-batch", "4", "--max-queue", "16")
    except AssertionError as exc:
        if "Ray could not start" in str(exc):
            pytest.skip(f"Ray cannot start here: {exc}")
        raise
    yield running
    assert running.stop(signal.SIGTERM, timeout=120) == 0


def test_two_replicas_behind_the_proxy_answer_as_one_server_would(cluster, alone):
    client = cluster.client()
    assert [m.id for m in client.models.list()] == [cluster.model]
    instances = {cluster.raw("/health")[2]["instance"] for _ in range(24)}
    assert len(instances) == 2, instances  # the proxy spreads requests over both replicas
    cases = [(p, n) for p in PROMPTS for n in (6, 13)]
    expected = [alone(alone.tokenizer.encode(p), n)[0] for p, n in cases]
    replies, errors = [None] * len(cases), []

    def one(i, prompt, new):
        try:
            stream = cluster.client().completions.create(model=cluster.model, prompt=prompt, max_tokens=new,
                                                         temperature=0, stream=True)
            replies[i] = "".join(c.choices[0].text for c in stream if c.choices)
        except Exception as exc:  # reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=one, args=(i, *case)) for i, case in enumerate(cases)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors and replies == expected
    chat = client.chat.completions.create(model=cluster.model, messages=[{"role": "user", "content": PROMPTS[0]}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens >= 1
    status, _, reply = cluster.raw("/v1/completions", b'{"model": "x", "prompt": "hi"}', method="POST")
    assert status == 404 and "does not exist" in reply["error"]["message"]  # OpenAI's errors through the proxy


def test_the_builder_takes_rays_key_value_arguments(artifact):
    from mla_deploy.errors import InputError
    from mla_deploy.serve.ray_serve import app_builder

    app = app_builder({"artifact": str(artifact), "replicas": "3", "max_batch": "2", "use_engine": "false"})
    deployment = app._bound_deployment
    assert deployment.num_replicas == 3 and deployment.max_ongoing_requests == 2 + 256
    assert deployment.init_args[1].max_batch == 2 and deployment.init_args[1].use_engine is False
    with pytest.raises(InputError, match="unknown argument"):
        app_builder({"artifact": str(artifact), "max_btach": "2"})
    with pytest.raises(InputError, match="max_batch='two' is not an int"):
        app_builder({"artifact": str(artifact), "max_batch": "two"})
    with pytest.raises(InputError, match="artifact=PATH"):
        app_builder({"replicas": "2"})
    with pytest.raises(InputError, match="is empty"):  # never taken as "no key"
        app_builder({"artifact": str(artifact), "api_key": ""})


def test_what_cannot_be_scaled_out_is_refused_in_one_line(artifact, tmp_path):
    from artifacts import tiny_artifact
    from cli_run import cli

    assert "has no tokenizer files" in one_line_error(cli("serve", tiny_artifact("static"), "--replicas", "2"))
    assert "manifest" in one_line_error(cli("serve", tmp_path, "--replicas", "2"))
    assert "--replicas" in one_line_error(cli("serve", artifact, "--replicas", "0"))
    assert "Ray could not start at 127.0.0.1:1" in one_line_error(
        cli("serve", artifact, "--ray-address", "127.0.0.1:1"))


def test_the_samples_ray_configs_are_valid_serve_configs(artifact):
    """samples/04_ray_serve: the Serve config and the KubeRay RayService's serveConfigV2 pass Ray's own schema, and
    their arguments build the application (on this test's artifact)."""
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    from mla_deploy.serve.ray_serve import app_builder

    folder = Path(__file__).resolve().parents[2] / "samples" / "04_ray_serve"
    config = yaml.safe_load((folder / "serve_config.yaml").read_text())
    service = yaml.safe_load((folder / "rayservice.yaml").read_text())
    assert service["kind"] == "RayService" and yaml.safe_load(service["spec"]["serveConfigV2"]) == config
    for app in ServeDeploySchema.model_validate(config).applications:
        assert app.import_path == "mla_deploy.serve.ray_serve:app_builder"
        deployment = app_builder({**app.args, "artifact": str(artifact)})._bound_deployment
        assert deployment.num_replicas == app.args["replicas"]
        assert deployment.ray_actor_options["num_cpus"] == app.args["cpus_per_replica"]


def test_a_signal_to_the_whole_process_group_ends_it_within_the_grace_in_one_line(artifact):
    """`timeout`, `kill -- -PGID` and systemd's control-group stop signal a local cluster's own processes (its GCS and
    raylet) as well as the command: it must not wait a minute per Ray call for a cluster that is gone, nor print
    Ray's tracebacks. Either the application still went down cleanly (exit 0) or one line says the cluster did not
    answer (exit 1), within --grace plus the margin."""
    from mla_deploy.serve.ray_serve import TAKE_DOWN_MARGIN

    try:
        server = Server(artifact, "--replicas", "1", "--grace", "1", new_session=True)
    except AssertionError as exc:
        if "Ray could not start" in str(exc):
            pytest.skip(f"Ray cannot start here: {exc}")
        raise
    start = time.monotonic()
    os.killpg(server.process.pid, signal.SIGTERM)
    try:
        status = server.process.wait(1 + TAKE_DOWN_MARGIN + 20)
    finally:
        server.process.kill()
    took = time.monotonic() - start
    err = server.process.stderr.read()
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("mla-deploy: error:")]
    assert (status, lines) == (0, []) or (status == 1 and len(lines) == 1 and "did not answer" in lines[0]), err
    assert took < 1 + TAKE_DOWN_MARGIN + 15, took
