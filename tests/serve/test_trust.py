"""`mla-deploy serve` against hostile clients (issue 50), each through a real server process over real HTTP on
127.0.0.1: a client that leaves a plain (not streamed) request, a prompt of megabytes, streams that outlast the
grace at SIGTERM, connections that never finish their headers or body, headers of a megabyte, and bodies that a
lax server would turn into a 500 (lone surrogates, ids past int64, wrong types, a denormal temperature), and the
key and address checks of the command line."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("transformers")

from serving import KEY, Server, one_line_error  # noqa: E402

#: token ids and a seed whose sampled continuation (temperature 2) runs to max_tokens 250 on the tiny text model
#: without an end-of-sequence: about a quarter of a second of the engine alone, so that a queue of them holds the
#: single row for seconds
BUSY = {"prompt": [101, 25, 214], "max_tokens": 250, "temperature": 2, "seed": 2}


def post(server: Server, path: str, body: dict, headers: dict | None = None):
    return server.raw(path, json.dumps({"model": server.model, **body}).encode(), headers, method="POST")


def send_raw(port: int, path: str, body: dict, timeout: float = 60) -> socket.socket:
    """A socket that has sent one whole POST of ``body`` (its reply not read)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                 b"\r\n" % (path.encode(), len(data)) + data)
    return sock


def read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(1 << 16):
        out += chunk
    return out


def counter(server: Server, name: str, **labels) -> float:
    """A labelled sample of /metrics (0 when absent)."""
    _, _, text = server.raw("/metrics")
    shown = ",".join(f'{k}="{v}"' for k, v in labels.items())
    match = re.search(rf"^{re.escape(name)}{{{re.escape(shown)}}} ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def wait_for(condition, seconds: float = 10.0) -> bool:
    deadline = time.time() + seconds
    while not condition():
        if time.time() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture(scope="module")
def one_row(artifact):
    """A server of one row, so that requests queue behind each other; short client timeouts."""
    running = Server(artifact, "--max-batch", "1", "--max-queue", "8", "--client-timeout", "1")
    yield running
    assert running.stop() == 0


def test_clients_that_leave_plain_requests_free_their_places_before_they_run(one_row):
    """Six plain requests hold the row in turn; then a completion and a chat are sent and their clients close the
    connection at once: both are cancelled while they wait, not generated (only the six requests' tokens are)."""
    server, replies, lock = one_row, [], threading.Lock()
    before = server.metric("mla_deploy_generated_tokens_total")

    def blocker():
        status, _, reply = post(server, "/v1/completions", BUSY)
        with lock:
            replies.append((status, reply))

    threads = [threading.Thread(target=blocker) for _ in range(6)]
    for thread in threads:
        thread.start()
    assert wait_for(lambda: server.metric("mla_deploy_queue_depth") >= 4)
    ghosts = [send_raw(server.port, "/v1/completions", {"model": server.model, **BUSY, "seed": 8}),
              send_raw(server.port, "/v1/chat/completions", {"model": server.model, "messages": [
                  {"role": "user", "content": "hello"}], "max_tokens": 200, "temperature": 2, "seed": 9})]
    assert wait_for(lambda: server.metric("mla_deploy_queue_depth") >= 5)  # submitted: they wait for the row
    for ghost in ghosts:
        ghost.close()
    for thread in threads:
        thread.join(120)
    assert [status for status, _ in replies] == [200] * 6
    assert wait_for(lambda: server.metric("mla_deploy_batch_rows_in_use") == 0
                    and server.metric("mla_deploy_queue_depth") == 0)
    made = server.metric("mla_deploy_generated_tokens_total") - before
    assert made == sum(reply["usage"]["completion_tokens"] for _, reply in replies)


def test_a_giant_prompt_is_refused_before_it_is_tokenized_and_gives_its_memory_back(one_row):
    server = one_row
    assert post(server, "/v1/completions", {"prompt": "warm up", "max_tokens": 2})[0] == 200
    before = server.rss()
    giant = "hello world " * ((4 << 20) // 12 - 16)  # a body just under the 4 MiB limit
    start = time.time()
    status, _, reply = post(server, "/v1/completions", {"prompt": giant})
    took = time.time() - start
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
    assert "characters" in reply["error"]["message"]
    status, _, reply = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": giant}]})
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
    assert wait_for(lambda: server.rss() < before * 1.1, 5), (before >> 20, server.rss() >> 20)
    assert took < 5, took  # no tokenizer ran over the four megabytes (seconds of it, with the loop held)
    assert server.raw("/health")[0] == 200


def test_connections_that_idle_or_trickle_are_closed_and_headers_are_bounded(one_row):
    server = one_row
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as idle:  # says nothing at all
        assert read_all(idle).startswith(b"HTTP/1.1 408 ")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as slow:  # a header line per 0.2 s
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        start, cut = time.time(), None
        while time.time() - start < 10 and cut is None:
            try:
                slow.sendall(b"X-More: more\r\n")
                time.sleep(0.2)
            except OSError as exc:
                cut = exc
        assert cut is not None, "a head sent a line at a time for 10 s was never cut"
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as big:  # a megabyte of header
        try:
            big.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
            reply = read_all(big)
        except ConnectionResetError:  # answered and closed while the rest was still coming: the kernel resets
            reply = b"reset"
        assert reply.startswith(b"HTTP/1.1 400 ") or reply == b"reset", reply[:100]
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as trickle:  # a body that never comes
        trickle.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 100\r\n\r\n{")
        reply = read_all(trickle)
        assert reply.startswith(b"HTTP/1.1 408 ") and b"did not arrive" in reply
    assert counter(server, "mla_deploy_requests_total", endpoint="/v1/completions", status="408") >= 1
    assert server.raw("/health")[0] == 200


def surrogate_body(model: str, where: str) -> bytes:
    """A body whose JSON spells a lone surrogate (json.dumps would escape it the same way)."""
    text = json.dumps("a\ud800b")
    if where == "prompt":
        return f'{{"model": {json.dumps(model)}, "prompt": {text}}}'.encode()
    if where == "stop":
        return f'{{"model": {json.dumps(model)}, "prompt": "hi", "stop": [{text}]}}'.encode()
    return (f'{{"model": {json.dumps(model)}, "messages": [{{"role": "user", "content": {text}}}]}}').encode()


STRICT = [
    ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "16"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 16.0}, "max_tokens"),
    ({"prompt": "hi", "temperature": "0.5"}, "temperature"),
    ({"prompt": "hi", "seed": "1"}, "seed"),
    ({"prompt": "hi", "stream": "true"}, "stream"),
    ({"prompt": [1, 2 ** 64]}, "outside the vocabulary"),
    ({"prompt": [1, -(2 ** 70)]}, "outside the vocabulary"),
    ({"prompt": [[1, 2], [3, 10 ** 30]]}, "outside the vocabulary"),
]


@pytest.mark.parametrize("body, message", STRICT, ids=[f"{i}-{m}" for i, (_, m) in enumerate(STRICT)])
def test_wrong_types_and_ids_past_int64_are_400_not_coerced_nor_500(one_row, body, message):
    status, _, reply = post(one_row, "/v1/completions", body)
    assert status == 400 and message in reply["error"]["message"], reply


@pytest.mark.parametrize("path, where", [("/v1/completions", "prompt"), ("/v1/completions", "stop"),
                                         ("/v1/chat/completions", "messages")])
def test_text_that_is_not_utf8_is_400(one_row, path, where):
    status, _, reply = one_row.raw(path, surrogate_body(one_row.model, where), method="POST")
    assert status == 400 and "surrogate" in reply["error"]["message"], reply


def test_a_batch_the_queue_can_never_hold_is_400_not_429(one_row):
    status, head, reply = post(one_row, "/v1/completions", {"prompt": [[1, 2]] * 9, "max_tokens": 1})
    assert status == 400 and reply["error"]["code"] == "too_many_prompts" and "retry-after" not in head, reply


def test_a_denormal_temperature_is_the_greedy_reply(one_row, alone):
    ids = alone.tokenizer.encode("The quick brown fox")
    status, _, reply = post(one_row, "/v1/completions", {"prompt": ids, "max_tokens": 12, "temperature": 5e-324})
    assert status == 200 and reply["choices"][0]["text"] == alone(ids, 12)[0], reply


def test_413_is_counted_and_the_bearer_scheme_is_case_insensitive(artifact):
    server = Server(artifact, "--api-key", KEY)
    try:
        for scheme in ("Bearer", "bearer", "BEARER"):
            assert server.raw("/v1/models", headers={"Authorization": f"{scheme} {KEY}"})[0] == 200, scheme
        assert server.raw("/v1/models", headers={"Authorization": f"Basic {KEY}"})[0] == 401
        assert server.raw("/v1/models", headers={"Authorization": KEY})[0] == 401
        big = json.dumps({"model": server.model, "prompt": "a" * (5 << 20)}).encode()
        assert server.raw("/v1/completions", big, {"Authorization": f"Bearer {KEY}"}, method="POST")[0] == 413
        assert counter(server, "mla_deploy_requests_total", endpoint="/v1/completions", status="413") == 1
        assert counter(server, "mla_deploy_requests_total", endpoint="/v1/models", status="401") == 2
    finally:
        assert server.stop() == 0


def test_sigterm_ends_every_stream_with_an_error_event_and_done_within_the_grace(artifact):
    """Thirty streams queue for one row (seconds of work) with --grace 2: at SIGTERM those that finish in time
    finish, every other one gets an error event and [DONE]; the process exits 0 within the grace, no traceback."""
    grace = 2.0
    server = Server(artifact, "--max-batch", "1", "--max-queue", "40", "--grace", str(grace))
    streams = [send_raw(server.port, "/v1/completions", {"model": server.model, **BUSY, "stream": True})
               for _ in range(30)]
    assert wait_for(lambda: server.metric("mla_deploy_queue_depth") >= 25)
    replies = [b""] * len(streams)

    def read(i):
        replies[i] = read_all(streams[i])

    readers = [threading.Thread(target=read, args=(i,)) for i in range(len(streams))]
    for reader in readers:
        reader.start()
    start = time.time()
    server.process.send_signal(signal.SIGTERM)
    status = server.process.wait(30)
    took = time.time() - start
    for reader in readers:
        reader.join(30)
    stderr = server.process.stderr.read()
    server.stop()
    assert status == 0 and took < grace + 0.5, (status, took)
    assert "Traceback" not in stderr and "Cancel" not in stderr, stderr
    ended = 0
    for reply in replies:
        events = [json.loads(e) if e != b"[DONE]" else e for e in re.findall(rb"data: (.*)\n\n", reply)]
        assert events and events[-1] == b"[DONE]", reply[-300:]
        last = events[-2]
        if "error" in last:
            assert "shutting down" in last["error"]["message"]
            ended += 1
        else:
            assert last["choices"][0]["finish_reason"] == "length"
    assert ended >= 1  # the queue held more than the grace lets run


def serve_command(*args, env: dict | None = None, timeout: float = 120):
    return subprocess.run([sys.executable, "-m", "mla_deploy", "serve", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def test_an_empty_key_or_address_is_refused_in_one_line(artifact):
    assert "--api-key is empty" in one_line_error(serve_command(artifact, "--port", "0", "--api-key", ""))
    assert "--api-key is empty" in one_line_error(
        serve_command(artifact, "--port", "0", "--api-key", "", env={"MLA_DEPLOY_API_KEY": KEY}))
    assert "MLA_DEPLOY_API_KEY is empty" in one_line_error(
        serve_command(artifact, "--port", "0", env={"MLA_DEPLOY_API_KEY": ""}))
    assert "printable ASCII" in one_line_error(serve_command(artifact, "--port", "0", "--api-key", "a key"))
    assert "--host is empty" in one_line_error(serve_command(artifact, "--port", "0", "--host", ""))


def test_listening_beyond_loopback_without_a_key_warns_in_one_line(artifact):
    process = subprocess.Popen([sys.executable, "-m", "mla_deploy", "serve", str(artifact), "--host", "0.0.0.0",
                                "--port", "0", "--threads", "1"], stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        lines = []
        while not lines or "serving " not in lines[-1]:
            lines.append(process.stderr.readline())
            assert lines[-1], lines
        warnings = [line for line in lines if "warning" in line]
        assert len(warnings) == 1 and "without --api-key" in warnings[0], lines
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        process.stderr.close()
