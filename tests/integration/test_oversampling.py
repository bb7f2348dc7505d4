"""Oversampling with straggler abort against the real gateway and vLLM: a group starts G + k
members; once G ended, the straggler's sandbox is killed, its engine call in flight is ended at
the gateway, and its rollout is finished `aborted`: in the ledger with its cause, never offered
to a bridge."""

from __future__ import annotations

import asyncio
import json
import os

import asyncpg
import pytest

from sandbox.backends.local import LocalBackend
from sandbox.presets import Harness
from sandbox.runner import run_rollouts
from sandbox.tasks import Task, Verifier
from tests.support.gateway import ADMIN_KEY
from tests.support.vllm import wait_engine_idle
from trainer_bridge import deliveries

# Members take tickets in a shared directory (the sandboxes are unconfined here, so they can):
# the first `keep` answer at once, once every straggler is inside its engine call; a straggler
# asks for a reply far longer than the test (min_tokens, near the tiny vLLM's context: a fast
# engine must not finish it first) without streaming, so only the
# gateway's abort can end that call early.
AGENT = '''
import json, os, pathlib, time
import openai

def take_ticket(d):
    n = 0
    while True:
        try:
            os.close(os.open(d / f"ticket-{n}", os.O_CREAT | os.O_EXCL))
            return n
        except FileExistsError:
            n += 1

def agent(*, prompt, base_url, api_key, model, workdir):
    spec = json.loads(prompt)
    d = pathlib.Path(spec["dir"])
    (d / f"pid-{os.getpid()}").write_text("")
    n = take_ticket(d)
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=900)
    messages = [{"role": "user", "content": "hello"}]
    if n >= spec["keep"]:
        (d / f"calling-{n}").write_text("")
        client.chat.completions.create(model=model, messages=messages, max_tokens=32000,
                                       extra_body={"min_tokens": 32000})
        time.sleep(600)
    client.chat.completions.create(model=model, messages=messages, max_tokens=4)
    deadline = time.monotonic() + 300
    while len(list(d.glob("calling-*"))) < spec["extra"] and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(3)  # the stragglers' calls reach the engine
    pathlib.Path(workdir, "out.txt").write_text("ok")
'''


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _bridge_view(database_url: str, run_id: str) -> tuple[list, list]:
    conn = await asyncpg.connect(database_url)
    try:
        await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads,
                                  schema="pg_catalog")
        groups = await deliveries.pending_groups(conn, {"run_id": run_id})
        claimed = []
        for g in groups:
            claimed += await deliveries.claim_group(conn, "test-bridge", g.group_key,
                                                    {"run_id": run_id}, 1.0) or []
        return groups, claimed
    finally:
        await conn.close()


@pytest.mark.parametrize("keep,extra", [(2, 1)])
def test_stragglers_are_aborted_never_trained_and_leave_nothing_running(
        gateway, vllm_server, database_url, tmp_path, keep, extra):
    shared = tmp_path / "shared"
    shared.mkdir()
    agents = tmp_path / "agents"
    agents.mkdir()
    (agents / "straggler_agent.py").write_text(AGENT)
    harness = Harness(preset="python", model=vllm_server.model, agent="straggler_agent:agent",
                      pythonpath=(str(agents),))
    task = Task(id="oversampled", prompt=json.dumps({"dir": str(shared), "keep": keep,
                                                     "extra": extra}),
                files={}, verifier=Verifier("test -f out.txt", "binary", {}))
    report = asyncio.run(run_rollouts(
        [task], harness, gateway=gateway.url, admin_key=ADMIN_KEY, group_size=keep,
        backend=LocalBackend(root=tmp_path / "sandboxes", isolation="none"),
        concurrency=keep + extra, oversample=extra))

    assert report.errors == []
    kept = [r for r in report.finished if r.status != "aborted"]
    aborted = [r for r in report.finished if r.status == "aborted"]
    assert len(kept) == keep and all(r.reward == 1.0 for r in kept)
    assert len(aborted) == extra and report.aborted == extra
    # No sandbox process is left: every agent that started is gone.
    pids = [int(p.name.split("-")[1]) for p in shared.glob("pid-*")]
    assert len(pids) == keep + extra
    assert not [pid for pid in pids if _alive(pid)]
    # The straggler's engine call was ended by the gateway's abort, and the engine is idle.
    wait_engine_idle(vllm_server.url)
    for record in aborted:
        state = gateway.admin.get(f"/admin/rollouts/{record.rollout_id}").json()
        assert state["status"] == "aborted" and state["reward"] is None
        [long_call] = gateway.calls(record.rollout_id)
        assert long_call["status"] == "aborted"
        assert "its rollout was aborted" in long_call["error"]
        ledger = state["ledger"]
        assert ledger is not None and ledger["trained_tokens"] == 0
        assert "straggler" in ledger["reason"] and "--oversample" in ledger["reason"]
        assert state["trained_nothing"] == ledger["reason"]
    for record in kept:
        state = gateway.admin.get(f"/admin/rollouts/{record.rollout_id}").json()
        assert state["metadata"]["group"]["selection"] == "fastest"
        assert "length bias" in state["metadata"]["group"]["note"]
    # A bridge is offered the kept members only.
    groups, claimed = asyncio.run(_bridge_view(database_url, report.run_id))
    assert [g.ready for g in groups] == [keep]
    assert {str(r.id) for r in claimed} == {r.rollout_id for r in kept}
    backlog = gateway.admin.get("/admin/backlog", params={"run_id": report.run_id}).json()
    assert backlog["running"] == 0 and backlog["waiting"] == keep
