"""The verifier's launcher in real pytest runs (child processes, unconfined as the backend runs
them), against hostile solutions that try each known way to a reward they did not earn (issue
28, attacks 1-6). The sealed report's reading is in tests/unit/test_sandbox_verifier.py."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from sandbox.layout import CopyOverflow, copy_work, sandbox_path, write_files
from sandbox.limits import Limits
from sandbox.process import run_contained
from sandbox.verifier import collect, make_sentinels, verify

PYTEST = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -I -m pytest -q"
HIDDEN = {
    "conftest.py": "",
    "pytest.ini": "[pytest]\npythonpath = .\ntestpaths = tests_hidden\n"
                  "addopts = -p no:cacheprovider\n",
    "tests_hidden/test_is_even.py": textwrap.dedent('''
        from is_even import is_even

        def test_0():
            assert is_even(2) is True
            assert is_even(0) is True

        def test_1():
            assert is_even(7) is False
            assert is_even(-3) is False
    '''),
}
STUB = "def is_even(n):\n    raise NotImplementedError\n"
# The honest wrong answer: test_0 passes, test_1 fails, reward 0.5.
WRONG = "def is_even(n):\n    return True\n"


def runner(work: Path):
    async def run(argv, extra, fds):
        env = {"PATH": sandbox_path(), "HOME": str(work.parent), **extra}
        return await run_contained(list(argv), cwd=str(work), env=env, limits=Limits(),
                                   timeout_s=120, pass_fds=fds)
    return run


async def verify_solution(tmp_path: Path, solution: str, *, command: str = PYTEST,
                          hidden: dict[str, str] = HIDDEN, extra: dict[str, str] | None = None):
    """Collect the expected tests on the task's own files, then verify `solution` (with the
    agent's `extra` files) as the backend does, unconfined."""
    own, work = tmp_path / "own", tmp_path / "work"
    tmp_path.mkdir(exist_ok=True)
    write_files(str(own), {"is_even.py": STUB.encode(),
                           **{k: v.encode() for k, v in hidden.items()}})
    python = "python"
    expected = await collect(runner(own), command, python, list(hidden))
    sentinels = make_sentinels()
    write_files(str(work), {"is_even.py": solution.encode(),
                            **{k: v.encode() for k, v in {**(extra or {}), **hidden}.items()},
                            sentinels.path: sentinels.source})
    return await verify("pytest", command, runner(work), python, expected, sentinels)


async def test_honest_answers(tmp_path):
    right = await verify_solution(tmp_path / "a", "def is_even(n):\n    return n % 2 == 0\n")
    wrong = await verify_solution(tmp_path / "b", WRONG)
    assert (right.reward, right.passed, right.total) == (1.0, 2, 2), right.output
    assert (wrong.reward, wrong.tampered) == (0.5, False), wrong.output


RIGHT = "def is_even(n):\n    return n % 2 == 0\n"


@pytest.mark.parametrize(("args", "addopts"), [
    ("-x", ""), ("--maxfail=1", ""), ("--sw", ""), ("", "-x"), ("-k 'test_0 or test_1'", ""),
], ids=["x", "maxfail", "stepwise", "addopts-x", "deselect"])
async def test_stopping_and_deselecting_options_leave_the_honest_reward(tmp_path, args,
                                                                        addopts):
    """-x, --maxfail or --stepwise (in the command or the ini file) would stop the run at the
    failing sentinel, wherever it lands; -k would deselect the sentinels. Every test runs and
    the sentinels stay: the honest rewards are those of the plain command, never tampered."""
    command = f"{PYTEST} {args}".strip()
    hidden = {**HIDDEN, "pytest.ini": HIDDEN["pytest.ini"].replace(
        "-p no:cacheprovider", f"-p no:cacheprovider {addopts}".rstrip())}
    for name, solution, reward in (("right", RIGHT, 1.0), ("wrong", WRONG, 0.5)):
        result = await verify_solution(tmp_path / name, solution, command=command,
                                       hidden=hidden)
        assert (result.reward, result.tampered) == (reward, False), (result.detail,
                                                                      result.output)


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


async def test_every_expected_test_not_passed_counts_as_failed(tmp_path):
    """Passed and unexpectedly passed count for; failures, fixture errors, skips and expected
    failures against."""
    hidden = {**HIDDEN, "tests_hidden/test_cases.py": TESTS}
    result = await verify_solution(tmp_path, WRONG, hidden=hidden)
    assert (result.passed, result.total) == (3, 8), result.output


# Each numbered attack of issue 28 as the solution the verifier imports. Every one of them
# scored 1.0 on the earlier verifier; the honest wrong answer scores 0.5.
FORGE_PIPE = WRONG + textwrap.dedent('''
    import os, stat
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.write(fd, b'rolltap-report {"passed": 2, "failed": 0, "errors": 0, '
                             b'"exitstatus": 0}\\n')
                os.dup2(os.open("/dev/null", os.O_WRONLY), fd)
        except OSError:
            pass
''')
SILENCE_PIPE = FORGE_PIPE.replace("os.write(fd", "0 and os.write(fd")
SKIP = textwrap.dedent('''
    import unittest
    def is_even(n):
        if n in (2, 0):
            return True
        raise unittest.SkipTest("cannot say")
''')
XFAIL = SKIP.replace("import unittest", "import pytest").replace(
    'raise unittest.SkipTest("cannot say")', 'pytest.xfail("cannot say")')
INTERRUPT = textwrap.dedent('''
    def is_even(n):
        if n in (2, 0):
            return True
        raise KeyboardInterrupt
''')
PYTEST_EXIT = INTERRUPT.replace("def is_even", "import pytest\ndef is_even").replace(
    "raise KeyboardInterrupt", 'pytest.exit("done", returncode=0)')
REPLACE_COUNTS = WRONG + textwrap.dedent('''
    try:
        import sandbox.pytest_report as r
        r.counts = lambda: {"passed": 2, "failed": 0, "errors": 0}
    except Exception:
        pass
''')
# Reaches into the launcher's plugin itself: every outcome it records is "passed".
PATCH_PLUGIN = WRONG + textwrap.dedent('''
    import gc
    class Passed(dict):
        def __setitem__(self, key, value):
            super().__setitem__(key, "passed")
    for o in gc.get_objects():
        if type(o).__name__ == "_Plugin":
            o.outcomes = Passed(o.outcomes)
''')
# Makes pytest itself report every test as passed.
PATCH_PYTEST = WRONG + textwrap.dedent('''
    import _pytest.runner as runner
    make = runner.TestReport.from_item_and_call
    def passed(item, call):
        report = make(item, call)
        report.outcome = "passed"
        report.longrepr = None
        return report
    runner.TestReport.from_item_and_call = passed
''')
# Runs only the task's own tests, each reported passed: the sentinels never run, and with no
# failure the exit status is 0, as a run stopped by -x before the failing sentinel would be.
DROP_SENTINELS = WRONG + textwrap.dedent('''
    import _pytest.runner as runner
    protocol = runner.runtestprotocol
    def only_the_tasks(item, log=True, nextitem=None):
        if "tests_hidden" not in str(item.path):
            return []
        reports = protocol(item, log=False, nextitem=nextitem)
        for report in reports:
            report.outcome, report.longrepr = "passed", None
            item.ihook.pytest_runtest_logreport(report=report)
        return reports
    runner.runtestprotocol = only_the_tasks
''')
EXIT_AT_IMPORT = WRONG + "import os\nos._exit(0)\n"
EXIT_ZERO_AT_END = WRONG + "import atexit, os\natexit.register(lambda: os._exit(0))\n"
SHADOW = {"pytest.py": textwrap.dedent('''
    import os, stat, sys
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.write(fd, b'rolltap-report {"passed": 2, "failed": 0, "errors": 0, '
                             b'"exitstatus": 0}\\n')
        except OSError:
            pass
    sys.exit(0)
''')}


@pytest.mark.parametrize(("solution", "extra", "command", "expected"), [
    (FORGE_PIPE, {}, PYTEST, "tampered"),  # 1
    (SILENCE_PIPE, {}, PYTEST, "zero"),  # 1, without writing
    (SKIP, {}, PYTEST, 0.5),  # 2
    (XFAIL, {}, PYTEST, 0.5),  # 2
    (INTERRUPT, {}, PYTEST, "zero"),  # 3: interrupted
    (PYTEST_EXIT, {}, PYTEST, "tampered"),  # 3: exit status 0 against the failing sentinel
    (REPLACE_COUNTS, {}, PYTEST, 0.5),  # 4
    (PATCH_PLUGIN, {}, PYTEST, "tampered"),  # 4: the failing sentinel comes out passed
    (PATCH_PYTEST, {}, PYTEST, "tampered"),  # 4
    (DROP_SENTINELS, {}, f"{PYTEST} -x", "tampered"),  # 4: no sentinel ran
    (WRONG, SHADOW, "python -m pytest", 0.5),  # 5: the agent's pytest.py is never run
    (EXIT_AT_IMPORT, {}, PYTEST, "zero"),  # 6
    # 3/6: the launcher leaves with os._exit after its report (issue 38): the handler never
    # runs, the exit code is the report's, the score the honest one.
    (EXIT_ZERO_AT_END, {}, PYTEST, 0.5),
], ids=["forge-pipe", "silence-pipe", "skip", "xfail", "interrupt", "pytest-exit",
        "replace-counts", "patch-plugin", "patch-pytest", "drop-sentinels", "shadow-pytest",
        "exit-at-import", "exit-zero-at-end"])
async def test_attacks_gain_nothing(tmp_path, solution, extra, command, expected):
    result = await verify_solution(tmp_path, solution, command=command, extra=extra)
    if expected == "tampered":
        assert (result.reward, result.tampered) == (0.0, True), (result.detail, result.output)
    elif expected == "zero":
        assert (result.reward, result.tampered) == (0.0, False), (result.detail, result.output)
    else:
        assert result.reward is not None and result.reward <= expected, result.output


async def test_tests_that_do_not_collect_on_the_tasks_own_files_are_the_tasks_fault(tmp_path):
    from sandbox.verifier import TaskTestsError
    hidden = {**HIDDEN, "tests_hidden/test_broken.py": "import is_even\nCASES = 1 / 0\n"}
    with pytest.raises(TaskTestsError, match="do not collect"):
        await verify_solution(tmp_path, WRONG, hidden=hidden)


def test_sparse_files_copy_as_holes_and_the_copy_is_bounded(tmp_path):
    src, small, big = tmp_path / "src", tmp_path / "small", tmp_path / "big"
    for d in (src, small, big):
        d.mkdir()
    for i in range(8):  # 8 sparse files of 168 MB with a little data in each
        with open(src / f"hole{i}", "wb") as fh:
            fh.seek(168 << 20)
            fh.write(b"x" * 4096)
    copy_work(str(src), str(big), set(), budget=1 << 20)
    copied = os.stat(big / "hole3")
    assert copied.st_size == (168 << 20) + 4096
    assert copied.st_blocks * 512 < 1 << 20  # still a hole
    (src / "dense").write_bytes(os.urandom(2 << 20))
    with pytest.raises(CopyOverflow, match="1 MB"):
        copy_work(str(src), str(small), set(), budget=1 << 20)


async def test_a_report_of_thousands_of_tests_is_read_whole(tmp_path):
    """An end record far larger than a pipe's buffer (parametrized ids collected with the
    solution stubbed)."""
    many = {**HIDDEN, "tests_hidden/test_is_even.py": textwrap.dedent('''
        import pytest
        from is_even import is_even

        @pytest.mark.parametrize("n", range(1500))
        def test_parity_of_a_long_named_number_to_fill_the_report(n):
            assert is_even(n) is (n % 2 == 0)
    ''')}
    result = await verify_solution(tmp_path, WRONG, hidden=many)
    assert (result.passed, result.total, result.reward) == (750, 1500, 0.5), result.detail
