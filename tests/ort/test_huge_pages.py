"""Huge pages: the commands that stream weights re-execute themselves with glibc's ``hugetlb`` tunable where the system
allows it (the others do not), its
large allocations then land on huge pages (read back from ``/proc``), a user's own setting wins, and engine
sessions spin (a server's do not)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from artifacts import text_artifact, tiny_artifact
from mla_deploy import host
from mla_deploy.cli import HUGE_PAGE_COMMANDS, command_of
from mla_deploy.ort import huge_pages
from mla_deploy.ort.engine import OrtEngine

SPINNING = "session.intra_op.allow_spinning"
AVAILABLE = host.thp_setting() in ("always", "madvise") and huge_pages._glibc()
needs_thp = pytest.mark.skipif(not AVAILABLE, reason="transparent huge pages or glibc 2.35+ are not available here "
                                                      f"(THP: {host.thp_setting()})")


def _bare_environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


@needs_thp
def test_the_tunable_is_added_to_an_environment_and_a_users_own_is_kept():
    assert huge_pages.environment_with_huge_pages({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    other = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "PATH": "/bin"}
    assert huge_pages.environment_with_huge_pages(other) == {
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "PATH": "/bin"}
    for own in ("glibc.malloc.hugetlb=0", "glibc.malloc.hugetlb=1", "glibc.malloc.hugetlb=2"):
        assert huge_pages.environment_with_huge_pages({"GLIBC_TUNABLES": own}) is None
    assert huge_pages.requested({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"})
    assert not huge_pages.requested({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})


def test_nothing_changes_where_the_system_has_no_transparent_huge_pages(tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    assert host.thp_setting(setting) == "never"
    assert host.thp_setting(tmp_path / "absent") == "unavailable"
    for thp in ("never", "unavailable", "not Linux"):
        assert huge_pages.environment_with_huge_pages({}, thp=thp) is None


@needs_thp
def test_with_the_tunable_a_large_allocation_lands_on_huge_pages_and_without_it_not_under_madvise():
    """The mechanism itself, in fresh interpreters: a 32 MiB malloc, written, read back from smaps_rollup."""
    code = "from mla_deploy.ort.huge_pages import probe; print(probe())"
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                        env=_bare_environment(GLIBC_TUNABLES="glibc.malloc.hugetlb=1"))
    assert on.returncode == 0 and on.stdout.strip() == "True", on.stderr
    if host.thp_setting() == "madvise":  # under "always" every allocation may get them anyway
        off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env=_bare_environment())
        assert off.returncode == 0 and off.stdout.strip() == "False", off.stderr


@needs_thp
@pytest.mark.parametrize("launcher", ["module", "script"])
def test_a_serving_command_reexecutes_itself_with_huge_pages_and_keeps_a_users_setting(launcher):
    """`mla-deploy serve` (console script and python -m) re-executes itself with the tunable: the same process
    (its pid) then holds it in its environment (``/proc/PID/environ`` is the environment of its last exec); with
    GLIBC_TUNABLES=glibc.malloc.hugetlb=0 given by the user it keeps the user's setting."""
    script = os.path.join(os.path.dirname(sys.executable), "mla-deploy")
    if launcher == "script" and not os.path.exists(script):
        pytest.skip(f"no console script at {script}")
    argv = [sys.executable, "-m", "mla_deploy"] if launcher == "module" else [script]
    for extra, expected in (({}, "glibc.malloc.hugetlb=1"), ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"},
                                                              "glibc.malloc.hugetlb=0")):
        server = subprocess.Popen([*argv, "serve", str(text_artifact("static")), "--port", "0", "--threads", "1"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  env=_bare_environment(**extra))
        try:
            while "serving " not in (line := server.stderr.readline()):
                assert line, "the server stopped before serving"
            environ = open(f"/proc/{server.pid}/environ", "rb").read().split(b"\0")
        finally:
            server.kill()
            server.wait(timeout=30)
        assert [e for e in environ if e.startswith(b"GLIBC_TUNABLES=")] == [f"GLIBC_TUNABLES={expected}".encode()]


def test_commands_that_stream_no_weights_start_without_reexecuting():
    """`doctor` (like export, build, validate, inspect and --help) runs in the process it was started in: it reports
    no tunable of its own."""
    assert command_of(["--verbose", "serve", "ART"]) == "serve" and command_of(["doctor"]) == "doctor"
    assert {"run", "serve", "bench"} == HUGE_PAGE_COMMANDS
    done = subprocess.run([sys.executable, "-m", "mla_deploy", "doctor", "--no-providers"], capture_output=True,
                          text=True, timeout=120, env=_bare_environment())
    assert done.returncode == 0, done.stderr
    line = next(l for l in done.stdout.splitlines() if l.startswith("huge pages"))
    assert "GLIBC_TUNABLES=(unset)" in line, line


def test_engine_sessions_spin_unless_asked_not_to_and_the_engine_reports_its_huge_pages():
    art = tiny_artifact("static")
    spinning = OrtEngine(art, threads=2)
    quiet = OrtEngine(art, threads=2, spin=False)
    for engine, expected in ((spinning, "1"), (quiet, "0")):
        for session in engine.sessions.values():
            assert session.get_session_options().get_session_config_entry(SPINNING) == expected
    assert "on huge pages (THP " in spinning.info()["huge_pages"]
