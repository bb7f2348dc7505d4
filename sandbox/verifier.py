"""Score a finished sandbox: run the task's verifier command, read the reward.

Reward kinds:
- `pytest`: fraction of the tests that passed (skipped and xfailed ones do not count), read from
  the one line the rolltap pytest plugin (pytest_report.py, loaded through PYTEST_ADDOPTS)
  writes to a pipe only the runner reads. A channel holding anything but that one line was
  written by the tested code: the result is `tampered`, reward 0.0.
- `binary`: 1.0 if the command exits 0, else 0.0.
- `script`: the number the command prints on its last non-empty stdout line.

A verifier that times out scores 0.0: the usual cause is a solution that hangs. A verifier whose
result cannot be read scores None (unscorable), with the reason in `detail`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence

import msgspec

from sandbox import pytest_report
from sandbox.process import ProcessOutcome, ProcessStatus
from sandbox.tasks import RewardKind

OUTPUT_TAIL = 4000
# The plugin's line is a few dozen bytes; more than this is someone else writing.
CHANNEL_LIMIT = 1 << 16


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


class Report(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    passed: int
    failed: int
    errors: int
    exitstatus: int


class Tampered(Exception):
    """The report channel holds something the plugin did not write."""


def read_report(channel: bytes) -> Counts | None:
    """Counts from the report channel's bytes; None if it is empty (the plugin never ran).
    Raises Tampered for anything but exactly one well-formed line."""
    if not channel:
        return None
    if (not channel.startswith(pytest_report.PREFIX) or not channel.endswith(b"\n")
            or channel.count(b"\n") != 1):
        raise Tampered
    try:
        report = msgspec.json.decode(channel[len(pytest_report.PREFIX):], type=Report)
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise Tampered from None
    if min(report.passed, report.failed, report.errors) < 0:
        raise Tampered
    return Counts(report.passed, report.passed + report.failed + report.errors)

def script_number(stdout: str) -> float | None:
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    if not lines:
        return None
    try:
        value = float(lines[-1])
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def score(
    kind: RewardKind, outcome: ProcessOutcome, channel: bytes
) -> tuple[float | None, str, Counts | None, bool]:
    """(reward, why, test counts, tampered) for a verifier run. Pure."""
    if outcome.status == "timeout":
        return 0.0, "verifier timed out", None, False
    if kind == "binary":
        ok = outcome.exit_code == 0
        return (1.0 if ok else 0.0), f"exit code {outcome.exit_code}", None, False
    if kind == "script":
        value = script_number(outcome.stdout) if outcome.exit_code == 0 else None
        if value is None:
            return (None, f"no number on the last stdout line (exit code {outcome.exit_code})",
                    None, False)
        return value, "script output", None, False
    try:
        counts = read_report(channel)
    except Tampered:
        return 0.0, "the pytest report channel was written by the tested code", None, True
    if counts is None:
        return None, (f"no report from the rolltap pytest plugin (exit code {outcome.exit_code}"
                      "; the verifier must run pytest with rolltap's python)"), None, False
    if counts.total <= 0:
        return None, "no tests ran", counts, False
    return (counts.passed / counts.total, f"{counts.passed}/{counts.total} tests passed",
            counts, False)


def _drain(fd: int) -> bytes:
    """Everything written to the pipe until every writer is gone, keeping CHANNEL_LIMIT + 1
    bytes at most (enough to tell too much)."""
    kept = bytearray()
    while chunk := os.read(fd, 65536):
        if len(kept) <= CHANNEL_LIMIT:
            kept += chunk[: CHANNEL_LIMIT + 1 - len(kept)]
    return bytes(kept)


Run = Callable[[Mapping[str, str], Sequence[int]], Awaitable[ProcessOutcome]]


async def verify(kind: RewardKind, run: Run) -> VerifierResult:
    """Run the verifier with `run(extra environment, descriptors to pass)` and score it.

    Call only once every process of the agent is gone.
    """
    extra: dict[str, str] = {}
    read_fd, write_fd = os.pipe()
    reader = asyncio.ensure_future(asyncio.to_thread(_drain, read_fd))
    try:
        if kind == "pytest":
            extra = {"PYTEST_ADDOPTS": "-p sandbox.pytest_report",
                     pytest_report.ENV: str(write_fd)}
        outcome = await run(extra, (write_fd,) if kind == "pytest" else ())
    finally:
        os.close(write_fd)  # the reader sees the end once the verifier's copies are gone too
        channel = await asyncio.shield(reader)
        with contextlib.suppress(OSError):
            os.close(read_fd)
    reward, detail, counts, tampered = score(kind, outcome, channel)
    return VerifierResult(
        reward=reward,
        detail=detail,
        status=outcome.status,
        exit_code=outcome.exit_code,
        duration_s=outcome.duration_s,
        passed=counts.passed if counts else None,
        total=counts.total if counts else None,
        output=(outcome.stdout + outcome.stderr)[-OUTPUT_TAIL:],
        tampered=tampered,
    )
