"""The seal on a Harbor task's pytest runs (sandbox/harbor/seal.py), its pure parts: how a
verifier phase's records split into runs, how each is judged against its expected tests, and
what test.sh's reward becomes. The shims and launcher in real runs are in
tests/integration/test_seal_shims.py; through Harbor, tests/integration/test_harbor_sealed.py."""

from __future__ import annotations

import hmac

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandbox import pytest_report
from sandbox.harbor.protocol import UNSEALED, SealReport
from sandbox.harbor.seal import (
    collect_report,
    judge_report,
    make_setups,
    sealed_reward,
    split_runs,
    view_files,
)
from sandbox.verifier import START, End, Tampered

TESTS = ["tests/test_a.py::test_0", "tests/test_a.py::test_1"]


def records(key: bytes, *bodies: bytes) -> bytes:
    mac = hmac.new(key, digestmod="sha256")
    return b"".join(pytest_report.seal(mac, i, b) for i, b in enumerate(bodies))


def end(outcomes: dict[str, str], exitstatus: int = 0) -> bytes:
    return msgspec.json.encode(End("end", sorted(outcomes.items()), [], exitstatus))


def honest_run(setup, results: dict[str, str], exitstatus: int = 0) -> bytes:
    s = setup.sentinels
    return records(setup.key, START, end({**results, f"/tmp/x.py::{s.passing}": "passed",
                                          f"/tmp/x.py::{s.failing}": "failed"}, exitstatus))


def test_setups_are_one_line_each_with_their_own_key():
    setups, lines = make_setups(collect=False, stub=False, runs=3)
    assert len(set(s.key for s in setups)) == 3
    assert [msgspec.json.decode(line)["key"] for line in lines.splitlines()] == [
        s.key.hex() for s in setups]


def test_honest_runs_are_judged_by_their_expected_tests():
    setups, _ = make_setups(False, False, runs=4)
    channel = honest_run(setups[0], dict.fromkeys(TESTS, "passed")) + honest_run(
        setups[1], {TESTS[0]: "passed", TESTS[1]: "failed"}, 1)
    report = judge_report(channel, setups, [TESTS, TESTS])
    assert (report.problem, report.passed, report.total) == (None, 3, 4)


@pytest.mark.parametrize(("forge", "problem"), [
    (lambda s: b"", "0 sealed pytest runs"),
    (lambda s: records(s[0].key, START), "ended before their report"),
    (lambda s: honest_run(s[0], dict.fromkeys(TESTS, "passed")) + b"rolltap-report {} 0\n",
     "without the launcher's seal"),
    (lambda s: records(b"x" * 32, START, end(dict.fromkeys(TESTS, "passed"))),
     "without the launcher's seal"),
    (lambda s: records(s[0].key, START, end(dict.fromkeys(TESTS, "passed"))),
     "did not run"),
    (lambda s: honest_run(s[0], dict.fromkeys(TESTS, "passed"), 2), "interrupted"),
    (lambda s: honest_run(s[0], {**dict.fromkeys(TESTS, "passed"), "tests/test_a.py::x": "passed"}),
     "unexpected test"),
    (lambda s: honest_run(s[0], dict.fromkeys(TESTS, "passed")) * 2, "without the launcher's"),
    (lambda s: honest_run(s[0], dict.fromkeys(TESTS, "passed"))
     + honest_run(s[1], dict.fromkeys(TESTS, "passed")), "2 sealed pytest runs"),
])
def test_a_report_that_is_not_whole_says_why(forge, problem):
    setups, _ = make_setups(False, False, runs=3)
    report = judge_report(forge(setups), setups, [TESTS])
    assert report.problem is not None and problem in report.problem, report


def test_records_of_no_key_are_tampering():
    setups, _ = make_setups(False, False, runs=2)
    with pytest.raises(Tampered):
        split_runs(records(b"y" * 32, START), [s.key for s in setups])


def test_collection_gives_each_runs_tests():
    setups, _ = make_setups(True, True, runs=2)
    collected = dict.fromkeys(TESTS, "collected")
    report = collect_report(records(setups[0].key, START, end(collected))
                            + records(setups[1].key, START, end(collected)), setups)
    assert (report.runs, report.expected, report.problem) == (2, [TESTS, TESTS], None)
    assert collect_report(b"", setups).runs == 0


reports = st.builds(SealReport, mode=st.just("judge"), runs=st.integers(0, 3),
                    problem=st.none() | st.text(min_size=1, max_size=5),
                    passed=st.integers(0, 5), total=st.integers(0, 5)).filter(
    lambda r: r.passed <= r.total)


@given(st.floats(0, 1), reports, st.booleans())
def test_the_sealed_reward_never_exceeds_what_the_report_bears_out(reward, report, sealed):
    got, tampered, detail = sealed_reward(reward, report, sealed)
    if not sealed:
        assert (got, tampered, detail) == (reward, False, UNSEALED)
        return
    assert got <= reward and (not tampered or got == 0.0)
    if report.problem is not None:
        assert got == (0.0 if reward > 0 else reward)
    else:
        share = report.passed / report.total if report.total else 0.0
        assert got == (reward if reward <= share + 1e-9 else 0.0)
    assert tampered == (got != reward)


def test_shims_name_the_seal_directory_they_live_in():
    files = view_files("/somewhere")
    assert {"bin/pytest", "bin/python3", "pytest_report.py"} <= set(files)
    assert '"/somewhere/bin"' in files["bin/python3"][1]
    assert "-I /somewhere/pytest_report.py" in files["bin/pytest"][1]


def _row(reward, detail, status="setup_failed"):
    from sandbox.state import FinishedRollout

    return FinishedRollout(task_id="t", repeat=0, member=0, rollout_id="r", group_id="g",
                           status="failed" if reward is None else "finished",
                           sandbox_status=status, reward=reward, reward_detail=detail,
                           duration_s=1.0)


def test_unscorable_rollouts_are_counted_by_cause_and_warned_above_a_share():
    from sandbox.summary import unscorable_lines, unsealed_lines

    rows = [_row(None, "unscorable: sandbox_failed: HealthcheckError"),
            _row(None, "unscorable: sandbox_failed: x"), _row(None, "boom", "error"),
            _row(1.0, f"harbor reward=1; {UNSEALED}", "ok"), *[_row(0.0, "x", "ok")] * 6]
    lines = unscorable_lines(rows, 0.1)
    assert lines[0] == "unscorable: 3 of 10 (sandbox_failed: 2, error: 1)"
    assert lines[1].startswith("WARNING: 30% of the rollouts are unscorable")
    assert unscorable_lines(rows, 0.5) == lines[:1]
    assert unscorable_lines(rows[3:], 0.1) == []
    assert unsealed_lines(rows) == [f"t: {UNSEALED}"]


def test_a_failed_agent_is_judged_only_once_the_gateway_answered_it():
    from sandbox.backends.base import SandboxResult
    from sandbox.gateway_client import CallInfo, RolloutInfo
    from sandbox.runner import answered_or_unscorable

    judged = SandboxResult(status="ok", reward=1.0, reward_detail="harbor reward=1",
                           host="h", agent_failed=True)
    answered = RolloutInfo("r", "running", calls=[CallInfo(0, "failed"), CallInfo(1, "ok")])
    assert answered_or_unscorable(judged, answered) is judged
    refused = answered_or_unscorable(judged, RolloutInfo("r", "running",
                                                         calls=[CallInfo(0, "failed")]))
    assert (refused.status, refused.reward) == ("setup_failed", None)
    assert refused.reward_detail.startswith("unscorable: unanswered:")
