"""Property-based fuzzing of the command line's option values (issue 50): hypothesis gives each option below
integers far past int64, floats, NaN and infinities, and arbitrary text (lone surrogates included); whatever the
value, the command either succeeds or keeps the error contract (README, "Errors"): exactly one line on stderr,
``mla-deploy: error: ...``, a non-zero exit, no traceback. Run in this process (click's runner over the real
command group): each case costs milliseconds. Bounded and repeatable (a fixed number of derandomized examples)."""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cli_run import cli  # noqa: E402

VALUES = st.one_of(
    st.integers(min_value=-(2 ** 80), max_value=2 ** 80).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["", " ", "0", "-0", "1e400", "nan", "-inf", "0x10", "1_000", "\u0663", "9" * 40, "1,,2", ","]),
    st.text(max_size=24),
)

#: (the command line before the option, the options): every command here stops before any heavy work, at a path
#: that does not exist or at --dump-recipe, so that a value that is valid costs nothing either
COMMANDS = [
    (["serve", "/nonexistent/artifact"], ["--port", "--max-batch", "--max-cache-length", "--max-queue",
                                          "--request-timeout", "--grace", "--client-timeout", "--host", "--api-key",
                                          "--threads", "--replicas", "--prefill-chunk", "--prefix-cache-mb"]),
    (["run", "/nonexistent/artifact", "--prompt-ids", "1,2"], ["--max-new-tokens", "--temperature", "--top-k",
                                                               "--top-p", "--seed", "--threads", "--prefill-chunk"]),
    (["export", "--preset", "tiny", "--dump-recipe"], ["--max-cache-length", "--layers", "--precision",
                                                       "--weights", "--block-size", "--cache-mode"]),
]


@settings(max_examples=300, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(command=st.sampled_from(COMMANDS), data=st.data())
def test_any_option_value_succeeds_or_is_one_line_and_a_non_zero_exit(command, data):
    head, options = command
    option = data.draw(st.sampled_from(options))
    value = data.draw(VALUES)
    result = cli(*head, option, value)
    assert "Traceback" not in result.stderr, (option, value, result.stderr)
    if result.returncode == 0:
        return
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mla-deploy: error: "), (option, value, result.stderr)
    assert result.returncode in (1, 2), (option, value, result.returncode, result.stderr)
