"""The sandbox runner against the real gateway and vLLM: rollouts of the example tasks end
with rewards and recorded calls, and an agent inside a sandbox cannot touch the admin API or
another rollout (invariant 6)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest

from sandbox.backends.base import RolloutAccess, SandboxRequest
from sandbox.backends.local import LocalBackend
from sandbox.presets import Harness
from sandbox.runner import run_rollouts
from sandbox.tasks import load_tasks
from tests.support.gateway import ADMIN_KEY

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "examples" / "tasks" / "tasks.jsonl"


def test_runner_rolls_out_example_tasks_through_the_gateway(gateway, vllm_server, tmp_path):
    tasks = load_tasks(TASKS)[:1]
    harness = Harness(preset="python", model=vllm_server.model,
                      agent="sandbox.agents.scripted:run")
    report = asyncio.run(run_rollouts(
        tasks, harness, gateway=gateway.url, admin_key=ADMIN_KEY, group_size=2,
        backend=LocalBackend(root=tmp_path), concurrency=2))
    assert len(report.finished) == 2 and report.errors == []
    groups: dict[str, set] = {}
    for rec in report.finished:
        state = gateway.admin.get(f"/admin/rollouts/{rec.rollout_id}").json()
        assert state["status"] in ("finished", "failed")
        assert state["reward"] is not None and 0.0 <= state["reward"] <= 1.0
        groups.setdefault(state["task_id"], set()).add(state["group_id"])
        calls = gateway.calls(rec.rollout_id)
        assert calls, "the scripted agent's calls are recorded"
        assert all(c["prompt_ids"] and len(c["logprobs"]) == len(c["completion_ids"])
                   for c in calls if c["status"] == "ok")
        assert state["merge"]["stats"]["lost_tokens"] == 0
    assert {t.id for t in tasks} == set(groups)
    assert all(len(g) == 1 for g in groups.values()), "one group per task"


def test_agent_cannot_use_admin_api_or_touch_other_rollouts(gateway, vllm_server, tmp_path):
    victim = gateway.new_rollout(task_id="victim")
    mine = gateway.new_rollout(task_id="probe")
    task = load_tasks(TASKS)[0]
    task = msgspec.structs.replace(task, prompt=json.dumps(
        {"other_rollout": victim["rollout_id"], "self": mine["rollout_id"]}))
    harness = Harness(preset="python", model=vllm_server.model,
                      agent="probe_agent:run", pythonpath=(str(REPO / "tests" / "agents"),))
    access = RolloutAccess(mine["rollout_id"], mine["api_key"], mine["openai_base_url"],
                           mine["anthropic_base_url"])
    policy_before = gateway.admin.get("/admin/policy").json()["version"]
    result = asyncio.run(LocalBackend(root=tmp_path).run(SandboxRequest(task, harness, access)))
    assert result.agent is not None and result.agent.exit_code == 0, result.agent
    report = json.loads(result.agent.stdout.strip().splitlines()[-1])
    for attempt in ("create_rollout_with_key", "create_rollout_without_key", "read_other_calls",
                    "read_other_summary_x_api_key", "finish_other", "finish_self", "set_policy"):
        assert report[attempt] in (401, 403), (attempt, report[attempt])
    assert report["own_model_call"] == 200
    assert report["env_has_admin_key"] is False
    hidden = {Path(name).name for name in task.verifier.files}
    assert not hidden & set(report["visible_files"]), "hidden tests invisible to the agent"
    # Nothing changed for the victim or the policy.
    state = gateway.admin.get(f"/admin/rollouts/{victim['rollout_id']}").json()
    assert state["status"] == "running" and state["reward"] is None and state["calls"] == []
    assert gateway.admin.get("/admin/policy").json()["version"] == policy_before


def test_opencode_runs_an_example_task_end_to_end(gateway, vllm_server, tmp_path):
    """The real OpenCode CLI from npm, in a sandbox, against the gateway and the tiny model:
    its answer is nonsense, but the protocol path holds: calls recorded with the engine's token
    ids, the hidden tests run, and the rollout ends with a reward."""
    from tests.support.harnesses import require_harnesses

    bin_dir = require_harnesses()
    task = load_tasks(TASKS)[0]
    harness = Harness(preset="opencode", model=vllm_server.model, max_output_tokens=32,
                      executable=str(bin_dir / "opencode"))
    report = asyncio.run(run_rollouts(
        [task], harness, gateway=gateway.url, admin_key=ADMIN_KEY, group_size=1,
        backend=LocalBackend(root=tmp_path), concurrency=1))
    [rec] = report.finished
    state = gateway.admin.get(f"/admin/rollouts/{rec.rollout_id}").json()
    assert state["status"] in ("finished", "failed") and state["reward"] is not None
    calls = [c for c in gateway.calls(rec.rollout_id) if c["status"] == "ok"]
    assert calls and all(c["user_agent"].startswith("opencode") for c in calls)
    assert all(c["prompt_ids"] and len(c["logprobs"]) == len(c["completion_ids"]) > 0
               for c in calls)
    assert state["merge"]["stats"]["lost_tokens"] == 0


def test_runner_stays_within_its_backlog(gateway, vllm_server,
                                                               database_url, tmp_path):
    """With max_backlog 2, a rollout starts only while the run's rollouts in flight plus those
    waiting for a trainer bridge are fewer than 2. The test plays the bridge: it takes each
    ended rollout a while after it ends (as a bridge releases a group to its trainer), and
    consumes it."""
    import asyncpg

    from sandbox.state import RunHeader, StateFile

    tasks = load_tasks(TASKS)[:1]
    harness = Harness(preset="python", model=vllm_server.model,
                      agent="sandbox.agents.scripted:run")
    run_id = f"backlog-{tmp_path.name}"
    state = tmp_path / "state.jsonl"
    StateFile(state).append(RunHeader(run_id=run_id, created=0.0))
    mine = "metadata @> jsonb_build_object('run_id', $1::text)"

    async def play():
        conn = await asyncpg.connect(database_url)
        done = asyncio.Event()

        async def trainer():
            while not done.is_set():
                await asyncio.sleep(1.5)
                await conn.execute(
                    f"UPDATE rollouts SET released_at = now(), consumed_at = now() WHERE {mine}"
                    " AND status <> 'running' AND consumed_at IS NULL", run_id)

        consuming = asyncio.ensure_future(trainer())
        try:
            report = await run_rollouts(
                tasks, harness, gateway=gateway.url, admin_key=ADMIN_KEY, group_size=2,
                repeat=3, backend=LocalBackend(root=tmp_path), concurrency=4,
                state_path=str(state), max_backlog=2)
        finally:
            done.set()
            await consuming
        rows = await conn.fetch(f"SELECT created_at, consumed_at FROM rollouts WHERE {mine}",
                                run_id)
        await conn.close()
        return report, rows

    report, rows = asyncio.run(play())
    assert len(report.finished) == 6 and report.errors == [], report.errors
    assert report.max_in_flight == 2 and report.waited_for_trainer_s > 0
    # At every rollout's start, at most 2 of the run's rollouts were started and not consumed.
    for row in rows:
        started = row["created_at"]
        open_then = [r for r in rows if r["created_at"] <= started
                     and (r["consumed_at"] is None or r["consumed_at"] > started)]
        assert len(open_then) <= 2, (started, open_then)

    with pytest.raises(ValueError, match="at least the group size"):
        asyncio.run(run_rollouts(tasks, harness, gateway=gateway.url, admin_key=ADMIN_KEY,
                                 group_size=2, backend=LocalBackend(root=tmp_path),
                                 max_backlog=1))
    # The endpoint the runner polls: the run is named, or the caller is told how to.
    assert gateway.admin.get("/admin/backlog", params={"run_id": run_id}).json() == {
        "run_id": run_id, "running": 0, "waiting": 0}
    missing = gateway.admin.get("/admin/backlog")
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "run_id"
