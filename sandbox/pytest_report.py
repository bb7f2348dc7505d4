"""The pytest plugin a `pytest` verifier runs with (`-p sandbox.pytest_report`, through
PYTEST_ADDOPTS): it counts the outcomes and writes them once, at the end of the session, as one
line to the pipe whose descriptor ROLLTAP_REPORT_FD names. The runner reads that pipe and
nothing else: there is no report file the tested code could rewrite.

The plugin is loaded before any test module (and so before the solution they import): it takes
the descriptor out of the environment and moves it to a private, non-inheritable one. Code in
the same process can still find a pipe among its descriptors; what it writes there makes the
report unreadable (more than one line), which the runner scores as tampering, not as a pass.
"""

from __future__ import annotations

import json
import os

ENV = "ROLLTAP_REPORT_FD"
PREFIX = b"rolltap-report "


def _take() -> int | None:
    raw = os.environ.pop(ENV, None)
    if raw is None or not raw.isdigit():
        return None
    try:
        private = os.dup(int(raw))  # non-inheritable: no child of the tests gets it
        os.close(int(raw))
    except OSError:
        return None
    return private


_FD = _take()
_outcomes: dict[str, str] = {}
_collection_errors = 0


def pytest_collectreport(report) -> None:
    global _collection_errors
    if report.failed:
        _collection_errors += 1


def pytest_runtest_logreport(report) -> None:
    xfail = hasattr(report, "wasxfail")
    if report.failed:
        outcome = "failed" if report.when == "call" else "error"
    elif report.skipped:
        outcome = "skipped"  # skipped, or an expected failure: not counted
    else:
        outcome = "passed" if report.when == "call" or xfail else None
    if outcome is None or _outcomes.get(report.nodeid) == "error":
        return
    _outcomes[report.nodeid] = outcome


def counts() -> dict[str, int]:
    values = list(_outcomes.values())
    return {"passed": values.count("passed"), "failed": values.count("failed"),
            "errors": values.count("error") + _collection_errors}


def pytest_sessionfinish(session, exitstatus) -> None:
    if _FD is None:
        return
    line = PREFIX + json.dumps({**counts(), "exitstatus": int(exitstatus)}).encode() + b"\n"
    try:
        os.write(_FD, line)
        os.close(_FD)
    except OSError:
        pass
