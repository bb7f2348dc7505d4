"""Benchmark of sandbox start-up: what confinement (bubblewrap, own uid, cgroup) costs.

"process": one contained `true` (rlimits, cgroup, timeout, output capture), unconfined (under
the reaper) and confined (bwrap with rolltap's python bound in, as root through the uid stage).
"sandbox": a whole LocalBackend sandbox whose harness and verifier are both `true`: areas,
relay, two phases, copy, clean-up. "pytest": the same sandbox with a two-test pytest verifier
run through rolltap's launcher with its two sentinels, the expected tests collected once per
backend (the cached case a run sees); "pytest+collect": with a fresh backend each time, so the
collection on the task's own files is paid too; "plain pytest": the same tests as a `binary`
verifier (pytest run by the command, no launcher, report or sentinels), the baseline. Medians
over ROUNDS runs, in milliseconds.

Run: python -m bench.bench_sandbox
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time

from sandbox import confine
from sandbox.backends.base import RolloutAccess, SandboxRequest
from sandbox.backends.local import LocalBackend
from sandbox.confine import Bind, Phase, View
from sandbox.layout import runtime_paths
from sandbox.limits import Limits
from sandbox.presets import Harness
from sandbox.process import run_contained
from sandbox.tasks import Task, Verifier

ROUNDS = 9
ACCESS = RolloutAccess("r", "k", "http://127.0.0.1:9/v1", "http://127.0.0.1:9")
TASK = Task(id="bench", prompt="", files={"a.txt": b"a"},
            verifier=Verifier("true", "binary", {}))
PYTEST_TASK = Task(
    id="bench-pytest", prompt="", files={"is_even.py": b"def is_even(n):\n    return True\n"},
    verifier=Verifier("python -I -m pytest -q", "pytest", {
        "pytest.ini": b"[pytest]\npythonpath = .\ntestpaths = tests_hidden\n"
                      b"addopts = -p no:cacheprovider\n",
        "tests_hidden/test_is_even.py": b"from is_even import is_even\n\n"
                                        b"def test_0():\n    assert is_even(2)\n\n"
                                        b"def test_1():\n    assert not is_even(7)\n"}))
PLAIN_TASK = Task(id="bench-plain", prompt="", files=PYTEST_TASK.files,
                  verifier=Verifier(PYTEST_TASK.verifier.command, "binary",
                                    PYTEST_TASK.verifier.files))


async def _median_ms(make) -> float:
    await make()  # warm-up: caches (runtime paths, cgroup parents) filled once
    times = []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        await make()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


async def _process(confined: bool, workdir: str) -> None:
    if confined:
        view = View(binds=(Bind(workdir, "/sandbox/work", True),
                           *confine.ro_binds(runtime_paths())))
        phase = Phase(view, confine.new_uid() if confine.own_uids() else os.geteuid(),
                      "/sandbox/work", ("true",))
        argv = confine.command(phase)
    else:
        argv = ["true"]
    outcome = await run_contained(argv, cwd=workdir, env={"PATH": "/usr/bin:/bin"},
                                  limits=Limits(), timeout_s=60, confined=confined,
                                  own_uid=confined and confine.own_uids())
    assert outcome.exit_code == 0, outcome.stderr


async def _sandbox(isolation: str, task: Task = TASK, backend: LocalBackend | None = None,
                   reward: float = 1.0) -> None:
    harness = Harness(preset="command", model="m", command="true")
    backend = backend or LocalBackend(isolation=isolation)
    result = await backend.run(SandboxRequest(task, harness, ACCESS))
    assert result.reward == reward, (result.reward_detail, result.agent and result.agent.stderr)


async def _run(print_fn) -> None:
    with tempfile.TemporaryDirectory(prefix="rolltap-bench-") as workdir:
        os.chmod(workdir, 0o777)
        process = [await _median_ms(lambda c=c: _process(c, workdir)) for c in (False, True)]
    sandbox = [await _median_ms(lambda i=i: _sandbox(i)) for i in ("none", "bwrap")]
    backends = {i: LocalBackend(isolation=i) for i in ("none", "bwrap")}
    pytest = [await _median_ms(lambda i=i: _sandbox(i, PYTEST_TASK, backends[i], 0.5))
              for i in ("none", "bwrap")]
    collect = [await _median_ms(lambda i=i: _sandbox(i, PYTEST_TASK, None, 0.5))
               for i in ("none", "bwrap")]
    baseline = [await _median_ms(lambda i=i: _sandbox(i, PLAIN_TASK, None, 0.0))
             for i in ("none", "bwrap")]
    print_fn(f"{'median ms':<16}{'unconfined':>12}{'confined':>12}{'extra':>10}")
    for name, (plain, confined) in (("process", process), ("sandbox", sandbox),
                                    ("plain pytest", baseline), ("pytest", pytest),
                                    ("pytest+collect", collect)):
        print_fn(f"{name:<16}{plain:>12.1f}{confined:>12.1f}{confined - plain:>10.1f}")
    print_fn(f"({ROUNDS} rounds each; confined = bwrap --unshare-all"
             f"{', own uid via a root stage' if confine.own_uids() else ''})")


def run(print_fn=print) -> None:
    asyncio.run(_run(print_fn))


if __name__ == "__main__":
    run()
