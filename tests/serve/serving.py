"""What the serving tests share: the prompts, a `mla-deploy serve` process driven over HTTP (:class:`Server`), the
same prompt generated alone in this process (:func:`solo`), and the one-line refusal of a failed command."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import openai

from hf_oracle import TEXT_PROMPTS
from mla_deploy.ort.engine import OrtEngine
from mla_deploy.generate import SamplingConfig, generate_text, load_tokenizer

PROMPTS = TEXT_PROMPTS + ["The quick brown fox", "你好", "emoji 🙂🙂 and more", "world hello world"]
KEY = "sk-test-key"


class Server:
    """A `mla-deploy serve` process on a free port (``env``: variables set for it); :meth:`stop` sends a signal and
    returns its exit status."""

    def __init__(self, artifact, *args, new_session: bool = False, env: dict | None = None):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mla_deploy", "serve", str(artifact), "--port", "0", "--threads", "1", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, start_new_session=new_session)
        seen = []  # the announcement, after whatever a library printed before it
        while not seen or not (match := re.search(r"serving .* at (http://127\.0\.0\.1:(\d+)/v1)", seen[-1])):
            seen.append(self.process.stderr.readline())
            assert seen[-1], "".join(seen)
        line = seen[-1]
        self.base, self.port = match.group(1), int(match.group(2))
        self.model = line.split("serving ")[1].split(" at ")[0]

    def client(self, key: str = "unused", **kw):
        return openai.OpenAI(base_url=self.base, api_key=key, max_retries=0, timeout=60, **kw)

    def raw(self, path: str, body: bytes | None = None, headers: dict | None = None, method: str | None = None):
        """``(status, headers (lower-case names), parsed JSON or text)`` of one plain HTTP request."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=body, method=method,
                                         headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                status, head, text = reply.status, {k.lower(): v for k, v in reply.headers.items()}, reply.read().decode()
        except urllib.error.HTTPError as error:
            status, head, text = error.code, {k.lower(): v for k, v in error.headers.items()}, error.read().decode()
        try:
            return status, head, json.loads(text)
        except ValueError:
            return status, head, text

    def metric(self, name: str) -> float:
        _, _, text = self.raw("/metrics")
        match = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
        assert match, name
        return float(match.group(1))

    def rss(self) -> int:
        """The server process's resident memory in bytes."""
        with open(f"/proc/{self.process.pid}/status") as status:
            return int(next(line for line in status if line.startswith("VmRSS:")).split()[1]) << 10

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        finally:
            self.process.kill()
            self.process.stderr.close()
            self.process.stdout.close()


def solo(artifact):
    """``run(ids, new, stop)``: the text, OpenAI finish reason and token count of one greedy generation in this
    process (``run.tokenizer``: the artifact's tokenizer)."""
    engine, tokenizer = OrtEngine(artifact, threads=1), load_tokenizer(artifact)

    def run(ids, new, stop=()):
        result = generate_text(engine, tokenizer, [ids], new, SamplingConfig(), stop)
        reason = result.generation.finish_reasons[0]
        return result.texts[0], {"eos": "stop", "stop": "stop", "length": "length"}[reason], \
            len(result.generation.tokens[0])

    run.tokenizer = tokenizer
    return run


def one_line_error(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@dataclass
class Load:
    """What :func:`load` saw: replies received, those that differed from their solo run, and client errors."""

    replies: int = 0
    wrong: list = field(default_factory=list)
    errors: list = field(default_factory=list)


def load(server: Server, alone, clients: int, seconds: float) -> Load:
    """``clients`` threads stream greedy completions from ``server`` at once, each starting a new request as soon as
    its last ends, until ``seconds`` have passed (0: one request each); every reply is compared with ``alone``'s."""
    cases = [(p, n) for n in (5, 9, 14, 20) for p in PROMPTS]
    expected = {case: alone(alone.tokenizer.encode(case[0]), case[1])[0] for case in cases}
    seen, lock, end = Load(), threading.Lock(), time.time() + seconds

    def client(index: int) -> None:
        api, turn = server.client(), 0
        while turn == 0 or time.time() < end:
            prompt, new = cases[(index + turn * clients) % len(cases)]
            turn += 1
            try:
                stream = api.completions.create(model=server.model, prompt=prompt, max_tokens=new, temperature=0,
                                                stream=True)
                text = "".join(c.choices[0].text for c in stream if c.choices)
            except Exception as exc:  # reported by the caller
                with lock:
                    seen.errors.append(repr(exc))
                return
            with lock:
                seen.replies += 1
                if text != expected[prompt, new]:
                    seen.wrong.append((prompt, new, text))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 300)
    return seen
