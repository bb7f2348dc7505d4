"""Benchmark of sandbox start-up: what confinement (bubblewrap, own uid, cgroup) costs.

"process": one contained `true` (rlimits, cgroup, timeout, output capture), unconfined (under
the reaper) and confined (bwrap with rolltap's python bound in, as root through the uid stage).
"sandbox": a whole LocalBackend sandbox whose harness and verifier are both `true`: areas,
relay, two phases, copy, clean-up. Medians over ROUNDS runs, in milliseconds.

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

ROUNDS = 15
ACCESS = RolloutAccess("r", "k", "http://127.0.0.1:9/v1", "http://127.0.0.1:9")
TASK = Task(id="bench", prompt="", files={"a.txt": b"a"},
            verifier=Verifier("true", "binary", {}))


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


async def _sandbox(isolation: str) -> None:
    harness = Harness(preset="command", model="m", command="true")
    result = await LocalBackend(isolation=isolation).run(SandboxRequest(TASK, harness, ACCESS))
    assert result.reward == 1.0, (result.reward_detail, result.agent and result.agent.stderr)


async def _run(print_fn) -> None:
    with tempfile.TemporaryDirectory(prefix="rolltap-bench-") as workdir:
        os.chmod(workdir, 0o777)
        process = [await _median_ms(lambda c=c: _process(c, workdir)) for c in (False, True)]
    sandbox = [await _median_ms(lambda i=i: _sandbox(i)) for i in ("none", "bwrap")]
    print_fn(f"{'median ms':<12}{'unconfined':>12}{'confined':>12}{'extra':>10}")
    for name, (plain, confined) in (("process", process), ("sandbox", sandbox)):
        print_fn(f"{name:<12}{plain:>12.1f}{confined:>12.1f}{confined - plain:>10.1f}")
    print_fn(f"({ROUNDS} rounds each; confined = bwrap --unshare-all"
             f"{', own uid via a root stage' if confine.own_uids() else ''})")


def run(print_fn=print) -> None:
    asyncio.run(_run(print_fn))


if __name__ == "__main__":
    run()
