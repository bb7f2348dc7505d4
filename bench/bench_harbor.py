"""Harbor trials through the worker: the time of one oracle trial of examples/harbor/
hello-world on the bwrap environment and, side by side, on Harbor's podman environment (where
podman runs: `make bench-deps`; rolltap's base image stands in for the task's
debian:bookworm-slim, as no registry is reachable); the worker's start (what a process per trial
would pay every time), and its overhead per trial (runner's wall time minus Harbor's own time
for the trial: pipe, JSON, Trial.create)."""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.bench_images import base_ref
from sandbox import confine
from sandbox.backends.base import RolloutAccess, SandboxRequest
from sandbox.harbor import podman
from sandbox.harbor.backend import HarborBackend, harbor_python
from sandbox.harbor.tasks import load_harbor_tasks
from sandbox.presets import Harness

TASK = Path(__file__).resolve().parents[1] / "examples" / "harbor" / "hello-world"
TRIALS = 5
# Nothing listens there: the oracle makes no model call.
NO_GATEWAY = "http://127.0.0.1:9"


async def _trials(environment: str, print_fn) -> list[float]:
    (task,) = load_harbor_tasks(str(TASK))
    harness = Harness(preset="harbor:oracle", model="none")
    with tempfile.TemporaryDirectory() as trials_dir:
        # hello-world is FROM debian:bookworm-slim, which no registry here provides.
        kwargs = {"rootfs": "host"} if environment == "bwrap" else {}
        backend = HarborBackend("oracle", model=None, gateway=NO_GATEWAY,
                                environment=environment, trials_dir=trials_dir,
                                environment_kwargs=kwargs)
        started = time.monotonic()
        await backend.start()
        print_fn(f"worker start (python + import harbor): {time.monotonic() - started:.2f} s "
                 f"(harbor import {backend.ready.import_s:.2f} s)")
        walls, overheads, rewards = [], [], []
        for i in range(TRIALS):
            access = RolloutAccess(f"bench{i:08d}", "k", f"{NO_GATEWAY}/v1", NO_GATEWAY)
            t = time.monotonic()
            result = await backend.run(SandboxRequest(task, harness, access))
            wall = time.monotonic() - t
            walls.append(wall)
            overheads.append(wall - result.extra_metrics["harbor_phases_s"].get("trial", wall))
            rewards.append(result.reward)
        await backend.aclose()
    print_fn(f"{environment}: oracle trial median {statistics.median(walls):.2f} s "
             f"(min {min(walls):.2f}, max {max(walls):.2f}; {TRIALS} trials, rewards "
             f"{rewards}); worker overhead per trial median "
             f"{statistics.median(overheads) * 1000:.0f} ms")
    return walls


def _row(name: str, walls: list[float] | None) -> str:
    if walls is None:
        return f"{name:<30}{'-':>10}{'-':>10}{'-':>10}"
    return (f"{name:<30}{statistics.median(walls):>10.2f}{min(walls):>10.2f}"
            f"{max(walls):>10.2f}")


def run(print_fn=print) -> None:
    if not os.access(harbor_python(), os.X_OK):
        print_fn(f"skipped: no Harbor venv at {harbor_python()} (make install makes it)")
        return
    bwrap = asyncio.run(_trials("bwrap", print_fn))
    why = podman.missing(harbor_python())
    if why is None and not confine.own_uids():
        why = "the stand-in for the task's debian image is built as root"
    podman_walls = None
    if why is None:
        # The worker hands CONTAINERS_CONF on to podman.
        os.environ.update(podman.env())
        podman.stand_in_slim(base_ref(print_fn))
        podman_walls = asyncio.run(_trials("podman", print_fn))
    print_fn(f"{'oracle trial, s':<30}{'median':>10}{'min':>10}{'max':>10}")
    print_fn(_row("bwrap (rolltap)", bwrap))
    print_fn(_row("podman (Harbor's backend)", podman_walls))
    if why is not None:
        print_fn(f"podman: no numbers ({why})")
