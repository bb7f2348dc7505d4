"""Score a finished sandbox: copy the hidden tests in, run the task's verifier command, read
the reward.

Reward kinds:
- `pytest`: fraction of the tests that passed (skipped and xfailed ones do not count), read from
  a JUnit XML report the verifier is made to write (PYTEST_ADDOPTS), else from pytest's summary
  line.
- `binary`: 1.0 if the command exits 0, else 0.0.
- `script`: the number the command prints on its last non-empty stdout line.

A verifier that times out scores 0.0: the usual cause is a solution that hangs. A verifier whose
result cannot be read scores None (unscorable), with the reason in `detail`.
"""

from __future__ import annotations

import math
import os
import re
import xml.etree.ElementTree as ET
from collections.abc import Mapping

import msgspec

from sandbox.layout import SandboxDirs, replace_files
from sandbox.limits import Limits
from sandbox.process import ProcessOutcome, ProcessStatus, run_contained
from sandbox.tasks import RewardKind, Verifier

OUTPUT_TAIL = 4000


class VerifierResult(msgspec.Struct, frozen=True):
    reward: float | None
    detail: str
    status: ProcessStatus
    exit_code: int | None
    duration_s: float
    passed: int | None = None
    total: int | None = None
    output: str = ""


class Counts(msgspec.Struct, frozen=True):
    passed: int
    total: int


def junit_counts(xml_text: str) -> Counts | None:
    """Passed and counted tests from a JUnit XML report (one or many testsuite elements)."""
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError:
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    if not suites:
        return None
    tests = failures = errors = skipped = 0
    for suite in suites:
        try:
            tests += int(suite.get("tests", 0))
            failures += int(suite.get("failures", 0))
            errors += int(suite.get("errors", 0))
            skipped += int(suite.get("skipped", 0))
        except ValueError:
            return None
    total = tests - skipped
    return Counts(passed=total - failures - errors, total=total)


_SUMMARY_ITEM = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")
_SUMMARY_LINE = re.compile(r"\d+ (passed|failed|errors?|skipped|xfailed|xpassed|deselected|"
                           r"warnings?|no tests ran).* in [\d.]+s")


def summary_counts(output: str) -> Counts | None:
    """Counts from pytest's final summary line ("3 passed, 1 failed in 0.12s")."""
    for line in reversed(output.splitlines()):
        if not _SUMMARY_LINE.search(line) and "no tests ran" not in line:
            continue
        counts: dict[str, int] = {}
        for number, word in _SUMMARY_ITEM.findall(line):
            key = "errors" if word.startswith("error") else word
            counts[key] = counts.get(key, 0) + int(number)
        passed = counts.get("passed", 0) + counts.get("xpassed", 0)
        total = passed + counts.get("failed", 0) + counts.get("errors", 0)
        return Counts(passed=passed, total=total)
    return None


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
    kind: RewardKind, outcome: ProcessOutcome, junit: str | None
) -> tuple[float | None, str, Counts | None]:
    """(reward, why, test counts) for a verifier run. Pure."""
    if outcome.status == "timeout":
        return 0.0, "verifier timed out", None
    if kind == "binary":
        ok = outcome.exit_code == 0
        return (1.0 if ok else 0.0), f"exit code {outcome.exit_code}", None
    if kind == "script":
        value = script_number(outcome.stdout) if outcome.exit_code == 0 else None
        if value is None:
            return None, f"no number on the last stdout line (exit code {outcome.exit_code})", None
        return value, "script output", None
    counts = (junit_counts(junit) if junit else None) or summary_counts(outcome.stdout)
    if counts is None:
        return None, f"could not read pytest results (exit code {outcome.exit_code})", None
    if counts.total <= 0:
        return None, "no tests ran", counts
    return counts.passed / counts.total, f"{counts.passed}/{counts.total} tests passed", counts


async def verify(
    verifier: Verifier,
    dirs: SandboxDirs,
    env: Mapping[str, str],
    limits: Limits,
    timeout_s: float,
    use_cgroup: bool = True,
) -> VerifierResult:
    """Copy the hidden files into the workdir and run the verifier there.

    Call only once every process of the agent is gone: from here on the workdir holds the
    hidden tests.
    """
    replace_files(dirs.work, verifier.files)
    report_dir = os.path.join(dirs.root, "report")
    os.makedirs(report_dir, exist_ok=True)
    junit_path = os.path.join(report_dir, "junit.xml")
    run_env = dict(env)
    if verifier.reward == "pytest":
        run_env["PYTEST_ADDOPTS"] = f"--junitxml={junit_path}"
    outcome = await run_contained(
        ["/bin/sh", "-c", verifier.command],
        cwd=dirs.work,
        env=run_env,
        limits=limits,
        timeout_s=timeout_s,
        use_cgroup=use_cgroup,
    )
    junit = None
    if verifier.reward == "pytest" and os.path.isfile(junit_path):
        with open(junit_path, encoding="utf-8", errors="replace") as fh:
            junit = fh.read(limits.output_bytes * 16)
    reward, detail, counts = score(verifier.reward, outcome, junit)
    return VerifierResult(
        reward=reward,
        detail=detail,
        status=outcome.status,
        exit_code=outcome.exit_code,
        duration_s=outcome.duration_s,
        passed=counts.passed if counts else None,
        total=counts.total if counts else None,
        output=(outcome.stdout + outcome.stderr)[-OUTPUT_TAIL:],
    )
