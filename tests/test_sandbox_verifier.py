"""Reading rewards: JUnit XML, pytest's summary line, exit codes, script output."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandbox.process import ProcessOutcome
from sandbox.verifier import Counts, junit_counts, score, script_number, summary_counts


def outcome(status="ok", exit_code=0, stdout="") -> ProcessOutcome:
    return ProcessOutcome(status=status, exit_code=exit_code, duration_s=0.1, stdout=stdout,
                          stderr="", stdout_bytes=len(stdout), stderr_bytes=0,
                          output_truncated=False)


def junit(tests, failures, errors, skipped, wrap=True) -> str:
    suite = (f'<testsuite name="pytest" tests="{tests}" failures="{failures}" '
             f'errors="{errors}" skipped="{skipped}"></testsuite>')
    return f"<testsuites>{suite}</testsuites>" if wrap else suite


counts = st.tuples(*(st.integers(min_value=0, max_value=50) for _ in range(4)))


@given(counts, st.booleans())
def test_junit_counts(c, wrap):
    passed, failed, errors, skipped = c
    got = junit_counts(junit(passed + failed + errors + skipped, failed, errors, skipped, wrap))
    assert got == Counts(passed=passed, total=passed + failed + errors)


@given(counts)
def test_summary_line_counts(c):
    passed, failed, errors, xfailed = c
    parts = [f"{n} {w}" for n, w in ((failed, "failed"), (passed, "passed"),
                                      (errors, "errors" if errors != 1 else "error"),
                                      (xfailed, "xfailed")) if n]
    line = (", ".join(parts) or "no tests ran") + " in 0.42s"
    got = summary_counts(f"....F\n=== FAILURES ===\nblah 3 passed here\n{line}\n")
    assert got == Counts(passed=passed, total=passed + failed + errors)


@pytest.mark.parametrize(
    ("kind", "result", "junit_text", "expected"),
    [
        ("pytest", outcome(exit_code=1), junit(4, 1, 0, 0), 0.75),
        ("pytest", outcome(exit_code=1, stdout="1 failed, 1 passed in 0.1s"), None, 0.5),
        ("pytest", outcome(exit_code=5, stdout="no tests ran in 0.01s"), None, None),
        ("pytest", outcome(exit_code=4, stdout="usage error"), None, None),
        ("pytest", outcome(status="timeout", exit_code=None), None, 0.0),
        ("binary", outcome(exit_code=0), None, 1.0),
        ("binary", outcome(status="crashed", exit_code=2), None, 0.0),
        ("script", outcome(stdout="log\n0.8\n\n"), None, 0.8),
        ("script", outcome(stdout="nan\n"), None, None),
        ("script", outcome(status="crashed", exit_code=1, stdout="0.9\n"), None, None),
    ],
)
def test_score(kind, result, junit_text, expected):
    assert score(kind, result, junit_text)[0] == expected


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_script_number_round_trips(x):
    assert script_number(f"noise\n{x!r}\n") == x
