"""The documentation: the MkDocs site builds with ``--strict`` (a broken link or anchor fails it), README.md stays
short and free of dated history, and every shell block of README.md runs as written on a fresh tiny setup.

The README's commands run in order, in one temporary folder, with the tests' interpreter's ``mla-deploy`` first on
PATH and this checkout's package on PYTHONPATH. ``path/to/DeepSeek-V2-Lite-Chat`` is a real folder there: a tiny
DeepSeek-V2 checkpoint with a tokenizer, written by transformers itself (:func:`hf_oracle.text_checkpoint`). A
block preceded by ``<!-- needs: WHAT -->`` is skipped with WHAT as the reason (a GPU, TensorRT, a llama.cpp build);
``make demo`` and ``make test`` are the Makefile's own targets and are not run here. ``serve`` is started, asked one
chat completion over loopback, and stopped with SIGTERM.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CHECKPOINT = "path/to/DeepSeek-V2-Lite-Chat"
#: the longest a README command may take on one core (the whole file runs in about two minutes)
COMMAND_TIMEOUT = 300
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")


def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is in the test extra: pip install -e '.[test]'")
    pytest.importorskip("material", reason="mkdocs-material is in the test extra: pip install -e '.[test]'")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                             "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def test_readme_is_short_and_has_no_dated_history():
    lines = README.read_text().splitlines()
    assert len(lines) <= 400, f"README.md has {len(lines)} lines; the rest belongs in docs/"
    dated = [line for line in lines if DATE.search(line)]
    assert len(dated) <= 3, "README.md lines with a date (results carry theirs in benchmarks/results/):\n" + \
        "\n".join(dated)


def test_the_docs_carry_no_dated_history():
    """A date belongs to a result file (benchmarks/results/, the GPU check's record), not to the prose."""
    records = {"gpu-verification.md"}  # written by benchmarks/gpu_check.sh: its status line names the run's date
    dated = [f"{page.name}: {line}" for page in sorted((ROOT / "docs").glob("*.md")) if page.name not in records
             for line in page.read_text().splitlines() if DATE.search(line)]
    assert not dated, "\n".join(dated)


def test_the_readme_links_resolve():
    """README.md is read on the repository's page, where mkdocs does not check it: each relative link names a file
    or folder of the checkout."""
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert links and not missing, missing


def documented_commands() -> list[tuple[str, str]]:
    """Every ``mla-deploy ...`` command line in the code blocks of README.md and docs/ (a synopsis with its
    indented continuation lines), as (where, the command without a trailing comment)."""
    found = []
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        in_block, command = False, None
        for line in page.read_text().splitlines() + [""]:
            if line.strip().startswith("```"):
                in_block, command = not in_block, None
                continue
            if not in_block:
                continue
            text = line.strip().removeprefix("$ ")
            if command is not None and line[:1].isspace() and not line.strip().startswith("$"):
                command += " " + text
                found[-1] = (found[-1][0], command)
                continue
            command = None
            if text.startswith("mla-deploy "):
                command = text.split(" #")[0]
                found.append((page.name, command))
    return found


def test_the_documented_commands_and_options_exist():
    """The commands and options the docs show are the command line's (caught here without running them)."""
    import click

    from mla_deploy.cli import main

    commands = documented_commands()
    assert len(commands) > 20
    wrong = []
    for where, command in commands:
        words = command.split()
        cmd = main.commands.get(words[1])
        if isinstance(cmd, click.Group) and len(words) > 2 and words[2] in cmd.commands:
            cmd = cmd.commands[words[2]]
        if cmd is None:
            wrong.append(f"{where}: {command}: no command {words[1]!r}")
            continue
        known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
        wrong += [f"{where}: {command}: no option {o}" for o in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", command)
                  if o not in known]
    assert not wrong, "\n".join(wrong)


def shell_blocks(text: str) -> list[tuple[str | None, list[str]]]:
    """The ```bash blocks of ``text`` in order: (what the block needs, from a ``<!-- needs: ... -->`` line just
    before it, else None; its command lines)."""
    blocks, needs, lines = [], None, text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        marker = re.fullmatch(r"<!--\s*needs:\s*(.+?)\s*-->", line)
        if marker:
            needs = marker.group(1)
        elif line == "```bash":
            body = []
            i += 1
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            commands = [c.strip() for c in body if c.strip() and not c.strip().startswith("#")]
            blocks.append((needs, commands))
            needs = None
        elif line:
            needs = None
        i += 1
    return blocks


def readme_commands() -> list:
    params = []
    for needs, commands in shell_blocks(README.read_text()):
        for command in commands:
            marks = [pytest.mark.skip(reason=f"needs {needs}")] if needs else []
            if command.startswith("make "):
                marks = [pytest.mark.skip(reason="the Makefile's own target (a fresh venv, the whole suite): "
                                                 "run by `make`, not by this test")]
            params.append(pytest.param(command, marks=marks, id=command[:80]))
    return params


def test_the_readme_block_parser_reads_markers_and_blocks():
    text = "x\n\n```bash\na --b  # c\n# only a comment\n```\n<!-- needs: a GPU -->\n```bash\ng\n```\n```bash\nh\n```\n"
    assert shell_blocks(text) == [(None, ["a --b  # c"]), ("a GPU", ["g"]), (None, ["h"])]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A fresh folder holding only the tiny checkpoint at the README's placeholder path, and the environment the
    README's commands run in."""
    from hf_oracle import text_checkpoint

    work = tmp_path_factory.mktemp("readme")
    text_checkpoint(work / CHECKPOINT, version=2)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep),
           "OMP_NUM_THREADS": "1"}
    return work, env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_once(command: str, work: Path, env: dict) -> None:
    """Start ``command`` (an ``mla-deploy serve``) on a free loopback port, ask it one chat completion, stop it
    with SIGTERM: it must answer and exit 0."""
    artifact = work / command.split()[2]
    assert json.loads((artifact / "manifest.json").read_text())["cache"]["mode"] == "static"  # the default export
    port = free_port()
    # no shell in between, so that SIGTERM reaches the server itself
    argv = [shutil.which("mla-deploy", path=env["PATH"]), *shlex.split(command)[1:], "--port", str(port)]
    server = subprocess.Popen(argv, cwd=work, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"serve did not come up: {server.communicate()[0]}") from None
                time.sleep(0.5)
        body = json.dumps({"model": Path(CHECKPOINT).name, "messages": [{"role": "user", "content": "Hi"}],
                           "max_tokens": 8, "temperature": 0}).encode()
        request = urllib.request.Request(f"{base}/v1/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            answer = json.loads(reply.read())
        assert answer["choices"][0]["message"]["role"] == "assistant"
        assert answer["usage"]["completion_tokens"] >= 1
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
        try:
            output = server.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            output = server.communicate()[0]
    assert server.returncode == 0, f"exit {server.returncode}: {output}"


@pytest.mark.slow
@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_runs_as_written(command, workdir):
    work, env = workdir
    if command.startswith("mla-deploy serve "):
        serve_once(command, work, env)
        return
    result = subprocess.run(command, shell=True, cwd=work, env=env, capture_output=True, text=True,
                            timeout=COMMAND_TIMEOUT)
    assert result.returncode == 0, f"{command}\nexit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
