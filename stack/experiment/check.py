"""Grade one model reply against a task's cases, telling structural failures from logic ones.

The evaluation's grader: the same cases as the task's hidden pytest tests (tasks.py), without
a sandbox per sample, so 500+ samples grade in seconds. The reply's code runs in a forked child
with CPU, memory and file-size limits, stdin closed, in a scratch directory, and a wall-clock
timeout; it is a 135M model's attempt at a one-line function, graded on this machine.

Verdicts, in the order they are checked:
- structural: `no_code` (no code block), `syntax`, `import_error` (raises at import, `input()`
  included), `io_at_import` (prints at import), `wrong_name` (the function is not defined),
  `timeout` (import or a case did not end in time);
- `logic`: it runs but a case's result is wrong or raises;
- `pass`: every case right.
"""

from __future__ import annotations

import contextlib
import io
import os
import resource
import select
import signal
import tempfile
from typing import Any, Literal

import msgspec

from sandbox.agents.code_writer import extract_code

Verdict = Literal["pass", "logic", "no_code", "syntax", "import_error", "io_at_import",
                  "wrong_name", "timeout"]
STRUCTURAL: frozenset[str] = frozenset(
    ("no_code", "syntax", "import_error", "io_at_import", "wrong_name", "timeout"))


class Graded(msgspec.Struct, frozen=True):
    verdict: Verdict
    passed: int  # cases right
    total: int


def _run_cases(code: str, func: str, cases: list[list[Any]]) -> Graded:
    """In the child: import the code as a module would be, then call the function per case."""
    namespace: dict[str, Any] = {"__name__": func}
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(code, f"{func}.py", "exec"), namespace)  # noqa: S102
    except Exception:
        return Graded("import_error", 0, len(cases))
    if printed.getvalue():
        return Graded("io_at_import", 0, len(cases))
    fn = namespace.get(func)
    if not callable(fn):
        return Graded("wrong_name", 0, len(cases))
    passed = 0
    for args, expected in cases:
        with contextlib.suppress(Exception), contextlib.redirect_stdout(io.StringIO()):
            passed += bool(fn(*args) == expected)
    return Graded("pass" if passed == len(cases) else "logic", passed, len(cases))


def _child(code: str, func: str, cases: list[list[Any]], out: int) -> None:
    resource.setrlimit(resource.RLIMIT_CPU, (5, 5))
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.chdir(tempfile.mkdtemp(prefix="rolltap-check-"))
    os.write(out, msgspec.json.encode(_run_cases(code, func, cases)))


def grade_code(code: str, func: str, cases: list[list[Any]], timeout_s: float = 10.0) -> Graded:
    try:
        compile(code, f"{func}.py", "exec")
    except (SyntaxError, ValueError):
        return Graded("syntax", 0, len(cases))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns into the caller's code
        try:
            os.close(read)
            _child(code, func, cases, write)
        finally:
            os._exit(0)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], timeout_s)
        data = b""
        if ready:
            while chunk := os.read(read, 65536):
                data += chunk
    finally:
        os.close(read)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if not data:  # killed by a limit or the timeout before it reported
        return Graded("timeout", 0, len(cases))
    return msgspec.json.decode(data, type=Graded)


def grade(reply: str, func: str, cases: list[list[Any]], timeout_s: float = 10.0) -> Graded:
    """The verdict of a model's reply (the last fenced code block, as the agent takes it)."""
    code = extract_code(reply)
    if code is None:
        return Graded("no_code", 0, len(cases))
    return grade_code(code, func, cases, timeout_s)
