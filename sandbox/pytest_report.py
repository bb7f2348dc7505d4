"""The launcher a `pytest` verifier runs: `python -I <this file> <the task's pytest args>`.

It is run by path with an isolated interpreter, so neither it nor pytest can be shadowed by a
file in the workdir (-I leaves the working directory off sys.path), whatever the task's command
says. It imports nothing of rolltap: the verifier's view holds only this file's directory.

Before pytest reads any configuration or imports any test, it reads a one-time key and the
runner's sentinel test file from the pipe ROLLTAP_KEY_FD names, takes the report pipe
(ROLLTAP_REPORT_FD) to a private non-inheritable descriptor, and writes a `start` record there.
Every record carries an HMAC of its sequence number and body under that key. At the end it
writes one `end` record: each test's outcome by node id, the collection errors, pytest's exit
status; then it exits with that status. In a test run every test runs to the end (no `-x`,
`--maxfail` or `--stepwise`, wherever they are set) and the sentinels join the items after
deselection, so that an honest run always runs both.

Given the task's test files (`keep`) it only collects: the runner does this on the task's own
files to learn the expected tests, with the solution's modules stubbed (_Stubs).

What this does not stop: the tested code runs in this process and can reach the key's HMAC
object and the plugin's state in memory. The runner's checks (expected tests, sentinels, exit
status) make a forgery need that much, not impossible.
"""

from __future__ import annotations

import hmac
import importlib.abc
import json
import os
import random
import re
import shlex
import sys

KEY_ENV = "ROLLTAP_KEY_FD"
REPORT_ENV = "ROLLTAP_REPORT_FD"
PREFIX = b"rolltap-report "


_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_PYTHON = re.compile(r"^python(3(\.[0-9]+)?)?$")
_SHELL = set(";&|<>`$\n")


def pytest_command(command: str) -> tuple[dict[str, str], list[str]]:
    """(environment, pytest arguments) of a `pytest` verifier command, which must read
    `[NAME=value ...] python [-flags] -m pytest [args]` or `[NAME=value ...] pytest [args]`.
    The runner runs this launcher with those arguments instead: the command's own python and
    pytest are never looked up. Raises ValueError saying what is accepted."""
    accepted = ("a pytest verifier command must read `[NAME=value ...] python [-I] -m pytest "
                "[args]` or `[NAME=value ...] pytest [args]`, without shell operators")
    try:
        words = shlex.split(command)
    except ValueError as exc:
        raise ValueError(f"{accepted}: {exc}") from None
    if any(c in _SHELL for word in words for c in word if not _ASSIGN.match(word)):
        raise ValueError(accepted)
    env = {}
    while words and _ASSIGN.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    if words and words[0] in ("pytest", "py.test"):
        return env, words[1:]
    if words and _PYTHON.match(words[0]):
        i = 1
        while i < len(words) and re.match(r"^-[A-Za-z]+$", words[i]) and words[i] != "-m":
            i += 1
        if words[i:i + 2] == ["-m", "pytest"]:
            return env, words[i + 2:]
    raise ValueError(accepted)


def seal(mac, seq: int, body: bytes) -> bytes:
    """One record: PREFIX, the JSON body, the hex HMAC of `seq` and the body."""
    h = mac.copy()
    h.update(b"%d " % seq + body)
    return PREFIX + body + b" " + h.hexdigest().encode() + b"\n"


def _take(name: str) -> int | None:
    raw = os.environ.pop(name, None)
    if raw is None or not raw.isdigit():
        return None
    try:
        private = os.dup(int(raw))  # non-inheritable: no child of the tests gets it
        os.close(int(raw))
    except OSError:
        return None
    return private


def _read_all(fd: int) -> bytes:
    data = bytearray()
    while chunk := os.read(fd, 65536):
        data += chunk
    os.close(fd)
    return bytes(data)


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A meta path finder put first while collecting on the task's own files: a module that
    does not exist, or lies in the workdir but is none of the task's test files (`keep`, the
    solution the agent is to write), is a stub whose attributes are callables, so the tests
    that import it collect without running it."""

    def __init__(self, keep: list[str]) -> None:
        self.root = os.getcwd()
        self.keep = {os.path.normpath(p) for p in keep}

    def find_spec(self, name, path=None, target=None):
        import importlib.machinery
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                if (spec := finder.find_spec(name, path, target)) is not None:
                    break
        else:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        origin = spec.origin if spec.has_location else None
        if origin:
            rel = os.path.relpath(origin, self.root)
            if not rel.startswith("..") and rel not in self.keep:
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return spec

    def create_module(self, spec):
        import types

        class Stub(types.ModuleType):
            def __getattr__(self, attr):
                if attr.startswith("__"):
                    raise AttributeError(attr)
                return lambda *a, **k: None

        module = Stub(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


class _Plugin:
    def __init__(self, sentinels: list[str], keep: list[str] | None) -> None:
        self.sentinels, self.collect = sentinels, keep is not None
        self.outcomes: dict[str, str] = {}
        self.collection_errors: list[str] = []
        self.stubs = _Stubs(keep or [])

    def pytest_configure(self, config):
        # A stop at the first failures (-x, --maxfail, --stepwise, from the command, the ini
        # file's addopts or PYTEST_ADDOPTS) would end the run at the failing sentinel wherever
        # it lands, every expected test after it unrun: every test runs to the end instead.
        if not self.collect:
            config.option.maxfail = 0
            for name in ("stepwise", "stepwise_skip", "stepwise_reset"):
                if hasattr(config.option, name):
                    setattr(config.option, name, False)

    def pytest_collection(self, session):
        if self.collect:
            sys.meta_path.insert(0, self.stubs)

    def pytest_collectreport(self, report):
        if report.failed:
            self.collection_errors.append(report.nodeid)

    def pytest_collection_modifyitems(self, session, config, items):
        if self.collect:
            sys.meta_path.remove(self.stubs)
            self.outcomes = {item.nodeid: "collected" for item in items}
            return
        import pathlib

        import pytest
        for path in self.sentinels:
            module = pytest.Module.from_parent(session, path=pathlib.Path(path))
            for item in module.collect():
                items.insert(random.randrange(len(items) + 1), item)

    def pytest_runtest_logreport(self, report):
        # One outcome a test: an error in setup or teardown outweighs the call's result;
        # only a call that passed (or an unexpected pass) is "passed".
        if report.failed:
            outcome = "failed" if report.when == "call" else "error"
        elif report.skipped:
            outcome = "skipped"
        elif report.when == "call":
            outcome = "passed"
        else:
            return
        if self.outcomes.get(report.nodeid) not in ("error", "failed"):
            self.outcomes[report.nodeid] = outcome


def main() -> int:
    key_fd, report_fd = _take(KEY_ENV), _take(REPORT_ENV)
    if key_fd is None or report_fd is None:
        print(f"{KEY_ENV} and {REPORT_ENV} must name the runner's pipes", file=sys.stderr)
        return 4
    setup = json.loads(_read_all(key_fd))
    mac = hmac.new(bytes.fromhex(setup.pop("key")), digestmod="sha256")
    collect = "keep" in setup
    os.write(report_fd, seal(mac, 0, b'{"record": "start"}'))
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    import pytest

    # Before the stepwise plugin reads its options; the sentinels join the items after every
    # deselection (-k, -m, --deselect), which would otherwise drop them.
    pytest.hookimpl(tryfirst=True)(_Plugin.pytest_configure)
    pytest.hookimpl(trylast=True)(_Plugin.pytest_collection_modifyitems)
    # Absolute now: the tested code may change directory before the sentinels are collected.
    plugin = _Plugin([os.path.abspath(p) for p in setup.get("sentinels", [])], setup.get("keep"))
    args = sys.argv[1:] + (["--collect-only"] if collect else [])
    status = int(pytest.main(args, plugins=[plugin]))
    body = json.dumps({"record": "end", "outcomes": sorted(plugin.outcomes.items()),
                       "collection_errors": plugin.collection_errors,
                       "exitstatus": status}).encode()
    record = memoryview(seal(mac, 1, body))
    while record:  # an end record of many tests is larger than the pipe's buffer
        record = record[os.write(report_fd, record):]
    os.close(report_fd)
    return status


if __name__ == "__main__":
    sys.exit(main())
