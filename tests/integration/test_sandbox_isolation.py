"""Reward integrity: every sandbox phase confined by bubblewrap (confine.py).

Pure planning of the bwrap command lines (property-tested), then real sandboxes against the real
gateway, vLLM and Postgres: a hostile agent (tests/agents/hostile_agent.py) tries to read every
process's environment, kill everything it sees, lift its limits, leave its cgroup, reach
Postgres, vLLM and the gateway's admin API, read the task set and other sandboxes, leave a
daemon behind, fill the disk and fork-bomb, while an honest sibling runs next to it; then its
solution, imported by the verifier, tries the same. Plus protected paths, the explicit
`--isolation none`, a machine without bwrap, and Ray.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import re
import shutil
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandbox import confine, images
from sandbox.backends.base import RolloutAccess, SandboxRequest
from sandbox.backends.local import LocalBackend
from sandbox.confine import Bind, ConfinementError, Phase, View, covers, exposed, inner_args
from sandbox.limits import Limits
from sandbox.presets import Harness
from sandbox.tasks import Task, Timeouts, Verifier, load_tasks
from tests.support.gateway import ADMIN_KEY
from tests.support.processes import alive_with
from tests.support.tasks import FIZZBUZZ_HIDDEN_TESTS

REPO = Path(__file__).resolve().parents[2]
AGENTS = REPO / "tests" / "agents"

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="own uids per phase need root")

# ---- planning -------------------------------------------------------------------------------

names = st.lists(st.sampled_from("abc"), min_size=1, max_size=3).map(lambda p: "/".join(p))


@given(st.lists(names, min_size=1, max_size=4), st.lists(names, max_size=4))
def test_hidden_paths_are_covered_wherever_a_bind_shows_them(sources, hidden):
    binds = [Bind(f"/h/{src}", f"/in/{i}") for i, src in enumerate(sources)]
    hidden_paths = {f"/h/{h}": True for h in hidden}
    placed = [where for where, _ in covers(binds, hidden_paths)]
    universe = {f"/h/{a}/{b}" for a in ("a", "b", "c", "a/b") for b in ("a", "c", "x")}
    for b in binds:
        if exposed([b], hidden_paths):
            continue  # the bind itself lies in a hidden path (below)
        for path in (p for p in universe if confine.is_under(p, b.source)):
            inside_path = b.dest + path[len(b.source):]
            secret = any(confine.is_under(path, h) for h in hidden_paths)
            covered = any(confine.is_under(inside_path, w) for w in placed)
            assert covered == secret, (path, inside_path, placed)
    # A bind inside a hidden path cannot be covered: it is reported instead.
    assert {(b.source, h) for b in binds for h in hidden_paths
            if confine.is_under(b.source, h)} == set(exposed(binds, hidden_paths))


def test_inner_command_line():
    view = View(binds=(Bind("/host/sb/work", "/sandbox/work", True), Bind("/opt/py", "/opt/py")),
                hidden={"/opt/py/secret": True, "/opt/py/key.txt": False},
                gateway_socket="/host/sb/gw.sock")
    args = inner_args(Phase(view, 2_000_000_001, "/sandbox/work", ("python", "-V")),
                      system=["--ro-bind", "/usr", "/usr"], staged=None)
    text = " ".join(args)
    for flag in ("--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
                 "--new-session", "--uid 2000000001", "--gid 2000000001", "--proc /proc",
                 "--dev /dev", "--bind /host/sb/work /sandbox/work", "--ro-bind /opt/py /opt/py",
                 "--tmpfs /opt/py/secret --remount-ro /opt/py/secret",
                 "--ro-bind /dev/null /opt/py/key.txt",
                 f"--ro-bind /host/sb/gw.sock {confine.GATEWAY_SOCKET}",
                 "--remount-ro / --chdir /sandbox/work -- python -V"):
        assert flag in text, flag
    # Covers come after the binds they cover; nothing shares the host's network.
    assert text.index("--ro-bind /opt/py /opt/py") < text.index("--tmpfs /opt/py/secret")
    assert "--share-net" not in args


# ---- a task set on disk ---------------------------------------------------------------------

# The hostile solution records what it could do when imported; every attempt must have failed.
ATTEMPT_TESTS = '''
import os
import fizzbuzz

def test_nothing_read():
    assert all(isinstance(v, int) for v in fizzbuzz.ATTEMPTS["read"].values()), \\
        fizzbuzz.ATTEMPTS["read"]

def test_no_network():
    assert all(isinstance(v, int) for v in fizzbuzz.ATTEMPTS["connect"].values())
    assert isinstance(fizzbuzz.ATTEMPTS["gateway_socket"], int)

def test_no_report_path():
    assert fizzbuzz.ATTEMPTS["report_fd_in_env"] is False
    assert "junit" not in fizzbuzz.ATTEMPTS["pytest_addopts"]
    print(f"VERIFIER-UID={fizzbuzz.ATTEMPTS['uid']}")
'''

VERIFY = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -I -m pytest -q -s -p no:cacheprovider"


@dataclass
class TaskSet:
    task_file: Path
    secrets: list[str]
    targets: list[str]
    sandboxes: Path
    state_file: Path

    def tasks(self) -> dict[str, Task]:
        return {t.id: t for t in load_tasks(self.task_file)}


@pytest.fixture
def task_set(tmp_path: Path) -> TaskSet:
    """Two tasks whose hidden tests lie next to the task file, a finished sandbox left on disk,
    and a runner state file; each holds a secret string."""
    tag = os.urandom(6).hex()
    secrets = [f"HIDDEN-{tag}", f"SIBLING-TASK-{tag}", f"TASK-FILE-{tag}",
               f"OTHER-SANDBOX-{tag}", f"STATE-{tag}", ADMIN_KEY]
    base = tmp_path / "tasks"
    for task_id, marker in (("hostile", secrets[0]), ("honest", secrets[1])):
        (base / task_id / "start").mkdir(parents=True)
        (base / task_id / "start" / "fizzbuzz.py").write_text("# todo\n")
        hidden = base / task_id / "hidden"
        (hidden / "tests_hidden").mkdir(parents=True)
        (hidden / "tests_hidden" / "test_solution.py").write_text(f"# {marker}\n"
                                                                  + FIZZBUZZ_HIDDEN_TESTS)
        if task_id == "hostile":
            (hidden / "tests_hidden" / "test_attempts.py").write_text(ATTEMPT_TESTS)
        (hidden / "pytest.ini").write_text("[pytest]\npythonpath = .\ntestpaths = tests_hidden\n")
        (hidden / "conftest.py").write_text("")
    sandboxes = tmp_path / "sandboxes"
    other = sandboxes / "rolltap-hostile-finished" / "agent" / "work"
    other.mkdir(parents=True)
    (other / "notes.txt").write_text(secrets[3])
    state_file = tmp_path / "state.jsonl"
    state_file.write_text(json.dumps({"type": "run", "run_id": secrets[4], "created": 0.0}) + "\n")
    lines = [{"id": task_id, "prompt": "see the agent", "files_dir": f"{task_id}/start",
              "verifier": {"files_dir": f"{task_id}/hidden", "reward": "pytest",
                           "command": VERIFY},
              "timeouts": {"agent_s": 120, "verifier_s": 60},
              "metadata": {"secret": secrets[2]}}
             for task_id in ("hostile", "honest")]
    task_file = base / "tasks.jsonl"
    task_file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    targets = [str(task_file), str(base / "honest" / "hidden" / "tests_hidden" /
                                   "test_solution.py"),
               str(base / "hostile" / "hidden" / "tests_hidden" / "test_solution.py"),
               str(other / "notes.txt"), str(state_file), str(sandboxes),
               f"/proc/1/root{task_file}", "/etc/shadow"]
    return TaskSet(task_file, secrets, targets, sandboxes, state_file)


def access_for(rollout: dict) -> RolloutAccess:
    return RolloutAccess(rollout["rollout_id"], rollout["api_key"], rollout["openai_base_url"],
                         rollout["anthropic_base_url"])


HONEST_AGENT = '''
import pathlib, time

def run(*, prompt, base_url, api_key, model, workdir):
    time.sleep(4)  # alive while its hostile sibling kills what it can see
    pathlib.Path(workdir, "fizzbuzz.py").write_text(
        "def fizzbuzz(n):\\n"
        "    return [('Fizz' * (i % 3 == 0) + 'Buzz' * (i % 5 == 0)) or str(i)"
        " for i in range(1, n + 1)]\\n")
'''


@needs_root
@pytest.mark.parametrize("on_image", [False, True], ids=["host", "image"])
async def test_hostile_agent_and_solution_change_nothing(task_set, gateway, vllm_server,
                                                         tmp_path, on_image, request):
    """The same attacks, on the host's system and on a task image (sandbox/images.py)."""
    ts = task_set
    tasks = ts.tasks()
    if on_image:
        # The image's python runs the tests: without -I, so that it finds rolltap's plugin.
        image = request.getfixturevalue("base_image")
        tasks = {k: msgspec.structs.replace(t, image=image, verifier=msgspec.structs.replace(
            t.verifier, command=VERIFY.replace(" -I", ""))) for k, t in tasks.items()}
    hostile_rollout = gateway.new_rollout(task_id="hostile")
    honest_rollout = gateway.new_rollout(task_id="honest")
    ts.secrets.append(honest_rollout["api_key"])
    marker = f"rolltap-hostile-daemon-{os.urandom(4).hex()}"
    vllm_port = int(vllm_server.url.rsplit(":", 1)[1])
    prompt = {"targets": ts.targets, "vllm": vllm_server.url,
              "ports": [5432, vllm_port], "marker": marker, "fill_mb": 256,
              "rollout": hostile_rollout["rollout_id"], "model": vllm_server.model}
    hostile = msgspec.structs.replace(tasks["hostile"], prompt=json.dumps(prompt))
    limits = Limits(max_procs=64, disk_mb=64, cpu_s=120)
    hostile_harness = Harness(preset="python", model=vllm_server.model,
                              agent="hostile_agent:run", pythonpath=(str(AGENTS),),
                              limits=limits)
    honest_dir = tmp_path / "honest_agent"
    honest_dir.mkdir()
    (honest_dir / "honest_agent.py").write_text(HONEST_AGENT)
    honest_harness = Harness(preset="python", model="m", agent="honest_agent:run",
                             pythonpath=(str(honest_dir),))
    # Through the gateway's own Unix socket: what a sandbox reaches there is the gateway itself.
    backend = LocalBackend(root=str(ts.sandboxes), gateway_socket=str(gateway.unix_socket))
    started = time.time()
    bad, good = await asyncio.gather(
        backend.run(SandboxRequest(hostile, hostile_harness, access_for(hostile_rollout),
                                   private_paths=(str(ts.state_file),))),
        backend.run(SandboxRequest(tasks["honest"], honest_harness,
                                   access_for(honest_rollout),
                                   private_paths=(str(ts.state_file),))))

    # The honest sibling is untouched by its neighbour.
    assert (good.status, good.reward, good.isolation) == ("ok", 1.0, "bwrap"), good.agent.stderr
    if on_image:  # both ran on the image's root filesystem, held from the cache
        # By digest: a tag built again leaves its older entry under the same name.
        used = {e.digest: e.last_used for e in images.Cache().entries()}
        assert used[images.inspect(tasks["hostile"].image).digest] >= started
    assert bad.status == "ok", bad.agent.stderr[-3000:]
    report = json.loads(bad.agent.stdout.strip().splitlines()[-1])

    # Its own uid, none of the machine's; only its own PID namespace; no secret anywhere in
    # what it read (every /proc/*/environ and cmdline it could see included).
    assert report["uid"] >= confine.UID_BASE
    assert max(report["proc"]["pids"]) < 64
    blob = json.dumps(report)
    assert [s for s in ts.secrets if s in blob] == []
    # Kill everything it sees: only its own processes (PID 1 of its namespace ignores it).
    assert {int(pid) for pid in report["kill"]} <= set(range(64))
    # No file of the task set, other sandboxes, the state file, other processes' roots.
    assert all(isinstance(v, int) for v in report["reads"].values()), report["reads"]
    assert all(v in (errno.ENOENT, errno.EACCES, errno.ENOTDIR)
               for v in report["listing"].values()), report["listing"]
    # Limits: no hard limit raised, no cgroup to write to.
    assert all(v != 0 for v in report["limits"].values()), report["limits"]
    assert all(v in (errno.ENOENT, errno.EROFS, errno.EACCES)
               for v in report["cgroup"].values()), report["cgroup"]
    # Network: Postgres, vLLM (and its /pause), the outside world: nothing. The gateway: its
    # model route with the key, never its admin routes.
    net = report["network"]
    assert net["tcp_5432"] == net[f"tcp_{vllm_port}"] == errno.ECONNREFUSED, net
    assert net["vllm_pause"] == errno.ECONNREFUSED
    assert net["outside"] in (errno.ENETUNREACH, errno.EHOSTUNREACH), net
    assert isinstance(net["own_model_call"], str) and " 200 " in net["own_model_call"], net
    for name in ("admin_create", "admin_policy", "admin_finish", "admin_list"):
        assert re.search(r" 40[13] ", str(net[name])), (name, net)
    assert httpx.get(f"{vllm_server.url}/is_paused", timeout=10).json()["is_paused"] is False
    # Disk and processes: bounded, and the machine is fine afterwards.
    assert report["fill"]["error"] == errno.ENOSPC and report["fill"]["written_mb"] <= 64
    assert report["fork_bomb"]["refused"] > 0 and report["fork_bomb"]["forks"] < 64
    # The daemon it left died with its namespace before the verifier's copy was made.
    assert alive_with(marker) == []

    # The verifier: another uid, over a copy; the hostile solution read nothing, reached
    # nothing, found no report to rewrite; the reward is what the honest tests give.
    verifier_uid = int(re.search(r"VERIFIER-UID=(\d+)", bad.verifier.output).group(1))
    assert verifier_uid >= confine.UID_BASE and verifier_uid != report["uid"]
    assert (bad.verifier.passed, bad.verifier.total) == (7, 7), bad.verifier.output
    assert bad.reward == 1.0 and not bad.verifier.tampered
    # The runner's sandbox directories are gone and nothing is left mounted.
    assert [p.name for p in ts.sandboxes.iterdir()] == ["rolltap-hostile-finished"]
    assert str(ts.sandboxes) not in Path("/proc/self/mountinfo").read_text()
    # The gateway took no reward from inside: both rollouts are still running, with no reward.
    for rollout in (hostile_rollout, honest_rollout):
        state = gateway.admin.get(f"/admin/rollouts/{rollout['rollout_id']}").json()
        assert (state["status"], state["reward"]) == ("running", None)


# ---- protected paths ------------------------------------------------------------------------

PROTECTED_TASK = Task(
    id="protected",
    prompt="make the tests pass",
    files={"calc.py": b"def add(a, b):\n    return 0\n",
           "tests/test_calc.py": b"from calc import add\n\ndef test_add():\n"
                                 b"    assert add(2, 2) == 4\n",
           "tests/test_later.py": b"from calc import add\n\ndef test_later():\n"
                                  b"    assert add(1, 1) == 2\n",
           "conftest.py": b""},
    verifier=Verifier("PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -I -m pytest -q "
                      "-p no:cacheprovider tests", "pytest", {}),
    timeouts=Timeouts(agent_s=60, verifier_s=60),
    protected=("tests", "conftest.py"),
)
ACCESS = RolloutAccess("r-iso", "rk-iso", "http://127.0.0.1:9/v1", "http://127.0.0.1:9")


def writer(script: str) -> Harness:
    return Harness(preset="command", model="m",
                   command=f"python -c {json.dumps(textwrap.dedent(script))}")


@pytest.mark.parametrize(("script", "status", "reward"), [
    ("open('calc.py', 'w').write('def add(a, b):\\n    return a + b\\n')", "ok", 1.0),
    ("open('tests/test_calc.py', 'w').write('def test_add():\\n    pass\\n')", "tampered", 0.0),
    ("open('conftest.py', 'w').write('import pytest\\n')", "tampered", 0.0),
    ("open('tests/conftest.py', 'w').write('')", "tampered", 0.0),
    ("import os; os.remove('tests/test_calc.py')", "tampered", 0.0),
])
async def test_protected_paths(script, status, reward):
    result = await LocalBackend().run(SandboxRequest(PROTECTED_TASK, writer(script), ACCESS))
    assert (result.status, result.reward) == (status, reward), (result.reward_detail,
                                                                result.agent.stderr)
    if status == "tampered":
        assert "protected" in result.reward_detail and result.verifier is None
        assert result.gateway_status == "finished"


async def test_solution_cannot_rewrite_protected_tests_in_the_verifier():
    """The protected tests reach the verifier read-only: the solution, imported by the first
    test file, cannot turn the next one into a pass."""
    solution = textwrap.dedent('''
        import pathlib
        try:
            pathlib.Path("tests/test_later.py").write_text("def test_later():\\n    pass\\n")
        except OSError:
            pass
        def add(a, b):
            return 0
    ''')
    result = await LocalBackend().run(SandboxRequest(
        PROTECTED_TASK, writer(f"open('calc.py', 'w').write({solution!r})"), ACCESS))
    assert (result.status, result.verifier.total) == ("ok", 2), result.verifier.output
    assert result.reward == 0.0, result.verifier.output


# ---- opting out, and machines without bwrap -------------------------------------------------


async def test_isolation_none_is_explicit_and_shown():
    result = await LocalBackend(isolation="none").run(SandboxRequest(
        PROTECTED_TASK, writer("import os; open('calc.py', 'w').write("
                               "'def add(a, b):\\n    return a + b\\n'); print(os.getuid())"),
        ACCESS))
    assert (result.isolation, result.reward) == ("none", 1.0)
    assert result.metrics()["isolation"] == "none"
    assert result.agent.stdout.strip() == str(os.geteuid())


def test_summary_says_when_sandboxes_were_not_confined():
    from sandbox.state import FinishedRollout
    from sandbox.summary import isolation_line

    record = FinishedRollout("t", 0, 0, "r", "g", "finished", "ok", 1.0, "", 1.0,
                             isolation="none")
    assert "NONE" in isolation_line([record], "bwrap")
    confined = msgspec.structs.replace(record, isolation="bwrap")
    assert isolation_line([confined], "bwrap").startswith("isolation: bwrap")


def test_missing_bwrap_names_the_package(tmp_path, monkeypatch):
    """FAULT: PATH without bwrap, as on a machine where bubblewrap is not installed."""
    monkeypatch.setenv("PATH", str(tmp_path))
    confine.tools.cache_clear()
    try:
        with pytest.raises(ConfinementError, match="bubblewrap"):
            LocalBackend()
        LocalBackend(isolation="none")  # the explicit opt-out still works
    finally:
        confine.tools.cache_clear()


def test_missing_bwrap_cli_error(tmp_path, monkeypatch, capsys):
    from sandbox import cli

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t", "prompt": "p",
                                 "verifier": {"command": "true", "reward": "binary"}}) + "\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink(shutil.which("true"), bin_dir / "true")
    monkeypatch.setenv("PATH", str(bin_dir))
    confine.tools.cache_clear()
    try:
        code = cli.run_cli([str(tasks), "--harness", "command", "--command", "true",
                            "--group-size", "1", "--gateway", "http://127.0.0.1:9",
                            "--admin-key", "k"])
    finally:
        confine.tools.cache_clear()
    assert code == 2
    err = capsys.readouterr().err
    assert "bubblewrap" in err and "--isolation none" in err


def test_cli_flags():
    from sandbox import cli

    parser = cli.argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    common = ["rollouts", "t.jsonl", "--harness", "command", "--group-size", "1",
              "--gateway", "http://127.0.0.1:9"]
    assert cli.build_backend(parser.parse_args(common)).isolation == "bwrap"
    off = cli.build_backend(parser.parse_args([*common, "--isolation", "none", "--ro-path", "/opt",
                                          "--gateway-socket", "/run/gw.sock"]))
    assert (off.isolation, off.read_only_paths, off.gateway_socket) == (
        "none", ("/opt",), "/run/gw.sock")


def test_read_only_path_inside_the_task_set_is_refused(task_set):
    ts = task_set
    task = ts.tasks()["honest"]
    harness = Harness(preset="python", model="m", agent="x:run",
                      pythonpath=(str(ts.task_file.parent / "honest" / "hidden"),))
    with pytest.raises(ValueError, match="hidden tests"):
        asyncio.run(LocalBackend(root=str(ts.sandboxes)).run(
            SandboxRequest(task, harness, ACCESS)))


# ---- Ray: the same code path on the node ----------------------------------------------------


async def test_ray_sandbox_is_confined_too(task_set):
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("another test initialised Ray with other settings")
    from sandbox.backends.ray import RayBackend

    ts = task_set
    task = ts.tasks()["honest"]
    probe = ("import json, os; print(json.dumps({'uid': os.getuid(), 'pids': "
             "[p for p in os.listdir('/proc') if p.isdigit()], 'task_file': "
             f"os.path.exists({str(ts.task_file)!r})}}))")
    backend = RayBackend(num_cpus=1, root=str(ts.sandboxes),
                         init_options={"num_cpus": 1, "include_dashboard": False,
                                       "log_to_driver": False})
    try:
        result = await backend.run(SandboxRequest(task, writer(probe), ACCESS))
    finally:
        backend.close()
    assert (result.status, result.isolation) == ("ok", "bwrap"), result.agent.stderr
    seen = json.loads(result.agent.stdout)
    assert seen["task_file"] is False and len(seen["pids"]) < 8
    assert (seen["uid"] >= confine.UID_BASE) == (os.geteuid() == 0)

