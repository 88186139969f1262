"""Huge pages: the command line re-executes itself with glibc's ``hugetlb`` tunable where the system allows it, its
large allocations then land on huge pages (read back from ``/proc``), a user's own setting wins, and engine
sessions spin (a server's do not)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from artifacts import tiny_artifact
from mla_deploy.ort import huge_pages
from mla_deploy.ort.engine import OrtEngine

SPINNING = "session.intra_op.allow_spinning"
AVAILABLE = huge_pages.thp_setting() in ("always", "madvise") and huge_pages._glibc()
needs_thp = pytest.mark.skipif(not AVAILABLE, reason="transparent huge pages or glibc 2.35+ are not available here "
                                                      f"(THP: {huge_pages.thp_setting()})")


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


def test_nothing_changes_where_the_system_has_no_transparent_huge_pages(tmp_path, monkeypatch):
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "THP_SETTING", setting)
    assert huge_pages.thp_setting() == "never"
    assert huge_pages.environment_with_huge_pages({}) is None
    monkeypatch.setattr(huge_pages, "THP_SETTING", tmp_path / "absent")
    assert huge_pages.thp_setting() == "unavailable"
    assert huge_pages.environment_with_huge_pages({}) is None


@needs_thp
def test_with_the_tunable_a_large_allocation_lands_on_huge_pages_and_without_it_not_under_madvise():
    """The mechanism itself, in fresh interpreters: a 32 MiB malloc, written, read back from smaps_rollup."""
    code = "from mla_deploy.ort.huge_pages import probe; print(probe())"
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                        env=_bare_environment(GLIBC_TUNABLES="glibc.malloc.hugetlb=1"))
    assert on.returncode == 0 and on.stdout.strip() == "True", on.stderr
    if huge_pages.thp_setting() == "madvise":  # under "always" every allocation may get them anyway
        off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env=_bare_environment())
        assert off.returncode == 0 and off.stdout.strip() == "False", off.stderr


@needs_thp
@pytest.mark.parametrize("launcher", ["module", "script"])
def test_the_command_line_reexecutes_itself_with_huge_pages_and_keeps_a_users_setting(launcher):
    """`mla-deploy doctor` (console script and python -m) reports its own allocations on huge pages; with
    GLIBC_TUNABLES=glibc.malloc.hugetlb=0 given by the user, it does not re-execute and says no."""
    script = os.path.join(os.path.dirname(sys.executable), "mla-deploy")
    if launcher == "script" and not os.path.exists(script):
        pytest.skip(f"no console script at {script}")
    argv = [sys.executable, "-m", "mla_deploy"] if launcher == "module" else [script]
    on = subprocess.run([*argv, "doctor", "--no-providers"], capture_output=True, text=True, timeout=120,
                        env=_bare_environment())
    assert on.returncode == 0, on.stderr
    line = next(l for l in on.stdout.splitlines() if l.startswith("huge pages"))
    assert "yes: weights load on 2 MiB pages" in line and "glibc.malloc.hugetlb=1" in line, line
    off = subprocess.run([*argv, "doctor", "--no-providers"], capture_output=True, text=True, timeout=120,
                         env=_bare_environment(GLIBC_TUNABLES="glibc.malloc.hugetlb=0"))
    assert off.returncode == 0, off.stderr
    line = next(l for l in off.stdout.splitlines() if l.startswith("huge pages"))
    if huge_pages.thp_setting() == "madvise":
        assert "no: weights load on 4 KiB pages" in line and "hugetlb=0" in line, line


def test_engine_sessions_spin_unless_asked_not_to_and_the_engine_reports_its_huge_pages():
    art = tiny_artifact("static")
    spinning = OrtEngine(art, threads=2)
    quiet = OrtEngine(art, threads=2, spin=False)
    for engine, expected in ((spinning, "1"), (quiet, "0")):
        for session in engine.sessions.values():
            assert session.get_session_options().get_session_config_entry(SPINNING) == expected
    assert "on huge pages (THP " in spinning.info()["huge_pages"]
