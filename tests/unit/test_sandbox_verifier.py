"""Reading rewards: the launcher's sealed report (and every way it can be forged), exit codes,
script output. The launcher itself in real pytest runs, against hostile solutions (issue 28,
attacks 1-6), is in tests/integration/test_sandbox_verifier_runs.py."""

from __future__ import annotations

import hmac
import random

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandbox import pytest_report
from sandbox.process import ProcessOutcome
from sandbox.verifier import (
    START,
    End,
    Tampered,
    judge,
    make_sentinels,
    read_channel,
    score_command,
    score_pytest,
    script_number,
)

KEY = b"k" * 32
SENTINELS = make_sentinels(random.Random(7))
EXPECTED = frozenset({"tests/test_a.py::test_0", "tests/test_a.py::test_1"})


def outcome(status="ok", exit_code=0, stdout="") -> ProcessOutcome:
    return ProcessOutcome(status=status, exit_code=exit_code, duration_s=0.1, stdout=stdout,
                          stderr="", stdout_bytes=len(stdout), stderr_bytes=0,
                          output_truncated=False)


def sealed(*bodies: bytes, key: bytes = KEY) -> bytes:
    mac = hmac.new(key, digestmod="sha256")
    return b"".join(pytest_report.seal(mac, i, b) for i, b in enumerate(bodies))


def end(outcomes: dict[str, str] | list, exitstatus: int = 1) -> bytes:
    pairs = list(outcomes.items()) if isinstance(outcomes, dict) else outcomes
    return msgspec.json.encode(End("end", pairs, [], exitstatus))


def honest(results: dict[str, str]) -> dict[str, str]:
    """A run's outcomes with the sentinels as they must come out."""
    return {**results, f"s/t.py::{SENTINELS.passing}": "passed",
            f"s/t.py::{SENTINELS.failing}": "failed"}


outcomes = st.dictionaries(st.sampled_from(sorted(EXPECTED)),
                           st.sampled_from(["passed", "failed", "error", "skipped"]))


@given(outcomes)
def test_sealed_report_round_trips_and_counts_only_expected_passes(results):
    channel = sealed(START, end(honest(results)))
    started, record = read_channel(channel, KEY)
    assert started and record is not None
    counts = judge(record, 1, EXPECTED, SENTINELS)
    assert (counts.passed, counts.total) == (list(results.values()).count("passed"), 2)


@given(outcomes, st.binary(min_size=1, max_size=200), st.booleans())
def test_anything_else_in_the_channel_is_tampering(results, noise, before):
    whole = sealed(START, end(honest(results)))
    with pytest.raises(Tampered):
        read_channel(noise + whole if before else whole + noise, KEY)


@given(outcomes, st.integers(min_value=1))
def test_a_torn_report_or_another_key_is_tampering(results, cut):
    whole = sealed(START, end(honest(results)))
    last = len(whole) - len(sealed(START))
    with pytest.raises(Tampered):  # torn anywhere inside the end record
        read_channel(whole[:-(1 + cut % (last - 1))], KEY)
    with pytest.raises(Tampered):
        read_channel(sealed(START, end(honest(results)), key=b"x" * 32), KEY)


def test_record_order_and_count_are_sealed():
    body = end(honest({}))
    for channel in (sealed(body, START), sealed(START, body, body), sealed(body),
                    sealed(START, START)):
        with pytest.raises(Tampered):
            read_channel(channel, KEY)


@pytest.mark.parametrize(("results", "exit_code", "why"), [
    ([*honest({}).items(), ("tests/test_a.py::test_0", "passed")] * 1
     + [("tests/test_a.py::test_0", "failed")], 1, "twice"),
    (honest({"tests/test_a.py::test_2": "passed"}), 1, "unexpected"),
    ({**honest({}), f"s/t.py::{SENTINELS.failing}": "passed"}, 1, "sentinel"),
    ({**honest({}), f"s/t.py::{SENTINELS.passing}": "skipped"}, 1, "sentinel"),
    (honest({}), 0, "exit"),  # the failing sentinel makes pytest's status 1
    (honest({}), 3, "exit code 3"),
])
def test_reports_that_contradict_themselves_are_tampering(results, exit_code, why):
    pairs = list(results.items()) if isinstance(results, dict) else results
    record = msgspec.json.decode(end(pairs, exitstatus=exit_code if exit_code != 3 else 1),
                                 type=End)
    with pytest.raises(Tampered, match=why):
        judge(record, exit_code, EXPECTED, SENTINELS)


@pytest.mark.parametrize("missing", ["passing", "failing"])
def test_a_sentinel_missing_from_a_whole_run_is_tampering(missing):
    results = {k: v for k, v in honest({"tests/test_a.py::test_0": "passed"}).items()
               if not k.endswith(getattr(SENTINELS, missing))}
    status = 1 if missing == "passing" else 0
    record = msgspec.json.decode(end(results, exitstatus=status), type=End)
    with pytest.raises(Tampered, match="did not run"):
        judge(record, status, EXPECTED, SENTINELS)


def test_an_interrupted_run_scores_zero_whatever_ran_before():
    # KeyboardInterrupt or pytest.exit from the tested code, or tests that do not collect:
    # the sentinels may not have run, and what had passed before does not count.
    channel = sealed(START, end({"tests/test_a.py::test_0": "passed"}, exitstatus=2))
    scored = score_pytest(outcome(exit_code=2), channel, KEY, EXPECTED, SENTINELS)
    assert (scored.reward, scored.tampered) == (0.0, False)
    assert "interrupted" in scored.detail


def test_tests_outside_the_tasks_files_are_not_counted_and_missing_ones_fail():
    # An agent's own test file is no forgery; an expected test that never ran is a failure.
    record = msgspec.json.decode(end(honest({"test_mine.py::test_x": "passed",
                                             "tests/test_a.py::test_1": "passed"})), type=End)
    counts = judge(record, 1, EXPECTED, SENTINELS)
    assert (counts.passed, counts.total) == (1, 2)


@pytest.mark.parametrize(("result", "channel", "expected"), [
    (outcome(exit_code=1), sealed(START, end(honest({"tests/test_a.py::test_0": "passed"}))),
     (0.5, False)),
    # A summary line on stdout is not a report: the tested code could print one.
    (outcome(exit_code=0, stdout="5 passed in 0.1s"), b"", (None, False)),
    # Started, then ended before the report: the tested code's doing, scored 0.
    (outcome(exit_code=0), sealed(START), (0.0, False)),
    (outcome(status="crashed", exit_code=-9), sealed(START), (0.0, False)),
    (outcome(exit_code=0), sealed(START) + b"rolltap-report {}\n", (0.0, True)),
    (outcome(status="timeout", exit_code=None), b"", (0.0, False)),
])
def test_score_pytest(result, channel, expected):
    scored = score_pytest(result, channel, KEY, EXPECTED, SENTINELS)
    assert (scored.reward, scored.tampered) == expected


@pytest.mark.parametrize(("kind", "result", "expected"), [
    ("binary", outcome(exit_code=0), 1.0),
    ("binary", outcome(status="crashed", exit_code=2), 0.0),
    ("script", outcome(stdout="log\n0.8\n\n"), 0.8),
    ("script", outcome(stdout="nan\n"), None),
    ("script", outcome(status="crashed", exit_code=1, stdout="0.9\n"), None),
])
def test_score_command(kind, result, expected):
    assert score_command(kind, result).reward == expected


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_script_number_round_trips(x):
    assert script_number(f"noise\n{x!r}\n") == x


@pytest.mark.parametrize(("command", "args"), [
    ("PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -I -m pytest -q", ["-q"]),
    ("python3 -m pytest -k 'not (slow)' tests", ["-k", "not (slow)", "tests"]),
    ("pytest", []),
])
def test_pytest_commands(command, args):
    assert pytest_report.pytest_command(command)[1] == args


@pytest.mark.parametrize("command", ["python x.py", "pytest; echo 1.0", "sh -c pytest",
                                     "python -m pytest $(cat args)", "pytest > out", "'"])
def test_other_pytest_commands_are_refused(command):
    with pytest.raises(ValueError, match="must read"):
        pytest_report.pytest_command(command)


# ---- real pytest runs ---------------------------------------------------------------------
