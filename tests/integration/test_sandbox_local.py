"""The local sandbox backend with real subprocesses: layout, environment, hidden tests, rewards,
timeouts, crashes, and agents that misbehave (fork bomb, busy loop, endless output)."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import pytest

from sandbox.backends.base import RolloutAccess, SandboxRequest
from sandbox.backends.local import LocalBackend
from sandbox.cgroup import parents
from sandbox.limits import Limits
from sandbox.presets import Harness
from sandbox.process import run_contained
from sandbox.tasks import Task, Timeouts, Verifier
from tests.support.processes import alive_with
from tests.support.tasks import FIZZBUZZ_HIDDEN_TESTS

ACCESS = RolloutAccess(
    rollout_id="r-test",
    api_key="rollout-key-123",
    openai_base_url="http://127.0.0.1:9/v1",
    anthropic_base_url="http://127.0.0.1:9",
)

# Agents run with the `python` preset from a module written into the test's tmp dir.
AGENTS = '''
import json, os, pathlib, subprocess, sys, time

def report(*, prompt, base_url, api_key, model, workdir):
    root = pathlib.Path(workdir).parent
    seen = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    pathlib.Path(workdir, "report.json").write_text(json.dumps({
        "env": dict(os.environ), "cwd": os.getcwd(), "files": seen, "prompt": prompt,
        "base_url": base_url, "api_key": api_key, "model": model, "workdir": workdir,
        "starting": pathlib.Path(workdir, "src/start.py").read_text(),
    }))

def snoop(*, prompt, base_url, api_key, model, workdir):
    """Look everywhere in the sandbox for the hidden tests; write down what was found."""
    root = pathlib.Path(workdir).parent
    found = [str(p) for p in root.rglob("*")
             if p.is_file() and b"HIDDEN-MARKER" in p.read_bytes()]
    found += [str(p) for p in root.rglob("test_hidden*")]
    pathlib.Path(workdir, "found.json").write_text(json.dumps(found))

def plant(*, prompt, base_url, api_key, model, workdir):
    """Try to make the verifier write outside the sandbox or run a planted conftest."""
    outside = os.environ["ROLLTAP_MODEL"]  # the test passes a directory as the model name
    os.symlink(outside, pathlib.Path(workdir, "tests_hidden"))
    pathlib.Path(workdir, "conftest.py").write_text(
        "import pytest\\n"
        "@pytest.hookimpl(hookwrapper=True)\\n"
        "def pytest_runtest_makereport(item, call):\\n"
        "    outcome = yield\\n"
        "    outcome.get_result().outcome = 'passed'\\n"
    )

def spawn_and_sleep(*, prompt, base_url, api_key, model, workdir):
    """Children in the group, one in a session of its own, all sleeping; then sleep."""
    marker = model
    kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", marker]),
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", marker],
                             start_new_session=True)]
    pathlib.Path(workdir, "kids.json").write_text(json.dumps([k.pid for k in kids]))
    time.sleep(600)

def background_child(*, prompt, base_url, api_key, model, workdir):
    """Exit at once, leaving a daemon behind."""
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", model],
                     start_new_session=True)
'''

FIZZBUZZ_OK = textwrap.dedent('''
    def fizzbuzz(n):
        out = []
        for i in range(1, n + 1):
            word = ("Fizz" if i % 3 == 0 else "") + ("Buzz" if i % 5 == 0 else "")
            out.append(word or str(i))
        return out
''')

HIDDEN_TESTS = "# HIDDEN-MARKER\n" + FIZZBUZZ_HIDDEN_TESTS

PYTEST = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -I -m pytest -q -p no:cacheprovider"


def make_task(
    *,
    files: dict[str, str] | None = None,
    hidden: dict[str, str] | None = None,
    command: str = PYTEST,
    reward: str = "pytest",
    agent_s: float = 30.0,
    setup: str | None = None,
) -> Task:
    if hidden is None:
        # Laid out like the example tasks: the ini and an empty conftest.py replace whatever
        # the agent left at those paths.
        hidden = {"tests_hidden/test_hidden_fizzbuzz.py": HIDDEN_TESTS,
                  "pytest.ini": "[pytest]\npythonpath = .\ntestpaths = tests_hidden\n",
                  "conftest.py": ""}
    return Task(
        id="t1",
        prompt="Implement fizzbuzz.",
        files={k: v.encode() for k, v in (files or {"fizzbuzz.py": "# todo\n"}).items()},
        verifier=Verifier(command, reward, {k: v.encode() for k, v in hidden.items()}),
        setup=setup,
        timeouts=Timeouts(agent_s=agent_s, verifier_s=60.0, setup_s=30.0),
    )


@pytest.fixture
def agents(tmp_path: Path) -> Path:
    d = tmp_path / "agents"
    d.mkdir()
    (d / "agents_under_test.py").write_text(AGENTS)
    return d


def py_agent(agents: Path, name: str, model: str = "m", **kw) -> Harness:
    return Harness(preset="python", model=model, agent=f"agents_under_test:{name}",
                   pythonpath=(str(agents),), **kw)


def sh_agent(command: str, **kw) -> Harness:
    return Harness(preset="command", model="m", command=command, **kw)


def write_solution(code: str) -> Harness:
    return sh_agent("python -c " + shlex.quote(f"open('fizzbuzz.py', 'w').write({code!r})"))


def only_sandbox(root: Path) -> Path:
    (sandbox,) = [p for p in root.iterdir() if p.name.startswith("rolltap-")]
    return sandbox


async def test_layout_and_environment(tmp_path, agents, monkeypatch):
    monkeypatch.setenv("ROLLTAP_ADMIN_KEY", "admin-secret-xyz")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "cloud-secret-xyz")
    monkeypatch.setenv("PYTHONPATH", "/parent/pythonpath")
    root = tmp_path / "sandboxes"
    root.mkdir()
    backend = LocalBackend(root=str(root), keep_dirs=True)
    task = make_task(files={"src/start.py": "print('start')\n", "fizzbuzz.py": "x = 1\n"},
                     command="true", reward="binary")
    result = await backend.run(SandboxRequest(task, py_agent(agents, "report", "tiny"), ACCESS))
    assert result.status == "ok", result.agent.stderr
    report = json.loads((only_sandbox(root) / "agent" / "work" / "report.json").read_text())
    env = report["env"]

    # Inside, the sandbox's own directories sit at fixed paths; its host paths are not shown.
    assert report["cwd"] == "/sandbox/work" == report["workdir"]
    assert report["starting"] == "print('start')\n"
    assert {"work/src/start.py", "work/fizzbuzz.py"} <= set(report["files"])
    assert (report["prompt"], report["model"]) == ("Implement fizzbuzz.", "tiny")
    # The gateway at its own loopback (port 9 is root's; the forwarder uses 8080 then).
    assert (report["base_url"], report["api_key"]) == ("http://127.0.0.1:8080/v1", ACCESS.api_key)
    allowed = {"PWD", "PATH", "HOME", "LANG", "TMPDIR", "XDG_CONFIG_HOME", "XDG_CACHE_HOME",
               "XDG_DATA_HOME", "XDG_STATE_HOME", "npm_config_registry",
               "npm_config_update_notifier", "DO_NOT_TRACK", "OPENAI_BASE_URL",
               "OPENAI_API_KEY", "ROLLTAP_BASE_URL", "ROLLTAP_API_KEY", "ROLLTAP_MODEL"}
    assert set(env) <= allowed, set(env) - allowed
    assert (env["HOME"], env["TMPDIR"]) == ("/sandbox/home", "/tmp")
    assert all(env[k].startswith("/sandbox/home/") for k in env if k.startswith("XDG_"))
    assert env["OPENAI_API_KEY"] == env["ROLLTAP_API_KEY"] == ACCESS.api_key
    assert env["npm_config_registry"].startswith("http://127.0.0.1:")
    blob = json.dumps(env)
    assert "admin-secret-xyz" not in blob and "cloud-secret-xyz" not in blob
    assert "/parent/pythonpath" not in blob


async def test_sandbox_directory_removed_afterwards(tmp_path):
    root = tmp_path / "sandboxes"
    root.mkdir()
    backend = LocalBackend(root=str(root))
    # The agent leaves a directory it cannot write into; removal must still work.
    agent = sh_agent("sh -c 'mkdir -p locked/inner && touch locked/inner/f && chmod 0 locked'")
    result = await backend.run(SandboxRequest(make_task(command="true", reward="binary"),
                                              agent, ACCESS))
    assert result.status == "ok"
    assert list(root.iterdir()) == []


async def test_hidden_tests_absent_for_agent_present_for_verifier(agents):
    # The verifier passes only if it runs the hidden tests (their file holds the marker) and
    # the agent, which searched the whole sandbox, found nothing.
    hidden = {
        "tests_hidden/test_hidden_check.py": textwrap.dedent('''
            # HIDDEN-MARKER
            import json, pathlib

            def test_agent_saw_nothing():
                assert json.loads(pathlib.Path("found.json").read_text()) == []
        '''),
        "pytest.ini": "[pytest]\ntestpaths = tests_hidden\n",
    }
    result = await LocalBackend().run(
        SandboxRequest(make_task(hidden=hidden), py_agent(agents, "snoop"), ACCESS)
    )
    assert result.status == "ok", result.agent.stderr
    assert result.verifier.passed == result.verifier.total == 1, result.verifier.output
    assert result.reward == 1.0


async def test_planted_symlink_and_conftest_do_not_work(tmp_path, agents):
    outside = tmp_path / "outside"
    outside.mkdir()
    # The agent leaves the stub as it is: every hidden test must fail.
    task = make_task(files={"fizzbuzz.py": "def fizzbuzz(n):\n    return []\n"})
    result = await LocalBackend().run(
        SandboxRequest(task, py_agent(agents, "plant", model=str(outside)), ACCESS)
    )
    assert result.status == "ok", result.agent.stderr
    assert list(outside.iterdir()) == []  # nothing written through the symlink
    assert result.verifier.total == 4, result.verifier.output  # the hidden tests did run
    # The planted conftest.py would turn every failure into a pass; the hidden one replaced it.
    assert result.reward == 0.0, result.verifier.output


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (FIZZBUZZ_OK, 1.0),
        (FIZZBUZZ_OK.replace('"Buzz"', '"Bzz"'), 0.5),  # test_one and test_fizz pass
        ("def fizzbuzz(n):\n    return []\n", 0.0),
        ("def fizzbuzz(n) return\n", 0.0),  # syntax error: collection fails
    ],
)
async def test_rewards(code, expected):
    result = await LocalBackend().run(SandboxRequest(make_task(), write_solution(code), ACCESS))
    assert result.status == "ok", result.agent.stderr
    assert result.reward == expected, result.verifier.output
    assert result.gateway_status == "finished"


async def test_binary_and_script_rewards():
    backend = LocalBackend()
    wrote = sh_agent("sh -c 'echo 0.25 > score.txt'")
    binary_ok = make_task(hidden={}, command="test -f score.txt", reward="binary")
    binary_no = make_task(hidden={}, command="test -f nothing.txt", reward="binary")
    script = make_task(hidden={"check.sh": "echo noise\ncat score.txt\n"},
                       command="sh check.sh", reward="script")
    bad_script = make_task(hidden={}, command="echo not-a-number", reward="script")
    results = await asyncio.gather(*(backend.run(SandboxRequest(t, wrote, ACCESS))
                                     for t in (binary_ok, binary_no, script, bad_script)))
    assert [r.reward for r in results] == [1.0, 0.0, 0.25, None]
    assert "no number" in results[3].reward_detail


@pytest.mark.parametrize(("crash_reward", "expected"),
                         [("zero", 0.0), ("null", None), ("verify", 1.0)])
async def test_crash(crash_reward, expected):
    # Writes a correct solution, then exits 3: only `verify` looks at the solution.
    code = f"open('fizzbuzz.py', 'w').write({FIZZBUZZ_OK!r}); raise SystemExit(3)"
    agent = sh_agent("python -c " + shlex.quote(code))
    result = await LocalBackend().run(
        SandboxRequest(make_task(), agent, ACCESS, crash_reward=crash_reward)
    )
    assert result.status == "crashed"
    assert result.agent.exit_code == 3
    assert result.gateway_status == "failed"
    assert result.reward == expected
    assert (result.verifier is not None) == (crash_reward == "verify")
    assert result.metrics()["exit_code"] == 3


@pytest.mark.parametrize("use_cgroup", [True, False], ids=["cgroup", "no-cgroup"])
async def test_timeout_kills_whole_tree(agents, use_cgroup):
    marker = f"rolltap-test-marker-{os.getpid()}-{use_cgroup}"
    backend = LocalBackend(use_cgroup=use_cgroup)
    task = make_task(agent_s=1.0)
    result = await backend.run(
        SandboxRequest(task, py_agent(agents, "spawn_and_sleep", model=marker), ACCESS)
    )
    assert result.status == "timeout"
    assert result.gateway_status == "timeout"
    assert result.reward == 0.0 and result.verifier is None
    assert alive_with(marker) == []


async def test_leftover_daemon_is_killed_after_normal_exit(agents):
    marker = f"rolltap-daemon-marker-{os.getpid()}"
    task = make_task(command="true", reward="binary")
    result = await LocalBackend().run(
        SandboxRequest(task, py_agent(agents, "background_child", model=marker), ACCESS)
    )
    assert result.status == "ok"
    assert alive_with(marker) == []


async def test_cancellation_kills_the_agent(agents):
    marker = f"rolltap-cancel-marker-{os.getpid()}"
    run = asyncio.ensure_future(LocalBackend().run(SandboxRequest(
        make_task(agent_s=60.0), py_agent(agents, "spawn_and_sleep", model=marker), ACCESS)))
    for _ in range(200):
        if len(alive_with(marker)) >= 2:
            break
        await asyncio.sleep(0.05)
    assert alive_with(marker), "the agent never started"
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert alive_with(marker) == []


async def test_cancellation_as_the_command_starts_kills_it_and_its_children(tmp_path):
    # Cancelled just after the command started, before its output pipes are connected (the
    # event loop is kept busy meanwhile, as a runner busy with other sandboxes may be), while
    # the command's children hold those pipes.
    marker = f"rolltap-start-marker-{os.getpid()}"
    child = f"{shlex.quote(sys.executable)} -c 'import time; time.sleep(600)' \"$MARK\""
    run = asyncio.ensure_future(run_contained(
        ["/bin/sh", "-c", f"{child} & {child} & wait"], cwd=str(tmp_path),
        env={"PATH": "/usr/bin:/bin", "MARK": marker}, limits=Limits(), timeout_s=600))
    try:
        for _ in range(2):  # the run starts the command: it forks, then waits for its pipes
            await asyncio.sleep(0)
        for _ in range(1000):  # blocking: the loop gets no turn to connect them
            if len(alive_with(marker)) >= 2:
                break
            time.sleep(0.01)
        assert len(alive_with(marker)) == 2, "the command never started"
    finally:
        run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(run, 60)
    assert alive_with(marker) == []


async def test_setup_runs_first_and_its_failure_is_unscorable():
    backend = LocalBackend()
    agent = sh_agent("sh -c 'test -f prepared.txt && cp prepared.txt seen.txt'")
    ok = make_task(setup="echo ready > prepared.txt", hidden={}, command="test -f seen.txt",
                   reward="binary")
    broken = make_task(setup="echo broken >&2; exit 4", hidden={}, command="true",
                       reward="binary")
    good, bad = await asyncio.gather(backend.run(SandboxRequest(ok, agent, ACCESS)),
                                     backend.run(SandboxRequest(broken, agent, ACCESS)))
    assert (good.status, good.reward) == ("ok", 1.0)
    assert (bad.status, bad.reward, bad.gateway_status) == ("setup_failed", None, "failed")
    assert bad.agent is None and "broken" in bad.metrics()["stderr_tail"]


def process_cap_available() -> bool:
    return "pids" in parents() or os.geteuid() != 0


@pytest.mark.skipif(not process_cap_available(),
                    reason="root without a writable pids cgroup: nothing could cap a fork bomb")
async def test_fork_bomb_is_capped_and_cleaned_up():
    marker = f"rolltap-forkbomb-{os.getpid()}"
    bomb = ("import os, time\n"
            "while True:\n"
            "    try:\n"
            "        os.fork()\n"
            "    except OSError:\n"
            "        time.sleep(0.01)\n")
    limits = Limits(max_procs=24, cpu_s=30)
    agent = sh_agent(f"python -c {shlex.quote(bomb)} {marker}", limits=limits)
    result = await LocalBackend().run(SandboxRequest(make_task(agent_s=1.0), agent, ACCESS))
    assert result.status == "timeout"
    if result.agent.process_cap == "cgroup":
        assert result.agent.peak_pids is not None and result.agent.peak_pids <= 24
    assert alive_with(marker) == []
    # The machine is still fine: the next sandbox runs normally.
    after = await LocalBackend().run(SandboxRequest(make_task(), write_solution(FIZZBUZZ_OK),
                                                    ACCESS))
    assert after.reward == 1.0


async def test_busy_loop_hits_cpu_limit():
    agent = sh_agent("python -c 'while True: pass'", limits=Limits(cpu_s=1))
    result = await LocalBackend().run(SandboxRequest(make_task(agent_s=60.0), agent, ACCESS))
    assert result.status == "crashed"
    assert result.agent.exit_code in (128 + signal.SIGXCPU, 128 + signal.SIGKILL)


async def test_endless_output_is_bounded():
    spam = "import sys\nwhile True:\n    sys.stdout.write('spam' * 16384)\n"
    limits = Limits(output_bytes=64 * 1024)
    agent = sh_agent(f"python -c {shlex.quote(spam)}", limits=limits)
    result = await LocalBackend().run(SandboxRequest(make_task(agent_s=1.0), agent, ACCESS))
    assert result.status == "timeout"
    assert result.agent.output_truncated
    assert result.agent.stdout_bytes > 10 * limits.output_bytes
    assert len(result.agent.stdout) < limits.output_bytes + 200
    assert "bytes omitted" in result.agent.stdout
    assert result.agent.stdout.startswith("spam") and result.agent.stdout.endswith("spam")


async def test_file_size_limit(tmp_path):
    root = tmp_path / "sandboxes"
    root.mkdir()
    writer = ("f = open('big.bin', 'wb')\n"
              "for _ in range(64):\n"
              "    f.write(b'x' * (1 << 20))\n")
    agent = sh_agent(f"python -c {shlex.quote(writer)}", limits=Limits(file_size_mb=1))
    result = await LocalBackend(root=str(root), keep_dirs=True).run(
        SandboxRequest(make_task(command="true", reward="binary"), agent, ACCESS))
    assert result.status == "crashed"
    assert (only_sandbox(root) / "agent" / "work" / "big.bin").stat().st_size <= 1 << 20


async def test_missing_harness_binary_is_a_crash():
    agent = Harness(preset="opencode", model="m", executable="no-such-harness-binary")
    result = await LocalBackend().run(SandboxRequest(make_task(), agent, ACCESS))
    assert (result.status, result.agent.exit_code) == ("crashed", 127)
    assert "no-such-harness-binary: not found" in result.agent.stderr


def test_result_round_trips_as_msgpack():
    # Ray ships requests and results between machines; both must survive serialisation.
    task = make_task()
    request = SandboxRequest(task, sh_agent("true"), ACCESS, crash_reward="null")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=SandboxRequest) == request


@pytest.mark.skipif("memory" not in parents(), reason="no memory cgroup can be made here")
async def test_memory_cap_holds_for_the_whole_sandbox():
    """The cgroup's memory cap (no address-space rlimit here) ends a sandbox that allocates
    past it, however its memory is spread over processes."""
    # Two processes, each under the cap alone, over it together; whichever the kernel kills,
    # the agent fails.
    hog = ("import os\n"
           "child = os.fork()\n"
           "blocks = [bytearray(16 << 20) for _ in range(8)]\n"
           "for b in blocks:\n"
           "    b[::4096] = b'x' * len(b[::4096])\n"
           "if child:\n"
           "    raise SystemExit(os.wait()[1] != 0)\n")
    agent = sh_agent(f"python -c {shlex.quote(hog)}",
                     limits=Limits(memory_mb=160, address_space_mb=None))
    result = await LocalBackend().run(SandboxRequest(make_task(agent_s=60.0), agent, ACCESS))
    assert "memory" in result.agent.cgroup
    assert result.status == "crashed", result.agent.stderr
    assert result.agent.peak_memory_mb is not None and result.agent.peak_memory_mb <= 160


SPARSE = ("import os\n"
          "for i in range(8):\n"
          "    with open(f'hole{i}', 'wb') as fh:\n"
          "        fh.seek(168 << 20)\n"
          "        fh.write(b'x')\n")


@pytest.mark.parametrize(("dense_mb", "expected"), [(0, 1.0), (6, 0.0)])
async def test_the_copy_for_the_verifier_keeps_holes_and_is_bounded(dense_mb, expected):
    """Eight sparse 168 MB files (free in the agent's disk) no longer overflow the verifier's
    copy and make the rollout unscorable; real data beyond the verifier's disk scores 0."""
    agent = sh_agent("python -c " + shlex.quote(
        SPARSE + f"open('dense', 'wb').write(os.urandom({dense_mb} << 20))\n"
        f"open('fizzbuzz.py', 'w').write({FIZZBUZZ_OK!r})"))
    backend = LocalBackend(task_limits=Limits(disk_mb=4))
    result = await backend.run(SandboxRequest(make_task(), agent, ACCESS))
    assert result.status == "ok", result.agent.stderr
    assert result.reward == expected, result.reward_detail
    if dense_mb:
        assert "does not fit" in result.reward_detail
