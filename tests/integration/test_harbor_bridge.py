"""`rolltap bridge` trains on Harbor rollouts as on any others (issue 26).

A group of Harbor trials, run as a user runs them (`rolltap rollouts TASKDIR --harness
harbor:module:Class`), in rolltap's bwrap environment against a real gateway and the tiny model
on a real vLLM: the agent (tests/agents/harbor_answer_agent.py) asks the model once with a tool
offered and the rollout's key, and the task's verifier (tests/harbor_training/alphabet) grades
the answer on a scale, so the group's rewards differ. Then `rolltap bridge` makes one optimizer
step on that group with disk weight sync: it pushes new weights to vLLM and the new policy to
the gateway, and the delivery log shows every trace of the Harbor rollouts trained.

The vLLM here is this module's own, serving an untied copy of the tiny model: vLLM's CPU build
does not refresh a tied LM head on an in-place reload (the bridge refuses the session's tied
one), and the push must not change the weights the session's vLLM serves to other tests.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import asyncpg
import pytest

from sandbox.presets import Harness, side_calls_for
from sandbox.state import StateFile
from stack.serve_model import start_vllm
from tests.support.gateway import ADMIN_KEY, REPO, GatewayProcess, free_port
from tests.support.harbor import needs_harbor
from tests.support.vllm import TINY_MODEL_NAME
from trainer_bridge.config import match_arg
from trainer_bridge.weights import untie_embeddings

TASK = REPO / "tests" / "harbor_training" / "alphabet"
AGENT = "tests.agents.harbor_answer_agent:AnswerAgent"
GROUP = 4


def test_a_harbor_agent_leaves_side_calls_to_the_gateway():
    # Harbor agents are no preset: creating their rollouts must not look one up.
    assert side_calls_for(Harness(preset="harbor:oracle", model="m")) == "auto"
    assert side_calls_for(Harness(preset="harbor:my.agents:Agent", model="m")) == "auto"
    assert side_calls_for(Harness(preset="claude-code", model="m")) == "toolless"
    with pytest.raises(ValueError, match="unknown harness preset"):
        side_calls_for(Harness(preset="nope", model="m"))


@pytest.fixture(scope="module")
def untied_model(tiny_model_dir, tmp_path_factory):
    return untie_embeddings(tiny_model_dir, tmp_path_factory.mktemp("untied") / "tiny")


@pytest.fixture(scope="module")
def trained_vllm(untied_model, tmp_path_factory):
    server = start_vllm(untied_model, free_port(), served_model_name=TINY_MODEL_NAME,
                        max_model_len=4096, kv_cache_gib=1,
                        log_path=tmp_path_factory.mktemp("harbor-vllm") / "vllm.log")
    try:
        server.wait_ready(300)
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def harbor_gateway(trained_vllm, database_url, tmp_path_factory):
    gw = GatewayProcess([trained_vllm], database_url,
                        log_path=tmp_path_factory.mktemp("harbor-gw") / "gateway.log").start()
    yield gw
    gw.stop()


async def _trained(database_url: str, rollout_ids: list[str]) -> tuple[set, list]:
    """The rollouts' trainable traces, as (rollout, idx); and their lines of the delivery log."""
    conn = await asyncpg.connect(database_url)
    try:
        traces = await conn.fetch(
            "SELECT rollout_id::text, idx FROM traces WHERE NOT excluded"
            " AND rollout_id::text = ANY($1)", rollout_ids)
        log = await conn.fetch(
            "SELECT rollout_id::text, idx, outcome, step, trained_tokens FROM deliveries"
            " WHERE rollout_id::text = ANY($1)", rollout_ids)
    finally:
        await conn.close()
    return {(t["rollout_id"], t["idx"]) for t in traces}, log


@needs_harbor
def test_bridge_trains_on_a_group_of_harbor_trials(untied_model, trained_vllm, harbor_gateway,
                                                   database_url, tmp_path):
    gateway = harbor_gateway
    state = tmp_path / "rollouts.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "sandbox.cli", str(TASK), "--harness", f"harbor:{AGENT}",
         "--group-size", str(GROUP), "--concurrency", str(GROUP), "--gateway", gateway.url,
         "--model", TINY_MODEL_NAME, "--state", str(state),
         "--trials-dir", str(tmp_path / "trials"),
         # The task is FROM debian:bookworm-slim, which no registry here provides.
         "--environment-kwarg", "rootfs=host"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, "ROLLTAP_ADMIN_KEY": ADMIN_KEY})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    header, records = StateFile(str(state)).load()
    assert header is not None and len(records) == GROUP, out
    rollouts = {r.rollout_id: gateway.admin.get(f"/admin/rollouts/{r.rollout_id}").json()
                for r in records.values()}
    assert len({r.group_id for r in records.values()}) == 1
    for rollout in rollouts.values():
        assert rollout["status"] == "finished" and rollout["reward"] is not None, (rollout, out)
        # One agent turn (a tool offered) with the engine's ids, merged into a trained trace.
        (call,) = gateway.calls(rollout["rollout_id"])
        assert call["status"] == "ok" and call["prompt_ids"] and call["completion_ids"]
        stats = rollout["merge"]["stats"]
        assert stats["lost_tokens"] == 0 and stats["trained_tokens"] > 0, stats
    rewards = [r["reward"] for r in rollouts.values()]
    assert len(set(rewards)) > 1, f"the group's rewards do not differ: {rewards}"

    base = gateway.admin.get("/admin/policy").json()["version"]
    bridge_out = tmp_path / "bridge"
    log_path = tmp_path / "bridge.log"
    command = [
        sys.executable, "-m", "trainer_bridge.cli", "bridge",
        "--model", str(untied_model), "--gateway", gateway.url, "--vllm", trained_vllm,
        "--admin-key", ADMIN_KEY, "--database-url", database_url,
        "--num-generations", str(GROUP), "--max-steps", "1", "--weight-sync", "disk",
        # A step is one micro-batch row, closed when the next sample does not fit. The group's
        # samples share their 214-token prompt in the row (TRL packs a prefix tree) and add at
        # most 16 sampled tokens each: 240 holds one or a few of them, never the whole group.
        "--token-budget", "240", "--threads", "1",
        # The rollouts were sampled before the bridge pushed its first weights.
        "--max-staleness", "1000", "--match", match_arg("run_id", header.run_id),
        "--output-dir", str(bridge_out),
    ]
    with log_path.open("w") as log:
        bridge = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                timeout=600)
    assert bridge.returncode == 0, log_path.read_text()[-4000:]
    summary = json.loads((bridge_out / "summary.json").read_text())
    assert summary["steps"] == 1, summary
    # It pushed its weights (disk sync) and told the gateway the new policy.
    assert summary["versions"][-1] > base, summary
    assert gateway.admin.get("/admin/policy").json()["version"] == summary["versions"][-1]
    assert any(p.name.startswith("policy-") for p in (bridge_out / "weights").iterdir())

    # The delivery log: the step trained traces of the Harbor rollouts, each once, and
    # consumed their rollouts with the trainer's account of them; the rollouts no step took
    # are not consumed (a next bridge trains them).
    traces, log = asyncio.run(_trained(database_url, list(rollouts)))
    assert {r for r, _ in traces} == set(rollouts) and len(traces) == GROUP, traces
    stepped = {d["rollout_id"] for d in log}
    assert log and len(stepped) == len(log) < GROUP, log
    assert {(d["rollout_id"], d["idx"]) for d in log} < traces, log
    assert all(d["outcome"] == "trained" and d["trained_tokens"] > 0 and d["step"] == 1
               for d in log), log
    ledgers = {rid: gateway.admin.get(f"/admin/rollouts/{rid}").json()["ledger"]
               for rid in rollouts}
    assert all(ledgers[rid] for rid in stepped) and sum(
        ledgers[rid]["trained_tokens"] for rid in stepped) > 0, ledgers
    assert all(ledgers[rid] is None for rid in set(rollouts) - stepped), ledgers
