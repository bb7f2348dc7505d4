"""The Ray backend on a two-node Ray cluster started on this machine: a head and a worker, each a
`ray start` of its own with one CPU and two `sandbox` slots (a custom resource every sandbox
reserves one of), so four concurrent rollouts must use both nodes. Then the worker node is
killed mid-run: its rollouts end unscorable and are counted, never lost, never run twice."""

from __future__ import annotations

import asyncio
import shlex
import textwrap
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from sandbox.backends.ray import RayBackend  # noqa: E402
from sandbox.presets import Harness  # noqa: E402
from sandbox.runner import run_rollouts  # noqa: E402
from tests.support.examples import SOLUTIONS, TASKS  # noqa: E402
from tests.support.processes import alive_with  # noqa: E402
from tests.support.ray_cluster import RayCluster  # noqa: E402
from tests.support.stand_in_admin import ADMIN_KEY  # noqa: E402

SLOTS = 2  # sandboxes per node
TASK = TASKS["fizzbuzz"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if ray.is_initialized():
        pytest.skip("another test initialised Ray with other settings")
    root = Path(tmp_path_factory.mktemp("ray"))
    c = RayCluster(root).start(head={"sandbox": SLOTS}, workers=[{"sandbox": SLOTS}])
    try:
        backend = RayBackend(address=c.address, num_cpus=0.25, resources={"sandbox": 1},
                             init_options={"log_to_driver": False})
        deadline = time.monotonic() + 180
        while len([n for n in ray.nodes() if n["Alive"]]) < 2:
            assert time.monotonic() < deadline, f"the worker node never joined:\n{c.logs()}"
            time.sleep(0.2)
        yield c, backend
    finally:
        # Leave the cluster before stopping it, whatever failed: a driver still connected to a
        # stopped cluster ends its whole process (pytest) with exit 1 once Ray gives up on it.
        ray.shutdown()
        c.stop()


def _solver(marker: str, delay_s: float) -> Harness:
    """Writes the reference solution after `delay_s`; `marker` names its processes."""
    path, code = SOLUTIONS["fizzbuzz"]
    script = (f"import time; time.sleep({delay_s}); "
              f"open({path!r}, 'w').write({textwrap.dedent(code)!r})")
    return Harness(preset="command", model="m",
                   command=f"python -c {shlex.quote(script)} {marker}")


def _node_ids() -> dict[str, str]:
    """Ray's id of the head node and of the worker node."""
    alive = [n for n in ray.nodes() if n["Alive"]]
    return {("head" if "node:__internal_head__" in n["Resources"] else "worker"): n["NodeID"]
            for n in alive}


def _agents(marker: str) -> list[int]:
    """The agent processes themselves (not the bwrap or shell that started them)."""
    return [pid for pid in alive_with(marker)
            if Path(f"/proc/{pid}/comm").read_text().strip().startswith("python")]


async def test_rollouts_land_on_both_nodes(cluster, admin_api):
    _, backend = cluster
    nodes = _node_ids()
    report = await run_rollouts([TASK], _solver(f"rolltap-ray-spread-{time.time_ns()}", 0),
                                gateway=admin_api.url, admin_key=ADMIN_KEY,
                                group_size=2 * SLOTS, concurrency=2 * SLOTS, backend=backend)
    assert report.errors == []
    assert [r.reward for r in report.finished] == [1.0] * 2 * SLOTS
    placed = [admin_api.rollouts[r.rollout_id]["metrics"]["ray_node"] for r in report.finished]
    assert sorted(placed) == sorted([nodes["head"], nodes["worker"]] * SLOTS)


async def test_a_killed_node_ends_its_rollouts_unscorable_and_counted(
    cluster, admin_api, tmp_path
):
    c, backend = cluster
    head, worker = c.nodes
    nodes = _node_ids()
    marker = f"rolltap-ray-kill-{time.time_ns()}"
    state = str(tmp_path / "run.state")
    run = asyncio.ensure_future(run_rollouts(
        [TASK], _solver(marker, 20), gateway=admin_api.url, admin_key=ADMIN_KEY,
        group_size=2 * SLOTS, concurrency=2 * SLOTS, backend=backend, state_path=state))
    deadline = time.monotonic() + 180
    while len(_agents(marker)) < 2 * SLOTS:  # every slot of both nodes runs an agent
        assert time.monotonic() < deadline and not run.done(), "the agents never all started"
        await asyncio.sleep(0.1)
    on_worker = [pid for pid in _agents(marker) if worker.runs(pid)]
    assert len(on_worker) == SLOTS and len([p for p in _agents(marker) if head.runs(p)]) == SLOTS

    worker.kill()
    report = await asyncio.wait_for(run, 300)

    # Counted: the head's rollouts scored, the worker's are the run's errors, each once.
    assert len(report.finished) == SLOTS and len(report.errors) == SLOTS
    assert {admin_api.rollouts[r.rollout_id]["metrics"]["ray_node"]
            for r in report.finished} == {nodes["head"]}
    assert [r.reward for r in report.finished] == [1.0] * SLOTS
    ids = [r.rollout_id for r in report.finished] + [e.rollout_id for e in report.errors]
    assert len(set(ids)) == 2 * SLOTS == len(admin_api.rollouts)  # none re-run
    for e in report.errors:
        # Unscorable: failed with no reward, which no trainer turns into a gradient.
        r = admin_api.rollouts[e.rollout_id]
        assert (r["status"], r["reward"]) == ("failed", None)
        assert "NodeDied" in r["metrics"]["sandbox_error"] or "died" in e.message, e.message
    assert admin_api.in_flight == 0
    # The sandboxes died with their node (bwrap --die-with-parent), none left running here.
    for _ in range(300):
        if not alive_with(marker):
            break
        await asyncio.sleep(0.1)
    assert alive_with(marker) == []

    # Never lost, never run twice: resuming the run from its state file starts nothing.
    again = await run_rollouts([TASK], _solver(marker, 0), gateway=admin_api.url,
                               admin_key=ADMIN_KEY, group_size=2 * SLOTS,
                               concurrency=2 * SLOTS, backend=backend, state_path=state)
    assert (again.skipped, again.finished, again.errors) == (2 * SLOTS, [], [])
    assert len(admin_api.rollouts) == 2 * SLOTS
