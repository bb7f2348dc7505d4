"""Filesystem isolation of sandboxed agents: the mount plan (pure, property-tested), and real
agents in real sandboxes that try to read the task set's hidden tests where they lie on disk,
other sandboxes, and the runner's state file, through the real gateway and Postgres, locally
and on Ray; plus the fallback where the machine refuses a mount namespace."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import posixpath
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandbox import isolation
from sandbox.backends.base import RolloutAccess, SandboxRequest
from sandbox.backends.local import LocalBackend
from sandbox.isolation import MountOp, block_devices, plan_mounts, unavailable_reason
from sandbox.presets import Harness
from sandbox.runner import run_rollouts
from sandbox.tasks import Task, load_tasks
from tests.support.gateway import ADMIN_KEY, GatewayProcess

REPO = Path(__file__).resolve().parents[1]

needs_isolation = pytest.mark.skipif(
    unavailable_reason() is not None,
    reason=f"mount isolation unavailable here: {unavailable_reason()}",
)

# ---- the mount plan -------------------------------------------------------------------------


def deciding(path: str, entries: dict[str, str]) -> str | None:
    """The action of the deepest entry at or above `path`."""
    while True:
        if path in entries:
            return entries[path]
        if path == "/":
            return None
        path = posixpath.dirname(path)


def visible(path: str, entries: dict[str, str]) -> bool:
    return deciding(path, entries) in (None, "keep")


def is_under(path: str, parent: str) -> bool:
    return path != parent and path.startswith(parent.rstrip("/") + "/")


paths = st.lists(st.sampled_from("abc"), min_size=1, max_size=4).map(lambda p: "/" + "/".join(p))
actions = st.dictionaries(paths, st.sampled_from(["empty", "null", "keep"]), max_size=10).map(
    # A file (null) has nothing below it.
    lambda d: {p: a for p, a in d.items()
               if not any(is_under(p, q) for q, b in d.items() if b == "null")}
)


@given(actions)
def test_plan_hides_exactly_what_the_entries_say(entries):
    ops = plan_mounts(entries)
    applied = {op.path: op.action for op in ops}
    universe = {p for e in entries for p in (e, e + "/x", posixpath.dirname(e))}
    for path in universe:
        assert visible(path, applied) == visible(path, entries), (path, ops)


@given(actions)
def test_plan_order_and_mount_points(entries):
    ops = plan_mounts(entries)
    done: dict[str, str] = {}
    for op in ops:
        # Nothing is mounted below a file, and a parent's mount comes first.
        assert not any(is_under(op.path, p) for p, a in done.items() if a == "null")
        assert not any(is_under(p, op.path) for p in done)
        above = deciding(posixpath.dirname(op.path), done) if op.path != "/" else None
        if op.action == "keep":
            assert above == "empty", "a kept directory's mount point is made in a tmpfs"
        else:
            assert above != "empty", "no hide inside a hide"
        done[op.path] = op.action


def test_plan_example_sandbox_root():
    ops = plan_mounts({"/tmp/sb": "empty", "/tmp/sb/mine": "keep", "/tmp/sb/mine/x": "empty",
                       "/srv/tasks/t/hidden": "empty", "/srv/tasks/t": "empty",
                       "/srv/tasks.jsonl": "null", "/elsewhere": "keep"})
    assert ops == (MountOp("/srv/tasks.jsonl", "null"), MountOp("/tmp/sb", "empty"),
                   MountOp("/srv/tasks/t", "empty"), MountOp("/tmp/sb/mine", "keep"),
                   MountOp("/tmp/sb/mine/x", "empty"))


@pytest.mark.parametrize("bad", ["relative/path", "/a/../b", "/a/", "/"])
def test_plan_refuses_unusable_paths(bad):
    with pytest.raises(ValueError):
        plan_mounts({bad: "empty"})


# ---- a task set on disk, and an agent that looks for it -------------------------------------

SOLUTION = textwrap.dedent('''
    def fizzbuzz(n):
        return [("Fizz" if i % 3 == 0 else "") + ("Buzz" if i % 5 == 0 else "") or str(i)
                for i in range(1, n + 1)]
''')

# Everything the agent can find out goes into report.json; the hidden tests fail if any secret
# is in it, so the reward itself says whether the agent saw one.
AGENT = '''
import ctypes, json, os, pathlib, stat

def _read(path):
    try:
        with open(path, "rb") as fh:
            return {"ok": True, "data": fh.read(65536).decode("latin-1")}
    except OSError as exc:
        return {"ok": False, "error": exc.errno}

def _list(path):
    try:
        return {"ok": True, "entries": sorted(os.listdir(path))}
    except OSError as exc:
        return {"ok": False, "error": exc.errno}

def _walk(path):
    return {os.path.join(d, f): _read(os.path.join(d, f))
            for d, _, files in os.walk(path) for f in files}

def _errno_of(result, libc):
    return 0 if result == 0 else ctypes.get_errno()

def probe(*, prompt, base_url, api_key, model, workdir):
    t = json.loads(prompt)
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        fd = os.open("/proc/1/ns/mnt", os.O_RDONLY)
        setns = _errno_of(libc.setns(fd, 0), libc)
    except OSError as exc:
        setns = exc.errno
    devices = {}
    for dev in t["block_devices"]:
        try:
            is_block = stat.S_ISBLK(os.stat(dev).st_mode)
        except OSError:
            is_block = False
        devices[dev] = {"is_block": is_block, "read": _read(dev)}
    report = {
        "task_file": _read(t["task_file"]),
        "task_dir": _list(t["task_dir"]),
        "hidden_dirs": {d: _list(d) for d in t["hidden_dirs"]},
        "hidden_walk": {d: _walk(d) for d in t["hidden_dirs"]},
        "hidden_files": {f: _read(f) for f in t["hidden_files"]},
        "sandbox_root": _list(t["sandbox_root"]),
        "own_sandbox": os.path.basename(os.path.dirname(workdir)),
        "other_sandbox_file": _read(t["other_sandbox_file"]),
        "state_file": _read(t["state_file"]),
        "via_proc_root": {str(pid): _read(f"/proc/{pid}/root{t['hidden_files'][0]}")
                          for pid in (1, t["runner_pid"])},
        "umount": {d: _errno_of(libc.umount2(d.encode(), 2), libc) for d in t["hidden_dirs"]},
        "setns": setns,
        "block_devices": devices,
    }
    pathlib.Path(workdir, "fizzbuzz.py").write_text(t["solution"])
    pathlib.Path(workdir, "report.json").write_text(json.dumps(report))
'''

LEAK_CHECK = '''
import json, pathlib

SECRETS = {secrets!r}

def test_agent_saw_no_secret():
    report = pathlib.Path("report.json").read_text()
    assert [s for s in SECRETS if s in report] == []
'''

SOLUTION_TESTS = '''
# {marker}
from fizzbuzz import fizzbuzz

def test_fizzbuzz():
    assert fizzbuzz(15)[-3:] == ["13", "14", "FizzBuzz"]
'''


@dataclass
class TaskSet:
    task_file: Path
    hidden_files: list[str]
    secrets: list[str]
    sandboxes: Path
    state_file: Path
    agents: Path

    def tasks(self) -> list[Task]:
        return load_tasks(self.task_file)

    def harness(self) -> Harness:
        return Harness(preset="python", model="m", agent="isolation_agents:probe",
                       pythonpath=(str(self.agents),))


@pytest.fixture
def task_set(tmp_path: Path) -> TaskSet:
    """Two tasks whose hidden tests lie next to the task file, a finished sandbox left on disk
    with its hidden tests copied in, a runner state file, and the probing agent."""
    tag = os.urandom(6).hex()
    secrets = [f"HIDDEN-{tag}", f"SIBLING-TASK-{tag}", f"TASK-FILE-{tag}",
               f"OTHER-SANDBOX-{tag}", f"STATE-{tag}"]
    base = tmp_path / "tasks"
    for task_id, marker in (("fizz", secrets[0]), ("sibling", secrets[1])):
        (base / task_id / "start").mkdir(parents=True)
        (base / task_id / "start" / "fizzbuzz.py").write_text("# todo\n")
        hidden = base / task_id / "hidden"
        (hidden / "tests_hidden").mkdir(parents=True)
        (hidden / "tests_hidden" / "test_solution.py").write_text(
            SOLUTION_TESTS.format(marker=marker))
        (hidden / "tests_hidden" / "test_leak.py").write_text(LEAK_CHECK.format(secrets=secrets))
        (hidden / "pytest.ini").write_text("[pytest]\npythonpath = .\ntestpaths = tests_hidden\n")
        (hidden / "conftest.py").write_text("")
    sandboxes = tmp_path / "sandboxes"
    other = sandboxes / "rolltap-fizz-finished" / "work" / "tests_hidden"
    other.mkdir(parents=True)
    (other / "test_solution.py").write_text(f"# {secrets[3]}\n")
    state_file = tmp_path / "state.jsonl"
    # A run header, as the runner writes it; its run id is the secret.
    state_file.write_text(json.dumps({"type": "run", "run_id": secrets[4], "created": 0.0}) + "\n")
    hidden_files = [str(base / t / "hidden" / "tests_hidden" / "test_solution.py")
                    for t in ("fizz", "sibling")]
    probe = {
        "task_file": str(base / "tasks.jsonl"),
        "task_dir": str(base / "fizz"),
        "hidden_dirs": [str(base / t / "hidden") for t in ("fizz", "sibling")],
        "hidden_files": hidden_files,
        "sandbox_root": str(sandboxes),
        "other_sandbox_file": str(other / "test_solution.py"),
        "state_file": str(state_file),
        "runner_pid": os.getpid(),
        "block_devices": block_devices(),
        "solution": SOLUTION,
    }
    lines = [{"id": task_id, "prompt": json.dumps(probe), "files_dir": f"{task_id}/start",
              "verifier": {"files_dir": f"{task_id}/hidden", "reward": "pytest",
                           "command": "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -I -m pytest "
                                      "-q -p no:cacheprovider"},
              "timeouts": {"agent_s": 120, "verifier_s": 60},
              "metadata": {"secret": secrets[2]}}
             for task_id in ("fizz", "sibling")]
    task_file = base / "tasks.jsonl"
    task_file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    agents = tmp_path / "agents"
    agents.mkdir()
    (agents / "isolation_agents.py").write_text(AGENT)
    return TaskSet(task_file, hidden_files, secrets, sandboxes, state_file, agents)


def assert_saw_nothing(report: dict, ts: TaskSet) -> None:
    blob = json.dumps(report)
    assert [s for s in ts.secrets if s in blob] == []
    # Files are covered by /dev/null: they read as empty.
    assert report["task_file"] == report["state_file"] == {"ok": True, "data": ""}
    # Names stay visible (the task's directory is not itself a source), contents do not.
    assert report["task_dir"] == {"ok": True, "entries": ["hidden", "start"]}
    assert all(v == {"ok": True, "entries": []} for v in report["hidden_dirs"].values())
    assert all(v == {} for v in report["hidden_walk"].values())
    assert all(v == {"ok": False, "error": errno.ENOENT} for v in report["hidden_files"].values())
    # Of all sandboxes only its own: not the finished one, not its sibling running right now.
    assert report["sandbox_root"] == {"ok": True, "entries": [report["own_sandbox"]]}
    assert report["other_sandbox_file"] == {"ok": False, "error": errno.ENOENT}
    # Around the mounts: other processes' view of the filesystem, unmounting, another namespace.
    assert all(v == {"ok": False, "error": errno.EACCES} for v in report["via_proc_root"].values())
    assert set(report["umount"].values()) == {errno.EPERM}
    assert report["setns"] in (errno.EPERM, errno.EACCES)
    for dev, seen in report["block_devices"].items():
        assert not seen["is_block"] and seen["read"] == {"ok": True, "data": ""}, dev


def test_loading_records_where_the_task_set_lies(task_set):
    base = task_set.task_file.parent
    expected = sorted(str(p) for p in [task_set.task_file, *(
        base / t / d for t in ("fizz", "sibling") for d in ("start", "hidden"))])
    assert all(t.source_paths == tuple(expected) for t in task_set.tasks())


def reports(root: Path) -> list[dict]:
    return [json.loads((d / "work" / "report.json").read_text())
            for d in sorted(root.iterdir()) if (d / "work" / "report.json").exists()]


# ---- real gateway, real runner --------------------------------------------------------------


@pytest.fixture(scope="module")
def bare_gateway(database_url, tmp_path_factory):
    """The real gateway on the real Postgres; its upstream is an address where nothing
    listens, since these agents never call the model."""
    gw = GatewayProcess(["http://127.0.0.1:9"], database_url,
                        log_path=tmp_path_factory.mktemp("gateway") / "gateway.log")
    gw.start()
    yield gw
    gw.stop()


@needs_isolation
async def test_agents_cannot_see_task_set_other_sandboxes_or_state(task_set, bare_gateway):
    ts = task_set
    backend = LocalBackend(root=str(ts.sandboxes), keep_dirs=True)
    report = await run_rollouts(
        ts.tasks()[:1], ts.harness(), gateway=bare_gateway.url, admin_key=ADMIN_KEY,
        group_size=2, concurrency=2, backend=backend, state_path=str(ts.state_file))
    assert report.errors == [] and len(report.finished) == 2
    for rec in report.finished:
        # The verifier saw its hidden tests (both ran) and the agent no secret (the leak test).
        state = bare_gateway.admin.get(f"/admin/rollouts/{rec.rollout_id}").json()
        assert state["metrics"]["isolation"] == "mounts"
        assert (state["metrics"]["tests_passed"], state["metrics"]["tests_total"]) == (2, 2)
        assert rec.reward == state["reward"] == 1.0, state["metrics"]
    seen = reports(ts.sandboxes)
    assert len(seen) == 2
    for agent_report in seen:
        assert_saw_nothing(agent_report, ts)
    # The runner wrote the state file while agents could not read it.
    assert ts.secrets[4] in ts.state_file.read_text() and len(ts.state_file.read_text()) > 100


# ---- without isolation ----------------------------------------------------------------------

ACCESS = RolloutAccess("r-iso", "rk-iso", "http://127.0.0.1:9/v1", "http://127.0.0.1:9")


@pytest.fixture
def fresh_probe():
    """Forget the per-process answer of the isolation probe before and after the test."""
    unavailable_reason.cache_clear()
    yield
    unavailable_reason.cache_clear()


def test_fault_unshare_refused_falls_back_with_warning(task_set, fresh_probe, monkeypatch):
    """FAULT: unshare(2) is made to fail with EPERM, as it does for a non-root user or under a
    seccomp profile. The agent still runs, unprotected, and the result says so."""

    def refuse(flags: int) -> None:
        raise OSError(errno.EPERM, os.strerror(errno.EPERM), "unshare")

    monkeypatch.setattr(isolation, "unshare", refuse)
    ts = task_set
    backend = LocalBackend(root=str(ts.sandboxes), keep_dirs=True)
    request = SandboxRequest(ts.tasks()[0], ts.harness(), ACCESS,
                             private_paths=(str(ts.state_file),))
    result = asyncio.run(backend.run(request))
    assert result.status == "ok", result.agent.stderr
    assert result.isolation == "unavailable"
    (warning,) = result.metrics()["warnings"]
    assert "unshare" in warning and "Operation not permitted" in warning
    assert result.metrics()["isolation"] == "unavailable"
    # What the warning says is true: the agent read the hidden tests, and the leak test failed.
    (seen,) = reports(ts.sandboxes)
    assert ts.secrets[0] in json.dumps(seen["hidden_files"])
    assert (result.verifier.passed, result.verifier.total) == (1, 2)


async def test_disabled_by_flag(task_set):
    ts = task_set
    backend = LocalBackend(root=str(ts.sandboxes), keep_dirs=True, mount_isolation=False)
    result = await backend.run(SandboxRequest(ts.tasks()[0], ts.harness(), ACCESS))
    assert (result.status, result.isolation, result.warnings) == ("ok", "disabled", ())
    assert "warnings" not in result.metrics()
    (seen,) = reports(ts.sandboxes)
    assert len(seen["sandbox_root"]["entries"]) == 2  # the finished sandbox is in plain view


def test_cli_flag_turns_it_off():
    from sandbox import cli

    args = cli.argparse.ArgumentParser()
    cli.register(args.add_subparsers())
    common = ["rollouts", "t.jsonl", "--harness", "command", "--group-size", "1",
              "--gateway", "http://127.0.0.1:9"]
    assert cli._backend(args.parse_args(common)).mount_isolation is True
    off = args.parse_args([*common, "--no-mount-isolation"])
    assert cli._backend(off).mount_isolation is False


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the probe as another user")
def test_probe_refused_for_non_root_user():
    """The real non-root case: the probe run as `nobody` reports why it cannot isolate."""
    # Imports first, then the switch to nobody: this interpreter lies under root's home.
    code = ("import os\n"
            "from sandbox.isolation import unavailable_reason\n"
            "os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
            "print(unavailable_reason())\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "unshare" in proc.stdout and "Operation not permitted" in proc.stdout, proc.stdout


# ---- Ray: the same code path on the node ----------------------------------------------------


@needs_isolation
async def test_ray_sandbox_is_isolated_too(task_set):
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("another test initialised Ray with other settings")
    from sandbox.backends.ray import RayBackend

    ts = task_set
    backend = RayBackend(num_cpus=1, root=str(ts.sandboxes), keep_dirs=True,
                         init_options={"num_cpus": 1, "include_dashboard": False,
                                       "log_to_driver": False})
    try:
        result = await backend.run(SandboxRequest(ts.tasks()[0], ts.harness(), ACCESS,
                                                  private_paths=(str(ts.state_file),)))
    finally:
        backend.close()
    assert (result.status, result.isolation, result.reward) == ("ok", "mounts", 1.0), (
        result.agent.stderr, result.verifier and result.verifier.output)
    (seen,) = reports(ts.sandboxes)
    # The runner here is the Ray driver: its pid is not the worker's, but it is not readable
    # either way; everything else as locally.
    assert_saw_nothing(seen, ts)
