"""The Ray backend on a local Ray (2 CPUs): sandboxes run as Ray tasks, results come back,
cancellation kills the sandbox's processes, and the runner drives it like the local backend."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

ray = pytest.importorskip("ray")

from sandbox.backends.base import RolloutAccess, SandboxRequest  # noqa: E402
from sandbox.backends.ray import RayBackend  # noqa: E402
from sandbox.presets import Harness  # noqa: E402
from sandbox.runner import run_rollouts  # noqa: E402
from tests.support.examples import SOLUTIONS, TASKS, writer  # noqa: E402
from tests.support.processes import alive_with, describe  # noqa: E402
from tests.support.stand_in_admin import ADMIN_KEY, task  # noqa: E402

ACCESS = RolloutAccess("r", "rk-ray", "http://127.0.0.1:9/v1", "http://127.0.0.1:9")


@pytest.fixture(scope="module")
def backend():
    if ray.is_initialized():
        pytest.skip("another test initialised Ray with other settings")
    b = RayBackend(num_cpus=1, init_options={"num_cpus": 2, "include_dashboard": False,
                                             "log_to_driver": False})
    yield b
    b.close()


async def test_sandboxes_run_as_ray_tasks(backend):
    path, code = SOLUTIONS["fizzbuzz"]
    right = writer(path, code)
    wrong = writer(path, "def fizzbuzz(n):\n    return [str(i) for i in range(1, n + 1)]\n")
    results = await asyncio.gather(
        backend.run(SandboxRequest(TASKS["fizzbuzz"], right, ACCESS)),
        backend.run(SandboxRequest(TASKS["fizzbuzz"], wrong, ACCESS)),
    )
    assert [r.reward for r in results] == [1.0, 2 / 6]  # only test_empty, test_plain_numbers
    assert {r.host for r in results} == {socket.gethostname()}


async def test_cancel_kills_the_sandbox(backend, tmp_path):
    marker = f"rolltap-ray-cancel-{time.time_ns()}"
    agent = Harness(preset="command", model="m",
                    command=f"python -c 'import time; time.sleep(600)' {marker}")
    run = asyncio.ensure_future(backend.run(SandboxRequest(TASKS["fizzbuzz"], agent, ACCESS)))
    for _ in range(600):
        if alive_with(marker):
            break
        await asyncio.sleep(0.05)
    assert alive_with(marker), "the sandbox never started"
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    # Ray delivers the cancellation to the worker asynchronously; wait for its clean-up (on a
    # loaded machine it has taken over 30 s).
    for _ in range(2400):
        if not alive_with(marker):
            break
        await asyncio.sleep(0.05)
    assert alive_with(marker) == [], describe(alive_with(marker))


async def test_runner_over_ray(backend, admin_api, harness):
    report = await run_rollouts(
        [task("a", "ok"), task("b", "crash")], harness,
        gateway=admin_api.url, admin_key=ADMIN_KEY, group_size=2, concurrency=4,
        backend=backend,
    )
    assert report.errors == []
    assert sorted((r.task_id, r.status, r.reward) for r in report.finished) == [
        ("a", "finished", 1.0), ("a", "finished", 1.0), ("b", "failed", 0.0),
        ("b", "failed", 0.0)]
    assert admin_api.in_flight == 0
