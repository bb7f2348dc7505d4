"""Reading rewards: the pytest plugin's report line (and its tampering), exit codes, script
output; and the plugin itself in a real pytest run."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandbox import pytest_report
from sandbox.layout import sandbox_path
from sandbox.limits import Limits
from sandbox.process import ProcessOutcome, run_contained
from sandbox.verifier import Counts, Tampered, read_report, score, script_number, verify


def outcome(status="ok", exit_code=0, stdout="") -> ProcessOutcome:
    return ProcessOutcome(status=status, exit_code=exit_code, duration_s=0.1, stdout=stdout,
                          stderr="", stdout_bytes=len(stdout), stderr_bytes=0,
                          output_truncated=False)


def line(passed, failed, errors, exitstatus=0) -> bytes:
    body = {"passed": passed, "failed": failed, "errors": errors, "exitstatus": exitstatus}
    return pytest_report.PREFIX + json.dumps(body).encode() + b"\n"


counts = st.tuples(*(st.integers(min_value=0, max_value=10**6) for _ in range(3)))


@given(counts)
def test_report_line_round_trips(c):
    passed, failed, errors = c
    assert read_report(line(*c)) == Counts(passed, passed + failed + errors)


@given(counts, st.binary(min_size=1, max_size=200), st.booleans())
def test_anything_else_in_the_channel_is_tampering(c, noise, before):
    # Whatever the tested code writes into the channel, before or after the plugin's line.
    data = noise + line(*c) if before else line(*c) + noise
    with pytest.raises(Tampered):
        read_report(data)


@pytest.mark.parametrize("data", [b"rolltap-report {}\n", b"rolltap-report [1]\n",
                                  line(1, -1, 0), b"rolltap-report " + b"9" * 50 + b"\n",
                                  line(1, 0, 0)[:-1], b"\n"])
def test_malformed_lines_are_tampering(data):
    with pytest.raises(Tampered):
        read_report(data)


@pytest.mark.parametrize(
    ("kind", "result", "channel", "expected"),
    [
        ("pytest", outcome(exit_code=1), line(3, 1, 0, 1), (0.75, False)),
        ("pytest", outcome(exit_code=0), line(2, 0, 0), (1.0, False)),
        # A summary line on stdout is not a report: the tested code could print one.
        ("pytest", outcome(exit_code=0, stdout="5 passed in 0.1s"), b"", (None, False)),
        ("pytest", outcome(exit_code=5), line(0, 0, 0, 5), (None, False)),
        ("pytest", outcome(exit_code=0), line(2, 0, 0) + line(2, 0, 0), (0.0, True)),
        ("pytest", outcome(status="timeout", exit_code=None), b"", (0.0, False)),
        ("binary", outcome(exit_code=0), b"", (1.0, False)),
        ("binary", outcome(status="crashed", exit_code=2), b"", (0.0, False)),
        ("script", outcome(stdout="log\n0.8\n\n"), b"", (0.8, False)),
        ("script", outcome(stdout="nan\n"), b"", (None, False)),
        ("script", outcome(status="crashed", exit_code=1, stdout="0.9\n"), b"", (None, False)),
    ],
)
def test_score(kind, result, channel, expected):
    reward, _, _, tampered = score(kind, result, channel)
    assert (reward, tampered) == expected


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_script_number_round_trips(x):
    assert script_number(f"noise\n{x!r}\n") == x


TESTS = '''
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("fixture fails")

def test_pass(): pass
def test_fail(): assert False
def test_error(broken): pass
@pytest.mark.skip
def test_skipped(): pass
@pytest.mark.xfail
def test_xfail(): assert False
@pytest.mark.xfail
def test_xpass(): pass
'''


@pytest.mark.parametrize("forge", [False, True], ids=["honest", "forged"])
async def test_plugin_counts_a_real_pytest_run(tmp_path: Path, forge: bool):
    """The plugin in a real pytest process: passed and xpassed count as passed, failures and
    fixture errors against, skips and xfails not at all. A test that finds the pipe among its
    descriptors and writes a perfect report makes the result tampered, not a pass."""
    body = TESTS
    if forge:
        body += textwrap.dedent(f'''
            import os, stat
            def test_forge():
                for fd in map(int, os.listdir("/proc/self/fd")):
                    try:
                        if stat.S_ISFIFO(os.fstat(fd).st_mode):
                            os.write(fd, {line(99, 0, 0)!r})
                    except OSError:
                        pass
        ''')
    (tmp_path / "test_cases.py").write_text(body)

    async def run(extra, fds):
        env = {"PATH": sandbox_path(), "HOME": str(tmp_path), **extra}
        return await run_contained(["python", "-I", "-m", "pytest", "-q", "-p",
                                    "no:cacheprovider"], cwd=str(tmp_path), env=env,
                                   limits=Limits(), timeout_s=120, pass_fds=fds)

    result = await verify("pytest", run)
    if forge:
        assert (result.reward, result.tampered) == (0.0, True), result.output
    else:
        assert (result.passed, result.total) == (2, 4), result.output
        assert result.reward == 0.5 and not result.tampered
