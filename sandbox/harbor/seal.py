"""rolltap's seal on the pytest runs of a Harbor task's verifier (issue 38).

A Harbor task grades itself: tests/test.sh runs the task's tests (pytest, almost always) and
writes a reward from what they say, and the tested code runs inside that pytest. In the bwrap
environment's verifier phase the view (verifier_view.py) holds a directory of rolltap's own
(SEAL_DIR, root's, read-only to the verifier) first on PATH: `pytest`, `py.test` and the
`python` names there start the real ones, but `pytest ...` and `python -m pytest ...` start
rolltap's launcher (sandbox/pytest_report.py) with the same arguments and that interpreter,
isolated (-I), so a pytest.py, sitecustomize or .pth of the workdir is never imported first.
Each launcher takes one setup line (a one-time key, its sentinels) from a pipe and reports
over another, in records sealed with that key, as rolltap's own pytest verifier does.

The runner learns each task's expected tests once, from a collection trial on the task's own
files (the oracle's solution where the task has one; else the workdir's modules stubbed):
`collect` mode, whose pytest runs only collect. A task whose collection saw no sealed pytest
run (test.sh runs another checker, or reaches pytest by a path the shims do not cover: a
venv's, uv's) is unsealed: its verdict is test.sh's, and the run's summary says so.

In `judge` mode the report of each run must be whole (verifier.read_channel, verifier.judge:
the launcher's seal, the sentinels, no unexpected test, not interrupted), the runs as many as
collection saw; then test.sh's reward stands if it is no more than the share of expected tests
that passed. Otherwise the reward is 0 and the rollout is tampered (sealed_reward).
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from sandbox import pytest_report
from sandbox.harbor.protocol import UNSEALED, SealReport
from sandbox.verifier import Sentinels, Tampered, drain, judge, make_sentinels, read_channel

SEAL_DIR = ".rolltap-seal"  # a top-level directory of the verifier's view
# Setups the verifier phase offers: a test.sh that runs pytest more often runs unsealed after.
MAX_RUNS = 8
PYTHONS = ("python", "python3", *(f"python3.{minor}" for minor in range(8, 15)))

# `$0` is the shim's path: the real command is the first of its name on PATH after SEAL_DIR.
SHIM = r"""#!/bin/sh
# rolltap's seal (sandbox/harbor/seal.py): pytest runs through rolltap's launcher.
name=${0##*/}
real=
IFS=:
for dir in $PATH; do
  [ "$dir" = "%(bin)s" ] && continue
  [ -x "$dir/$name" ] && [ ! -d "$dir/$name" ] && { real=$dir/$name; break; }
done
unset IFS
[ -n "$real" ] || { echo "$name: command not found" >&2; exit 127; }
%(body)s
exec "$real" "$@"
"""

# A python shim: interpreter flags, then `-m pytest`: the launcher instead, with that python.
PYTHON_BODY = r"""skip() {
  n=0
  while [ $# -gt 0 ]; do
    case $1 in
      -m) [ "$2" = pytest ] || [ "$2" = py.test ] && { echo $((n + 2)); return; }; break ;;
      -X|-W) n=$((n + 2)); shift 2 ;;
      -c|-|--) break ;;
      -*) n=$((n + 1)); shift ;;
      *) break ;;
    esac
  done
  echo -1
}
n=$(skip "$@")
if [ "$n" -ge 0 ]; then
  shift "$n"
  ROLLTAP_CWD_PATH=1 ROLLTAP_SETUP_LINES=1 exec "$real" -I %(launcher)s "$@"
fi"""

# The pytest shim: the interpreter of the real pytest's #! line.
PYTEST_BODY = r"""IFS= read -r line < "$real"
case $line in
  "#!"*) ROLLTAP_SETUP_LINES=1 exec ${line#??} -I %(launcher)s "$@" ;;
esac"""


def view_files(where: str = f"/{SEAL_DIR}") -> dict[str, tuple[int, str]]:
    """The seal directory's files, for it at `where` (the verifier's view: /SEAL_DIR):
    relative path -> (mode, text)."""
    names = {"bin": f"{where}/bin", "launcher": f"{where}/pytest_report.py"}
    python = SHIM % {**names, "body": PYTHON_BODY % names}
    pytest = SHIM % {**names, "body": PYTEST_BODY % names}
    with open(pytest_report.__file__) as fh:
        files = {"pytest_report.py": (0o644, fh.read())}
    files.update({f"bin/{n}": (0o755, python) for n in PYTHONS})
    files.update({f"bin/{n}": (0o755, pytest) for n in ("pytest", "py.test")})
    return files


class Setup(msgspec.Struct, frozen=True):
    key: bytes
    sentinels: Sentinels


def make_setups(collect: bool, stub: bool, runs: int = MAX_RUNS
                ) -> tuple[list[Setup], bytes]:
    """The setups of one verifier phase and the setup pipe's bytes: one line each."""
    setups, lines = [], []
    for _ in range(runs):
        key, sentinels = secrets.token_bytes(32), make_sentinels()
        line: dict = {"key": key.hex()}
        if collect:
            line.update(keep=[], stub=stub)
        else:
            line["sentinel_source"] = sentinels.source.decode()
        setups.append(Setup(key, sentinels))
        lines.append(msgspec.json.encode(line))
    return setups, b"".join(line + b"\n" for line in lines)


def split_runs(channel: bytes, keys: Sequence[bytes]) -> list[bytes]:
    """The channel's records, by the key (the run) whose seal each carries, in run order.
    Raises Tampered for a record no key seals. Pure."""
    runs = [b""] * len(keys)
    for line in channel.splitlines(keepends=True):
        for i, key in enumerate(keys):
            try:
                read_channel(runs[i] + line, key)
            except Tampered:
                continue
            runs[i] += line
            break
        else:
            raise Tampered("a record without the launcher's seal, or out of order")
    return runs


def _taken(channel: bytes, setups: Sequence[Setup]) -> list[tuple[bytes, Setup]]:
    """The runs that took a setup, with it, in the order the setups were offered."""
    runs = split_runs(channel, [s.key for s in setups])
    return [(run, setup) for run, setup in zip(runs, setups, strict=True) if run]


def collect_report(channel: bytes, setups: Sequence[Setup]) -> SealReport:
    """The expected tests of each sealed run of a collection phase. Pure."""
    try:
        runs = _taken(channel, setups)
        expected = []
        for run, setup in runs:
            _, end = read_channel(run, setup.key)
            if end is None:
                return SealReport("collect", len(runs), problem="a collection run ended "
                                  "before its report")
            if end.collection_errors:
                return SealReport("collect", len(runs), problem="the task's tests do not "
                                  "collect on its own files: " + ", ".join(end.collection_errors))
            expected.append(sorted(t for t, _ in end.outcomes))
    except Tampered as exc:
        return SealReport("collect", 0, problem=str(exc))
    return SealReport("collect", len(expected), expected)


def judge_report(channel: bytes, setups: Sequence[Setup],
                 expected: Sequence[Sequence[str]]) -> SealReport:
    """Each sealed run of a verifier phase judged against its expected tests. Pure."""
    passed = total = 0
    try:
        runs = _taken(channel, setups)
        if len(runs) != len(expected):
            raise Tampered(f"{len(runs)} sealed pytest runs where collection saw "
                           f"{len(expected)}")
        for (run, setup), tests in zip(runs, expected, strict=True):
            _, end = read_channel(run, setup.key)
            if end is None:
                raise Tampered("the tests ended before their report: the tested code exited, "
                               "crashed or ran out of a resource")
            counts = judge(end, end.exitstatus, frozenset(tests), setup.sentinels,
                           hidden=True)
            passed, total = passed + counts.passed, total + counts.total
            if end.exitstatus == 2:
                raise Tampered("the test run was interrupted")
    except Tampered as exc:
        return SealReport("judge", len(expected), problem=str(exc), passed=passed,
                          total=total)
    return SealReport("judge", len(expected), passed=passed, total=total)


def sealed_reward(reward: float, report: SealReport | None, sealed: bool
                  ) -> tuple[float, bool, str]:
    """(reward, tampered, what the seal says) for test.sh's `reward`. Pure."""
    if not sealed or report is None:
        return reward, False, UNSEALED
    if report.problem is not None:
        if reward > 0:
            return 0.0, True, f"test.sh gave {reward:g} but the sealed report is not whole: " \
                              f"{report.problem}"
        return reward, False, f"sealed report: {report.problem}"
    share = report.passed / report.total if report.total else 0.0
    if reward > share + 1e-9:
        return 0.0, True, (f"test.sh gave {reward:g} but {report.passed}/{report.total} "
                           "expected tests passed")
    return reward, False, f"sealed: {report.passed}/{report.total} expected tests passed"


def env(key_fd: int, report_fd: int) -> dict[str, str]:
    """The verifier execs' environment for the seal: the pipes and the shims first on PATH."""
    return {pytest_report.KEY_ENV: str(key_fd), pytest_report.REPORT_ENV: str(report_fd)}


def path(rest: str, where: str = f"/{SEAL_DIR}") -> str:
    return os.pathsep.join([f"{where}/bin", rest])


@dataclass
class Pipes:
    """The seal's pipes for one verifier phase: the setups (one line a pytest run, written
    at once and closed: MAX_RUNS lines fit a pipe's buffer) and the report, drained by a
    thread until every writer is gone."""

    setups: list[Setup]
    key_r: int
    report_w: int
    reader: asyncio.Future[bytes]

    @classmethod
    def open(cls, collect: bool, stub: bool) -> Pipes:
        setups, lines = make_setups(collect, stub)
        key_r, key_w = os.pipe()
        try:
            os.write(key_w, lines)
        finally:
            os.close(key_w)
        report_r, report_w = os.pipe()
        reader = asyncio.ensure_future(asyncio.to_thread(_drain, report_r))
        return cls(setups, key_r, report_w, reader)

    async def close(self) -> bytes:
        """The report's bytes, once the verifier's processes (killed) are gone."""
        os.close(self.key_r)
        os.close(self.report_w)
        return await self.reader


def _drain(fd: int) -> bytes:
    try:
        return drain(fd)
    finally:
        os.close(fd)
