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

Under a Harbor task's test.sh (ROLLTAP_SETUP_LINES set; sandbox/harbor/seal.py's shims start it
for `pytest` and `python -m pytest`) each launcher takes one line of the setup pipe, so that
every pytest run of the script has its own key; the sentinels run out of sight (their reports
reach neither the exit status nor the output that test.sh reads); the plugins the image
installed load as usual; the script's PYTHONPATH is honoured and, for `python -m pytest`, the
working directory comes last on sys.path, after the standard library and pytest (the solution
imports, nothing shadows). Without a setup left, pytest runs unsealed, as it would without
rolltap.

After its end record the launcher leaves with os._exit: no atexit handler, thread or finalizer
of the tested code runs after the report, so the exit status is the reported one.

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
LINES_ENV = "ROLLTAP_SETUP_LINES"  # one setup a line, one line a launcher (Harbor's test.sh)
CWD_ENV = "ROLLTAP_CWD_PATH"  # started for `python -m pytest`: the working directory goes last
_exit = os._exit  # bound before the tested code can replace it
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


def runs_pytest(command: str) -> bool:
    """Whether a shell command names pytest (`pytest`, `py.test`, `-m pytest`), anywhere."""
    return bool(re.search(r"(^|[\s;&|(`/])(py\.test|pytest)(\s|$|;|&|\||\))", command))


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


def _read_line(fd: int) -> bytes:
    """One line of a pipe other launchers read after this one: a byte at a time, so that
    nothing of the next line is taken."""
    data = bytearray()
    while (byte := os.read(fd, 1)) and byte != b"\n":
        data += byte
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
    def __init__(self, sentinels: list[str], keep: list[str] | None, *, stub: bool = True,
                 hidden: bool = False) -> None:
        self.sentinels, self.collect = sentinels, keep is not None
        self.stub, self.hidden = stub and self.collect, hidden
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
        if self.stub:
            sys.meta_path.insert(0, self.stubs)

    def pytest_collectreport(self, report):
        if report.failed:
            self.collection_errors.append(report.nodeid)

    def pytest_collection_modifyitems(self, session, config, items):
        if self.collect:
            if self.stub:
                sys.meta_path.remove(self.stubs)
            self.outcomes = {item.nodeid: "collected" for item in items}
            return
        import pathlib

        import pytest
        for path in self.sentinels:
            module = pytest.Module.from_parent(session, path=pathlib.Path(path))
            for item in module.collect():
                items.insert(random.randrange(len(items) + 1), item)

    def pytest_runtest_protocol(self, item, nextitem):
        # Out of sight: the runner's sentinels run as any test does, but their reports go to
        # this plugin only, so the session's exit status and output are the task's tests'.
        if not self.hidden or str(item.path) not in self.sentinels:
            return None
        from _pytest.runner import runtestprotocol
        for report in runtestprotocol(item, log=False, nextitem=nextitem):
            self.pytest_runtest_logreport(report)
        return True

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


def _setup(lines: bool) -> tuple[int | None, dict | None]:
    """(the report descriptor, the setup) from the runner's pipes; (None, None) without them."""
    key_fd, report_fd = _take(KEY_ENV), _take(REPORT_ENV)
    if key_fd is None or report_fd is None:
        return None, None
    raw = _read_line(key_fd) if lines else _read_all(key_fd)
    if not raw:  # every setup of the verifier phase was taken
        os.close(report_fd)
        return None, None
    return report_fd, json.loads(raw)


def _sentinel_file(source: str) -> str:
    """The sentinels' module, in a directory of this run's own (Harbor: the task's files hold
    no sentinels)."""
    import tempfile
    where = tempfile.mkdtemp(prefix="rolltap-")
    path = os.path.join(where, "test_" + os.urandom(6).hex() + ".py")
    with open(path, "w") as fh:
        fh.write(source)
    return path


def _python_path() -> None:
    """What -I left out that the script asked for: PYTHONPATH where Python puts it, the
    working directory (for `python -m pytest`) last."""
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[1:1] = extra
    if os.environ.pop(CWD_ENV, None):
        sys.path.append(os.getcwd())


def _unsealed() -> int:
    import pytest
    return int(pytest.main(sys.argv[1:]))


def main() -> int:
    lines = bool(os.environ.pop(LINES_ENV, None))
    if lines:
        _python_path()
    report_fd, setup = _setup(lines)
    if setup is None:
        if lines:
            return _unsealed()
        print(f"{KEY_ENV} and {REPORT_ENV} must name the runner's pipes", file=sys.stderr)
        return 4
    assert report_fd is not None
    mac = hmac.new(bytes.fromhex(setup.pop("key")), digestmod="sha256")
    collect = "keep" in setup
    os.write(report_fd, seal(mac, 0, b'{"record": "start"}'))
    if not lines:  # Harbor's tasks load the plugins their image installed (--ctrf, ...)
        os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    import pytest

    # Before the stepwise plugin reads its options; the sentinels join the items after every
    # deselection (-k, -m, --deselect), which would otherwise drop them.
    pytest.hookimpl(tryfirst=True)(_Plugin.pytest_configure)
    pytest.hookimpl(trylast=True)(_Plugin.pytest_collection_modifyitems)
    pytest.hookimpl(tryfirst=True)(_Plugin.pytest_runtest_protocol)
    sentinels = setup.get("sentinels", [])
    if "sentinel_source" in setup and not collect:
        sentinels = [_sentinel_file(setup["sentinel_source"])]
    # Absolute now: the tested code may change directory before the sentinels are collected.
    plugin = _Plugin([os.path.abspath(p) for p in sentinels], setup.get("keep"),
                     stub=setup.get("stub", True), hidden=lines)
    args = sys.argv[1:] + (["--collect-only"] if collect else [])
    status = int(pytest.main(args, plugins=[plugin]))
    body = json.dumps({"record": "end", "outcomes": sorted(plugin.outcomes.items()),
                       "collection_errors": plugin.collection_errors,
                       "exitstatus": status}).encode()
    record = memoryview(seal(mac, 1, body))
    while record:  # an end record of many tests is larger than the pipe's buffer
        record = record[os.write(report_fd, record):]
    os.close(report_fd)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    _exit(status)  # nothing of the tested code runs after its report
    return status


if __name__ == "__main__":
    sys.exit(main())
