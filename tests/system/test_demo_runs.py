"""The demo (`rolltap demo`, the tiny model): run again and again in one directory it trains
every time; however it ends, nothing of it is left running but its embedded Postgres.

The hang of a rerun came from the bridge's `--match run=ID`: a VALUE is read as JSON where it
parses, so a random hex run id made only of digits (64309107), or digits around one `e`, came
back a number and matched none of the run's rollouts, whose metadata holds it as text (about 3
runs in 100, rerun or not). The bridge then waited in silence while the toy agent kept playing.

For the ends, the demo runs for real (tiny model, vLLM, gateway, sandboxes, bridge) and is
ended at one of its stages the way users end it: SIGTERM to it, Ctrl-C (SIGINT to the
terminal's process group), `timeout -k 5 … make demo` firing (SIGTERM to make and its group,
SIGKILL 5 s later), and a SIGKILL of the demo alone. The demo's processes are found by an
environment marker every descendant inherits; the test lists them at the stage (the servers
are there) and after the end.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.knobs import key_value
from stack.launcher import stop_embedded_postgres
from tests.support.gateway import REPO
from trainer_bridge.config import match_arg

MARKER = "ROLLTAP_DEMO_TREE_TEST"
# Stages are the demo's own `== N/7` headings; what must be running once each is under way.
EXPECTED = {
    "2/7": ("serve-model",),
    "4/7": ("serve-model", "vllm.entrypoints", " gateway "),
    "6/7": ("serve-model", "vllm.entrypoints", " gateway ", " rollouts "),
    "7/7": ("serve-model", "vllm.entrypoints", " gateway ", " bridge "),
}


def demo_processes(marker: str) -> dict[int, str]:
    """pid -> command line of every process carrying `marker` in its environment."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            environ = Path(f"/proc/{name}/environ").read_bytes()
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        if f"{MARKER}={marker}".encode() in environ.split(b"\0") and cmdline:
            found[int(name)] = cmdline.replace(b"\0", b" ").decode(errors="replace")
    return found


def _is_postgres(cmdline: str) -> bool:
    return bool(re.match(r"\S*postgres\b|postgres:", cmdline))


def _left(marker: str, wait_s: float = 60.0) -> dict[int, str]:
    """The demo's processes but Postgres, once they had `wait_s` to go."""
    deadline = time.monotonic() + wait_s
    while True:
        left = {p: c for p, c in demo_processes(marker).items() if not _is_postgres(c)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


@pytest.fixture
def demo_dir():
    """Under the repository's runs/: as root, pgserver runs Postgres as its own unprivileged
    user, which must reach the data directory."""
    (REPO / "runs").mkdir(exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="demo-tree-", dir=REPO / "runs"))
    path.chmod(0o755)
    yield path
    stop_embedded_postgres(path / "data" / "pgdata")
    shutil.rmtree(path, ignore_errors=True)


def _demo_argv(demo_dir: Path, steps: int = 2) -> list[str]:
    return [sys.executable, "-m", "core.cli", "demo", "--dir", str(demo_dir),
            "--turns", "1", "--train-steps", str(steps)]


@pytest.mark.slow  # three whole demos, about 10 minutes: `make test-slow`, run by CI
def test_the_demo_run_three_times_in_one_directory_trains_every_time(demo_dir):
    """Each run reuses the model, the embedded Postgres and everything the runs before left
    in it (versions, backlog, leases); 16 steps are where the toy task's reward has climbed."""
    for run in range(3):
        proc = subprocess.run(_demo_argv(demo_dir, steps=16), cwd=REPO, capture_output=True,
                              text=True, timeout=1500)
        assert proc.returncode == 0, f"run {run + 1}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        rewards = re.search(r"reward over the first steps ([\d.]+) -> last steps ([\d.]+)",
                            proc.stdout)
        assert rewards, proc.stdout[-3000:]
        assert float(rewards[2]) > float(rewards[1]), f"run {run + 1}: {rewards[0]}"
        assert "demo finished" in proc.stdout


@pytest.mark.slow  # a demo started and ended four ways, 2 minutes: `make test-slow`, run by CI
@pytest.mark.parametrize("how,stage", [
    ("sigterm", "2/7"),
    ("sigint", "4/7"),
    ("timeout-make", "6/7"),
    ("sigkill", "7/7"),
])
def test_an_ended_demo_leaves_only_its_postgres(how, stage, demo_dir):
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER: marker, "PYTHONUNBUFFERED": "1"}
    log = demo_dir / "demo.out"
    if how == "timeout-make":
        makefile = demo_dir / "Makefile"
        makefile.write_text("demo:\n\t" + " ".join(_demo_argv(demo_dir)) + "\n")
        # `timeout` signals make and its whole group when it fires; a SIGTERM to `timeout`
        # makes it fire now.
        argv = ["timeout", "-k", "5", "1800", "make", "-s", "-f", str(makefile), "demo"]
    else:
        argv = _demo_argv(demo_dir)
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while f"== {stage}" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.5)
        # Under way: every process the stage runs is there.
        while not all(any(word in c for c in demo_processes(marker).values())
                      for word in EXPECTED[stage]):
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, demo_processes(marker)
            time.sleep(0.5)
        before = demo_processes(marker)
        if how == "sigint":  # Ctrl-C: the terminal signals its foreground process group
            os.killpg(proc.pid, signal.SIGINT)
        elif how == "sigkill":
            os.kill(proc.pid, signal.SIGKILL)
        else:
            os.kill(proc.pid, signal.SIGTERM)
        proc.wait(120)
        left = _left(marker)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid, cmd in demo_processes(marker).items():
            if not _is_postgres(cmd):
                os.kill(pid, signal.SIGKILL)
    output = log.read_text(errors="replace")
    assert left == {}, f"left running:\n{left}\nrunning at {stage}:\n{before}\n{output[-3000:]}"
    assert "Traceback" not in output, output[-3000:]
    if how != "sigkill":
        name = "SIGINT" if how == "sigint" else "SIGTERM"
        assert f"rolltap demo: interrupted by {name}; its servers are stopped" in output, (
            output[-3000:])


@given(st.text(st.characters(blacklist_categories=("Cs",)), min_size=1).filter(
    lambda key: "=" not in key), st.text(st.characters(blacklist_categories=("Cs",))))
def test_a_match_argument_selects_its_value_as_text(key, value):
    assert key_value(match_arg(key, value)) == (key, value)


def test_a_run_id_of_digits_written_bare_is_read_as_a_number():
    """The demo's hang: its run id written bare came back a number."""
    assert key_value("run=64309107") == ("run", 64309107)
    assert key_value("run=123e4567")[1] != "123e4567"
    assert key_value(match_arg("run", "64309107")) == ("run", "64309107")
