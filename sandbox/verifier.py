"""Score a finished sandbox: run the task's verifier, read the reward.

Reward kinds:
- `pytest`: the fraction of the task's expected tests that passed. The expected tests are
  collected once on the task's own files (the starting files and the hidden tests, before the
  agent's code exists), and every one that did not pass (failed, errored, skipped, not run,
  missing) counts as failed. pytest runs through rolltap's launcher (pytest_report.py), never
  through the command's own python, and reports over a pipe in records sealed with a one-time
  key; the runner adds two sentinel tests of random names and content, one that must pass and
  one that must fail. A report that is not whole (a bad seal, a second or torn record, a test
  twice, a test of the task's files that was not expected, a sentinel with the wrong outcome,
  an exit status that contradicts it, a sentinel that did not run in a run that was not
  interrupted) scores 0 as `tampered`. The launcher turns off `-x`, `--maxfail` and
  `--stepwise` wherever they are set, so that every test runs. A run that started but ended
  before its report (the tested code exited, crashed, or ran out of a resource), or that was
  interrupted (KeyboardInterrupt, `pytest.exit`, tests that do not collect), scores 0.
- `binary`: 1.0 if the command exits 0, else 0.0. It trusts the exit status, which the tested
  code controls (`os._exit(0)` at import passes): a task file that gives it a pytest command
  is refused (tasks.py), saying to use `pytest`.
- `script`: the number the command prints on its last non-empty stdout line; it trusts whatever
  the command prints, which the tested code can print too.

A verifier that times out scores 0.0: the usual cause is a solution that hangs. None
(unscorable) is kept for failures outside the agent's reach (the launcher never started, the
task's tests do not collect on its own files), with the reason in `detail`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import math
import os
import random
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Literal

import msgspec

from sandbox import pytest_report
from sandbox.process import ProcessOutcome, ProcessStatus
from sandbox.tasks import RewardKind

OUTPUT_TAIL = 4000
# The end record names every test; a task of many thousand tests fits.
CHANNEL_LIMIT = 16 << 20
LAUNCHER = os.path.abspath(pytest_report.__file__)


class VerifierResult(msgspec.Struct, frozen=True):
    reward: float | None
    detail: str
    status: ProcessStatus
    exit_code: int | None
    duration_s: float
    passed: int | None = None
    total: int | None = None
    output: str = ""
    tampered: bool = False


class Counts(msgspec.Struct, frozen=True):
    passed: int
    total: int


Outcome = Literal["passed", "failed", "error", "skipped", "collected"]


class End(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    record: Literal["end"]
    outcomes: list[tuple[str, Outcome]]
    collection_errors: list[str]
    exitstatus: int


class Sentinels(msgspec.Struct, frozen=True):
    """The runner's own tests, written at `path` (relative to the workdir) for one run."""

    path: str
    source: bytes
    passing: str  # function names
    failing: str


class Tampered(Exception):
    """The report is not the launcher's whole report."""


class TaskTestsError(Exception):
    """The task's tests cannot be collected on its own files: the task is broken."""


START = b'{"record": "start"}'
# pytest's exit status when the session was stopped (KeyboardInterrupt, pytest.exit, a
# collection error).
INTERRUPTED = 2


def make_sentinels(rng: random.Random | None = None) -> Sentinels:
    """Two tests of random names and numbers: the first must pass, the second must fail."""
    rng = rng or random.SystemRandom()
    name = lambda: "test_" + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(12))  # noqa: E731
    passing, failing = name(), name()
    a, b, c = (rng.randrange(1, 10**9) for _ in range(3))
    bodies = [f"def {passing}():\n    assert {a} + {b} == {a + b}\n",
              f"def {failing}():\n    assert {a} * {b} == {a * b + c}\n"]
    rng.shuffle(bodies)
    path = f"{name()[5:]}/{name()}.py"
    return Sentinels(path, "\n\n".join(bodies).encode(), passing, failing)


def read_channel(channel: bytes, key: bytes) -> tuple[bool, End | None]:
    """(started, the end record) from the report pipe's bytes. Raises Tampered for anything
    but the launcher's start record optionally followed by its end record, both sealed."""
    if not channel:
        return False, None
    if not channel.endswith(b"\n"):
        raise Tampered("a torn record")
    lines = channel[:-1].split(b"\n")
    if len(lines) > 2:
        raise Tampered("more records than the launcher writes")
    mac = hmac.new(key, digestmod="sha256")
    bodies = []
    for seq, line in enumerate(lines):
        body, _, seal = line.removeprefix(pytest_report.PREFIX).rpartition(b" ")
        if not line.startswith(pytest_report.PREFIX) or not hmac.compare_digest(
                pytest_report.seal(mac, seq, body), line + b"\n"):
            raise Tampered("a record without the launcher's seal")
        bodies.append(body)
    if bodies[0] != START:
        raise Tampered("no start record")
    if len(bodies) == 1:
        return True, None
    try:
        return True, msgspec.json.decode(bodies[1], type=End)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise Tampered(f"a malformed end record: {exc}") from None


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def judge(end: End, exit_code: int | None, expected: frozenset[str],
          sentinels: Sentinels, *, hidden: bool = False) -> Counts:
    """The expected tests that passed, from a whole end record. Raises Tampered where the
    record contradicts itself, the process, the expected tests or the sentinels. `hidden`:
    the sentinels ran out of the session's sight (Harbor), so their outcomes are not in its
    exit status. Pure."""
    outcomes = dict(end.outcomes)
    if len(outcomes) != len(end.outcomes):
        raise Tampered("a test reported twice")
    if end.exitstatus != exit_code:
        raise Tampered(f"exit code {exit_code} but the report says {end.exitstatus}")
    ours = (sentinels.passing, sentinels.failing) if hidden else ()
    if end.exitstatus == 0 and {"failed", "error"} & {
            o for t, o in outcomes.items() if t.rpartition("::")[2] not in ours}:
        raise Tampered("exit status 0 with failed tests")
    if "collected" in outcomes.values():
        raise Tampered("a collection record in a test run")
    files = {_file(t) for t in expected}
    if end.exitstatus != INTERRUPTED:
        # The launcher runs every test to the end (it turns off -x, --maxfail and
        # --stepwise): a run that was not interrupted ran both sentinels.
        ran = {nodeid.rpartition("::")[2] for nodeid in outcomes}
        for name in (sentinels.passing, sentinels.failing):
            if name not in ran:
                raise Tampered(f"the runner's sentinel test {name} did not run")
    for nodeid, outcome in outcomes.items():
        name = nodeid.rpartition("::")[2]
        if name in (sentinels.passing, sentinels.failing):
            if outcome != ("passed" if name == sentinels.passing else "failed"):
                raise Tampered(f"the runner's sentinel test {name} reported {outcome}")
        elif nodeid not in expected and _file(nodeid) in files:
            raise Tampered(f"an unexpected test {nodeid}")
    passed = sum(outcomes.get(t) == "passed" for t in expected)
    return Counts(passed, len(expected))


def expected_tests(outcome: ProcessOutcome, channel: bytes, key: bytes) -> frozenset[str]:
    """The node ids a collection run on the task's own files found. Raises TaskTestsError."""
    try:
        started, end = read_channel(channel, key)
    except Tampered as exc:
        raise TaskTestsError(f"collecting the task's tests: {exc}") from None
    if end is None:
        raise TaskTestsError(f"collecting the task's tests ended without a report "
                             f"(exit code {outcome.exit_code}): {outcome.stderr[-500:]}")
    if end.collection_errors:
        raise TaskTestsError("the task's tests do not collect on its own files: "
                             + ", ".join(end.collection_errors) + "\n" + outcome.stdout[-1000:])
    tests = frozenset(t for t, _ in end.outcomes)
    if not tests:
        raise TaskTestsError("the task's verifier collects no tests")
    return tests


def script_number(stdout: str) -> float | None:
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    if not lines:
        return None
    try:
        value = float(lines[-1])
    except ValueError:
        return None
    return value if math.isfinite(value) else None


class Scored(msgspec.Struct, frozen=True):
    reward: float | None
    detail: str
    counts: Counts | None = None
    tampered: bool = False


def score_pytest(outcome: ProcessOutcome, channel: bytes, key: bytes,
                 expected: frozenset[str], sentinels: Sentinels) -> Scored:
    """The reward of a pytest verifier run. Pure."""
    if outcome.status == "timeout":
        return Scored(0.0, "verifier timed out")
    try:
        started, end = read_channel(channel, key)
        if not started:
            return Scored(None, f"the pytest launcher never started (exit code "
                                f"{outcome.exit_code}); see the verifier's output")
        if end is None:
            return Scored(0.0, f"the tests ended before their report (exit code "
                               f"{outcome.exit_code}, {outcome.status}): the tested code exited, "
                               "crashed or ran out of a resource")
        counts = judge(end, outcome.exit_code, expected, sentinels)
    except Tampered as exc:
        return Scored(0.0, f"the test report is not whole: {exc}", None, True)
    if end.exitstatus == INTERRUPTED:
        return Scored(0.0, f"the test run was interrupted ({counts.passed}/{counts.total} "
                           "expected tests had passed): the tested code stopped it, or the "
                           "tests did not collect", counts)
    return Scored(counts.passed / counts.total,
                  f"{counts.passed}/{counts.total} expected tests passed", counts)


def score_command(kind: RewardKind, outcome: ProcessOutcome) -> Scored:
    """The reward of a `binary` or `script` verifier run. Pure."""
    if outcome.status == "timeout":
        return Scored(0.0, "verifier timed out")
    if kind == "binary":
        return Scored(1.0 if outcome.exit_code == 0 else 0.0, f"exit code {outcome.exit_code}")
    value = script_number(outcome.stdout) if outcome.exit_code == 0 else None
    if value is None:
        return Scored(None, f"no number on the last stdout line (exit code {outcome.exit_code})")
    return Scored(value, "script output")


def drain(fd: int) -> bytes:
    """Everything written to the pipe until every writer is gone, keeping CHANNEL_LIMIT + 1
    bytes at most (enough to tell too much)."""
    kept = bytearray()
    while chunk := os.read(fd, 65536):
        if len(kept) <= CHANNEL_LIMIT:
            kept += chunk[: CHANNEL_LIMIT + 1 - len(kept)]
    return bytes(kept)


# run(argv, extra environment, descriptors to pass) -> the verifier process's outcome
Run = Callable[[Sequence[str], Mapping[str, str], Sequence[int]], Awaitable[ProcessOutcome]]


async def launch(run: Run, command: str, python: str, sentinel: str | None = None, *,
                 keep: Sequence[str] | None = None) -> tuple[ProcessOutcome, bytes, bytes]:
    """Run a pytest verifier command through the launcher: (outcome, report bytes, key).
    With `keep` (the task's test files) it only collects."""
    env, args = pytest_report.pytest_command(command)
    key = secrets.token_bytes(32)
    setup: dict = {"key": key.hex(), "sentinels": [sentinel] if sentinel else []}
    if keep is not None:
        setup["keep"] = list(keep)
    key_r, key_w = os.pipe()
    # Written from a thread: a task of many files may not fit the pipe's buffer.
    writer = asyncio.ensure_future(asyncio.to_thread(_feed, key_w, msgspec.json.encode(setup)))
    read_fd, write_fd = os.pipe()
    reader = asyncio.ensure_future(asyncio.to_thread(drain, read_fd))
    extra = {**env, pytest_report.KEY_ENV: str(key_r), pytest_report.REPORT_ENV: str(write_fd)}
    try:
        outcome = await run([python, "-I", LAUNCHER, *args], extra, (key_r, write_fd))
    finally:
        os.close(write_fd)  # the reader sees the end once the verifier's copies are gone too
        os.close(key_r)  # a launcher that never read it leaves the writer with EPIPE
        await asyncio.shield(writer)
        channel = await asyncio.shield(reader)
        with contextlib.suppress(OSError):
            os.close(read_fd)
    return outcome, channel, key


def _feed(fd: int, data: bytes) -> None:
    view = memoryview(data)
    try:
        with contextlib.suppress(BrokenPipeError):
            while view:
                view = view[os.write(fd, view):]
    finally:
        os.close(fd)


async def collect(run: Run, command: str, python: str, keep: Sequence[str]) -> frozenset[str]:
    """The expected tests: `run` must run in a workdir holding only the task's own files,
    `keep` the task's test files among them (everything else of the workdir is stubbed).
    Raises TaskTestsError."""
    outcome, channel, key = await launch(run, command, python, keep=keep)
    return expected_tests(outcome, channel, key)


def _result(scored: Scored, outcome: ProcessOutcome) -> VerifierResult:
    counts = scored.counts
    return VerifierResult(
        reward=scored.reward, detail=scored.detail, status=outcome.status,
        exit_code=outcome.exit_code, duration_s=outcome.duration_s,
        passed=counts.passed if counts else None, total=counts.total if counts else None,
        output=(outcome.stdout + outcome.stderr)[-OUTPUT_TAIL:], tampered=scored.tampered)


async def verify(kind: RewardKind, command: str, run: Run, python: str,
                 expected: frozenset[str] | None = None,
                 sentinels: Sentinels | None = None) -> VerifierResult:
    """Run the verifier with `run` and score it; for `pytest`, `expected` (from collect()) and
    the `sentinels` written in the workdir are required. Call only once every process of the
    agent is gone."""
    if kind != "pytest":
        outcome = await run(["/bin/sh", "-c", command], {}, ())
        return _result(score_command(kind, outcome), outcome)
    assert expected is not None and sentinels is not None, "a pytest verifier needs both"
    outcome, channel, key = await launch(run, command, python, sentinels.path)
    return _result(score_pytest(outcome, channel, key, expected, sentinels), outcome)
