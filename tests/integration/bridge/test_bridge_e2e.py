"""The whole loop on the CPU: the real gateway in front of two real vLLM replicas serving the
tiny model, an agent (the openai SDK) playing the toy task through the gateway, and
`rolltap bridge` training on what the gateway recorded and pushing every new policy back to
both replicas (disk sync) and its version to the gateway.

The replicas serve an untied copy of the tiny model: vLLM's CPU build does not refresh a tied
LM head when it reloads weights in place (test_bridge_weights.py checks the bridge refuses
one). They are this module's own, so the session's vLLM keeps its weights.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import asyncpg
import httpx
import numpy as np
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from core.store.tokens import ids_from_bytes
from gateway.viewer.metric_history import series_name
from stack.serve_model import start_vllm
from stack.toy_task import ToyTask, run_toy_rollouts
from tests.support.gateway import ADMIN_KEY, REPO, GatewayProcess, free_port
from tests.support.vllm import TINY_MODEL_NAME
from trainer_bridge import deliveries, resume
from trainer_bridge.checkpoints import untie_embeddings
from trainer_bridge.config import match_arg
from trainer_bridge.versions import PolicyAnnouncer, VersionedTransfer
from trainer_bridge.weights import DiskWeightSync

MAX_STEPS = 30
# The toy prompt (system, tool schema, question) is about 270 tokens and shared by every
# sample, which adds only its 8 sampled tokens: a step holds about two groups of 8.
TOKEN_BUDGET = 420
PROBE = [2040, 687, 198, 71, 72, 2041, 198, 2040, 592, 198]  # a short chat prompt, as ids


@pytest.fixture(scope="module")
def untied_model(tiny_model_dir, tmp_path_factory):
    return untie_embeddings(tiny_model_dir, tmp_path_factory.mktemp("untied") / "tiny")


@pytest.fixture(scope="module")
def replicas(untied_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("replicas")
    started = [
        start_vllm(untied_model, free_port(), served_model_name=TINY_MODEL_NAME,
                   max_model_len=4096, kv_cache_gib=1, log_path=logs / f"vllm-{i}.log")
        for i in range(2)
    ]
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda v: v.wait_ready(300), started))
        yield [v.url for v in started]
    finally:
        for v in started:
            v.stop()


@pytest.fixture(scope="module")
def training_gateway(replicas, database_url, tmp_path_factory):
    gw = GatewayProcess(replicas, database_url,
                        log_path=tmp_path_factory.mktemp("training-gw") / "gateway.log").start()
    yield gw
    gw.stop()


def _complete(url: str, **body) -> dict:
    body = {"model": TINY_MODEL_NAME, "prompt": PROBE, "max_tokens": 12,
            "return_token_ids": True, **body}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()["choices"][0]


def _greedy(url: str) -> list[int]:
    return _complete(url, temperature=0)["token_ids"]


def _hf_logprobs(model, prompt: list[int], ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0]
    logprobs = torch.log_softmax(logits, -1)
    return np.array([logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(ids)])


class PauseCheckingAnnouncer(PolicyAnnouncer):
    """The real announcer, noting whether every replica was paused when it announced."""

    replicas: list[str] = []
    paused_at_announce: list[bool] = []

    def announce(self, trainer_version: int) -> int:
        self.paused_at_announce.append(all(
            httpx.get(f"{url}/is_paused", timeout=30).json()["is_paused"]
            for url in self.replicas))
        return super().announce(trainer_version)


def _push(transfer: VersionedTransfer, model) -> None:
    """One push, as AsyncGRPOTrainer makes it: its own parameter names and call order."""
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

    transfer.pause()
    transfer.send_weights((name, p.detach()) for name, p in _iter_vllm_named_params(model))
    transfer.resume()


def test_a_push_reaches_every_replica_exactly(untied_model, replicas, training_gateway,
                                              tmp_path):
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(untied_model, dtype=torch.float32)
    policy = AutoModelForCausalLM.from_pretrained(untied_model, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    before = [_greedy(url) for url in replicas]
    assert before[0] == before[1]

    announcer = PauseCheckingAnnouncer.from_gateways([training_gateway.url], ADMIN_KEY)
    announcer.replicas, announcer.paused_at_announce = replicas, []
    disk = DiskWeightSync(untied_model, tmp_path / "weights", replicas)
    transfer = VersionedTransfer(disk, announcer)
    transfer.init_weight_transfer()
    _push(transfer, policy)

    # Every replica now samples from exactly the trainer's weights (head included).
    for url in replicas:
        choice = _complete(url, temperature=1.0, logprobs=0, seed=3)
        got = np.array(choice["logprobs"]["token_logprobs"])
        expected = _hf_logprobs(policy, PROBE, choice["token_ids"])
        np.testing.assert_allclose(got, expected, atol=2e-3)
        assert not np.allclose(got, _hf_logprobs(original, PROBE, choice["token_ids"]),
                               atol=2e-3)
    after = [_greedy(url) for url in replicas]
    assert after[0] == after[1] != before[0]
    version = httpx.get(f"{training_gateway.url}/admin/policy", timeout=30,
                        headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()["version"]
    assert version == announcer.offset + 1
    assert all(not httpx.get(f"{u}/is_paused", timeout=30).json()["is_paused"] for u in replicas)

    _push(transfer, original)  # the training test starts from the original weights
    transfer.destroy()
    assert [_greedy(url) for url in replicas] == before
    assert announcer.announced == [announcer.offset + 1, announcer.offset + 2]
    assert announcer.paused_at_announce == [True, True]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == [
        "policy-000001", "policy-000002"]
    assert disk.latest == tmp_path / "weights" / "policy-000002"


async def _recorded(database_url: str, run: str) -> list[tuple[str, float, int]]:
    """(group, reward, oldest version of its sampled tokens) of every rollout of the run, in
    creation order."""
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(
            "SELECT r.group_id, r.reward, c.versions FROM rollouts r"
            " JOIN calls c ON c.rollout_id = r.id"
            " WHERE r.metadata @> jsonb_build_object('run', $1::text) AND r.status = 'finished'"
            " ORDER BY r.created_at", run)
    finally:
        await conn.close()
    return [(r["group_id"], r["reward"], int(ids_from_bytes(r["versions"]).min())) for r in rows]


def _mean(values) -> float:
    return float(np.mean(list(values)))


@pytest.mark.slow  # about 3 minutes of training: `make test-slow`, run by CI
def test_toy_task_training_raises_the_reward(untied_model, replicas, training_gateway,
                                             database_url, tmp_path):
    run = uuid.uuid4().hex[:12]
    admin = httpx.Client(base_url=training_gateway.url, timeout=60,
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    base = admin.get("/admin/policy").json()["version"]
    before = _greedy(replicas[0])
    out = tmp_path / "bridge"
    log_path = tmp_path / "bridge.log"
    command = [
        sys.executable, "-m", "trainer_bridge.cli", "bridge",
        "--model", str(untied_model), "--gateway", training_gateway.url,
        "--vllm", replicas[0], "--vllm", replicas[1],
        "--admin-key", ADMIN_KEY, "--database-url", database_url,
        "--num-generations", "8", "--max-steps", str(MAX_STEPS),
        # A high rate and DAPO's wider upper clip: sampling runs about one version behind the
        # trainer, and with the usual 0.2 the tokens it already made likelier stop counting.
        "--learning-rate", "2e-2", "--set", "epsilon_high=1.0",
        "--token-budget", str(TOKEN_BUDGET), "--queue-size", "24", "--threads", "1",
        "--match", match_arg("run", run), "--output-dir", str(out),
    ]
    started = time.monotonic()
    with log_path.open("w") as log:
        bridge = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    task = ToyTask(training_gateway.url, ADMIN_KEY, TINY_MODEL_NAME, untied_model,
                   metadata={"run": run})
    stop = threading.Event()
    driver = threading.Thread(target=run_toy_rollouts, args=(task,),
                              kwargs={"group_size": 8, "stop": stop}, daemon=True)
    try:
        # Rollouts start once the trainer pushed its initial weights (version base + 1).
        while admin.get("/admin/policy").json()["version"] <= base:
            assert bridge.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() - started < 240, "the bridge never pushed its weights"
            time.sleep(0.5)
        ready_s = time.monotonic() - started
        driver.start()
        try:
            code = bridge.wait(timeout=360)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the bridge did not finish:\n{log_path.read_text()[-4000:]}")
    finally:
        stop.set()
        if bridge.poll() is None:
            bridge.kill()
        driver.join(timeout=120)
        task.close()
    elapsed = time.monotonic() - started
    assert code == 0, log_path.read_text()[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == MAX_STEPS
    assert summary["versions"] == [base + 1, base + 1 + MAX_STEPS]
    assert summary["source"].get("too_long", 0) == 0

    # Versions advance in the gateway's records: every group sampled at one policy or a newer
    # one than the group before it, across many pushes.
    recorded = asyncio.run(_recorded(database_url, run))
    group_versions = {}
    for group, _, version in recorded:
        group_versions[group] = min(version, group_versions.get(group, version))
    versions = list(group_versions.values())
    assert versions == sorted(versions)
    assert versions[0] == base + 1 and versions[-1] >= base + MAX_STEPS - 2
    assert len(set(versions)) >= MAX_STEPS // 2

    # The policy learned the task: rollouts of the last policies score far above the first.
    by_version = {}
    for _, reward, version in recorded:
        by_version.setdefault(version - base, []).append(reward)
    first = _mean(r for v in sorted(by_version)[:5] for r in by_version[v])
    last = _mean(r for v in sorted(by_version)[-5:] for r in by_version[v])
    steps = [json.loads(line) for line in (out / "progress.jsonl").read_text().splitlines()]
    trained = [s["reward"] for s in steps]
    curve = " ".join(f"{v}:{_mean(by_version[v]):.2f}" for v in sorted(by_version))
    print(f"\nbridge ready after {ready_s:.0f} s, {MAX_STEPS} steps, {elapsed:.0f} s in all; "
          f"{len(recorded)} rollouts\nreward by policy version (rollouts sampled by it): {curve}"
          f"\nreward per step (samples trained): {' '.join(f'{r:.2f}' for r in trained)}"
          f"\nfirst five versions {first:.3f}, last five {last:.3f}")
    assert last > first + 0.4
    assert _mean(trained[-5:]) > _mean(trained[:5]) + 0.3

    # The replicas serve the trained policy, both the same one.
    after = [_greedy(url) for url in replicas]
    assert after[0] == after[1] != before


# -- exactly once, across crashes -----------------------------------------------------------

# Each point kills the bridge the Nth time it gets there (SIGKILL, no cleanup): after a claim;
# inside an optimizer step's micro-batch; after the step is in the delivery log and before its
# checkpoint; after a push is announced, the replicas still paused. A step takes about 3 samples
# and a claim 4, so the sixth claim comes a few steps in: every run trains something and leaves
# groups half trained. Every bridge after the first resumes from the checkpoints.
CRASHES = [("after_claim", 6), ("during_step", 2), ("after_log", 2), ("after_announce", 3)]


async def _run_state(database_url: str, run: str) -> tuple[dict, list]:
    """Per rollout of the run: (consumed, trainable traces); and the run's delivery log."""
    conn = await asyncpg.connect(database_url)
    try:
        rollouts = await conn.fetch(
            "SELECT r.id, r.consumed_at IS NOT NULL AS consumed,"
            " (SELECT count(*) FROM traces t WHERE t.rollout_id = r.id AND NOT t.excluded)"
            " AS traces FROM rollouts r"
            " WHERE r.metadata @> jsonb_build_object('run', $1::text) AND r.merged_at IS NOT NULL",
            run)
        log = await conn.fetch(
            "SELECT d.rollout_id, d.idx, d.outcome, d.owner, d.step, d.leased FROM deliveries d"
            " JOIN rollouts r ON r.id = d.rollout_id"
            " WHERE r.metadata @> jsonb_build_object('run', $1::text) ORDER BY d.id", run)
    finally:
        await conn.close()
    return {r["id"]: (r["consumed"], r["traces"]) for r in rollouts}, log


def _chat_s(gateway_url: str) -> float:
    """Seconds a one-token chat call through the gateway takes to complete."""
    rollout = httpx.post(f"{gateway_url}/admin/rollouts", json={}, timeout=30,
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
    started = time.monotonic()
    response = httpx.post(
        f"{rollout['openai_base_url']}/chat/completions", timeout=60,
        headers={"Authorization": f"Bearer {rollout['api_key']}"},
        json={"model": TINY_MODEL_NAME, "max_tokens": 1,
              "messages": [{"role": "user", "content": "Hi"}]})
    response.raise_for_status()
    return time.monotonic() - started


def _crash_runs(command, env, tmp_path, database_url, run, trained_per_run, gateway_url) -> None:
    """One bridge per crash point, each killed there; what the log holds after each. Right
    after the kill mid-push, a chat call through the gateway must complete within 10 s."""
    for point, nth in CRASHES:
        out = tmp_path / point
        log_path = tmp_path / f"{point}.log"
        with log_path.open("w") as log:
            bridge = subprocess.Popen(
                [*command, "--output-dir", str(out)], cwd=REPO, stdout=log,
                stderr=subprocess.STDOUT, env={**env, "ROLLTAP_CRASH_AT": f"{point}:{nth}"})
        try:
            code = bridge.wait(timeout=400)
        except subprocess.TimeoutExpired:
            bridge.kill()
            pytest.fail(f"the bridge never reached {point}:\n{log_path.read_text()[-4000:]}")
        # Killed at its crash point: no bridge crashed by itself.
        assert code == -signal.SIGKILL, log_path.read_text()[-4000:]
        if point == "after_announce":
            trained_per_run.append(("chat_s", _chat_s(gateway_url)))
        _, delivered = asyncio.run(_run_state(database_url, run))
        trained_per_run.append((point, sum(d["outcome"] == "trained" for d in delivered)))


@pytest.mark.slow  # four bridges killed and resumed, 2 minutes: `make test-slow`, run by CI
def test_a_bridge_killed_at_every_seam_trains_every_rollout_exactly_once(
    untied_model, replicas, training_gateway, database_url, tmp_path
):
    run = uuid.uuid4().hex[:12]
    task = ToyTask(training_gateway.url, ADMIN_KEY, TINY_MODEL_NAME, untied_model,
                   metadata={"run": run})
    # Enough that the first two bridges cannot train them all, however the machine's load
    # paces them: one killed at its 6th claim has put 5 groups, one killed at its 6th put
    # trains at most its first 5 (40 samples together), so later bridges always get some.
    groups, size = 11, 4
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda g: task.play_group(f"{run}-{g}", size), range(groups)))
    initial, _ = asyncio.run(_run_state(database_url, run))
    assert len(initial) == groups * size
    # New groups keep coming throughout, as in a real run: a bridge never runs dry before it
    # reaches its crash point, and the last one's micro-batches keep filling. The bridges take
    # groups oldest first, so the ones recorded above go first.
    stop = threading.Event()
    driver = threading.Thread(target=run_toy_rollouts, args=(task,),
                              kwargs={"group_size": size, "stop": stop}, daemon=True)
    driver.start()
    command = [
        sys.executable, "-m", "trainer_bridge.cli", "bridge",
        "--model", str(untied_model), "--gateway", training_gateway.url,
        "--vllm", replicas[0], "--vllm", replicas[1], "--database-url", database_url,
        "--num-generations", str(size), "--max-steps", "1000", "--learning-rate", "1e-5",
        # About 3 toy samples a step (a shared prompt of ~270 tokens and 8 sampled each), so a
        # group spans steps and every crash point lands between the steps of one group.
        "--token-budget", "300", "--queue-size", "6", "--lease-seconds", "3",
        # Restarts count versions anew: the rollouts recorded before must not go stale.
        "--max-staleness", "1000000", "--threads", "1",
        "--match", match_arg("run", run),
        # Crashes alone must not quarantine a group, however many there are.
        "--max-attempts", "2",
        # Every checkpoint is kept, so the optimizer state around each resume can be compared.
        "--resume", "--checkpoint-dir", str(tmp_path / "ckpt"), "--keep-checkpoints", "1000",
    ]
    env = {**os.environ, "ROLLTAP_ADMIN_KEY": ADMIN_KEY}
    trained_per_run = []
    try:
        _crash_runs(command, env, tmp_path, database_url, run, trained_per_run,
                    training_gateway.url)
    except BaseException:
        stop.set()
        driver.join(timeout=120)
        task.close()
        raise

    # The last bridge is not killed: it trains on until every rollout recorded before the
    # crashes is consumed and in a checkpoint (stopped before, it would put them back).
    log_path = tmp_path / "final.log"
    with log_path.open("w") as log:
        bridge = subprocess.Popen([*command, "--output-dir", str(tmp_path / "final")], cwd=REPO,
                                  stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        # Its resume line first: the crashed bridges may have trained everything already, and a
        # bridge stopped while it still imports has said nothing.
        _wait_for_line(log_path, bridge, "rolltap bridge: resuming from", 0, 400)
        deadline = time.monotonic() + 400
        while True:
            state, delivered = asyncio.run(_run_state(database_url, run))
            if all(state[rid][0] for rid in initial) and _checkpointed(
                    tmp_path / "ckpt", [d for d in delivered if d["rollout_id"] in initial]):
                break
            assert bridge.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, (
                f"not all delivered:\n{log_path.read_text()[-4000:]}")
            time.sleep(1)
    finally:
        stop.set()
        bridge.send_signal(signal.SIGTERM)
        try:
            bridge.wait(timeout=120)
        except subprocess.TimeoutExpired:
            bridge.kill()
        driver.join(timeout=120)
        task.close()
    state, delivered = asyncio.run(_run_state(database_url, run))

    # The delivery log: every trace of every rollout recorded before the crashes trained
    # exactly once, under its bridge's lease; and no trace of the run is in it twice.
    times = Counter((d["rollout_id"], d["idx"]) for d in delivered)
    assert max(times.values()) == 1, [k for k, n in times.items() if n > 1]
    assert all(d["leased"] for d in delivered)
    for rollout_id, (_, traces) in initial.items():
        rows = [d for d in delivered if d["rollout_id"] == rollout_id]
        assert sorted(d["idx"] for d in rows) == list(range(traces))
        assert {d["outcome"] for d in rows} == {"trained"} and state[rollout_id][0]
    owners = Counter(d["owner"] for d in delivered if d["rollout_id"] in initial)
    # The work was split: a crashed bridge trained some of it and the last one the rest. How
    # it splits follows the machine's load (a full-suite run on a busy machine saw one
    # crashed bridge train 37 of the 44 and the last one 7), so only the split is required.
    assert len(owners) >= 2, owners
    [chat_s] = [s for point, s in trained_per_run if point == "chat_s"]
    assert chat_s < 10, f"a chat call took {chat_s:.1f} s after a bridge died mid-push"
    counts = [n for point, n in trained_per_run if point != "chat_s"]
    assert counts[-1] > 0
    # Each restarted bridge resumed, and no group was quarantined by the crashes.
    for point, _ in CRASHES[1:]:
        assert "rolltap bridge: resuming from" in (tmp_path / f"{point}.log").read_text()
    assert "rolltap bridge: resuming from" in log_path.read_text()
    faults = asyncio.run(_faults(database_url, run))
    assert faults == {"quarantined": 0, "attempts": 0}, faults

    # The log and the weights agree: every step the log says trained is in the history of the
    # final checkpoint, which is what a resume would start from.
    checkpoint = resume.newest_resumable(tmp_path / "ckpt")
    history = resume.read_history(checkpoint)
    trained = {(d["owner"], d["step"]) for d in delivered if d["outcome"] == "trained"}
    assert trained and all(0 < step <= history.get(owner, -1) for owner, step in trained), (
        sorted(trained), history)

    # The optimizer state survives a resume: a resumed bridge's first checkpoint (its initial
    # push, before any step) holds the optimizer state it resumed with, moments and all.
    compared = _compare_resumed_optimizers(tmp_path / "ckpt")
    assert compared >= 2, compared
    print(f"\ntrained in the delivery log after each crash: {trained_per_run}; "
          f"initial rollouts trained by {len(owners)} bridges: {sorted(owners.values())}; "
          f"chat call after a kill mid-push: {chat_s:.1f} s; optimizer state compared across "
          f"{compared} resumes; final checkpoint {checkpoint.name} holds {history}")


def _checkpointed(checkpoint_dir, delivered) -> bool:
    """The steps of these deliveries are all in the newest resumable checkpoint."""
    checkpoint = resume.newest_resumable(checkpoint_dir)
    history = resume.read_history(checkpoint) if checkpoint else {}
    return all(d["step"] <= history.get(d["owner"], -2) for d in delivered)


async def _faults(database_url: str, run: str) -> dict:
    conn = await asyncpg.connect(database_url)
    try:
        row = await conn.fetchrow(
            "SELECT count(*) FILTER (WHERE quarantined_at IS NOT NULL) AS quarantined,"
            " coalesce(max(delivery_attempts), 0) AS attempts FROM rollouts"
            " WHERE metadata @> jsonb_build_object('run', $1::text)", run)
    finally:
        await conn.close()
    return dict(row)


def _compare_resumed_optimizers(checkpoint_dir) -> int:
    """Checkpoints written at the same step as the one before them are a resumed bridge's first:
    their optimizer state must equal the one it resumed from. Returns how many were compared
    (those with moments to compare: resumed after a step)."""
    from trainer_bridge.checkpoints import checkpoint_index

    checkpoints = sorted((p for p in checkpoint_dir.iterdir() if checkpoint_index(p)),
                         key=checkpoint_index)
    compared = 0
    for before, after in zip(checkpoints, checkpoints[1:], strict=False):
        if not (resume.resumable(before) and resume.resumable(after)):
            continue
        step = json.loads((before / resume.TRAINER_STATE_FILE).read_text())["global_step"]
        if json.loads((after / resume.TRAINER_STATE_FILE).read_text())["global_step"] != step:
            continue
        old, new = (torch.load(p / "optimizer.pt", weights_only=True) for p in (before, after))
        assert old["state"].keys() == new["state"].keys()
        for key, moments in old["state"].items():
            for name, value in moments.items():
                assert torch.equal(value, new["state"][key][name]), (after.name, key, name)
        compared += step > 0 and bool(old["state"])
    return compared


# -- plain chat trains; what trains nothing says why ------------------------------------------


def _chat_group(admin: httpx.Client, run: str, group: str, size: int = 4, **spec) -> list[str]:
    """`size` finished rollouts of one group, each one toolless chat call through the gateway
    with the openai SDK (16 tokens), rewards 0 and 1 in turn."""
    ids = []
    for member in range(size):
        created = admin.post("/admin/rollouts", json={
            "task_id": "qa", "group_id": f"{run}-{group}", "metadata": {"run": run}, **spec})
        assert created.status_code == 201, created.text
        rollout = created.json()
        client = openai.OpenAI(base_url=rollout["openai_base_url"], api_key=rollout["api_key"],
                               max_retries=0, timeout=120)
        client.chat.completions.create(
            model=TINY_MODEL_NAME, max_tokens=16, temperature=1.0,
            messages=[{"role": "user", "content": f"What is {group} plus {member}?"}])
        finished = admin.post(f"/admin/rollouts/{rollout['rollout_id']}/finish",
                              json={"reward": float(member % 2)})
        assert finished.status_code == 200, finished.text
        ids.append(rollout["rollout_id"])
    return ids


def _wait_for_line(log_path, bridge, needle: str, since: int, timeout: float) -> tuple[str, int]:
    """The first line of the bridge's output after character `since` that holds `needle`."""
    deadline = time.monotonic() + timeout
    while True:
        text = log_path.read_text()
        for line in text[since:].splitlines():
            if needle in line:
                return line, len(text)
        assert bridge.poll() is None, text[-4000:]
        assert time.monotonic() < deadline, f"no line with {needle!r}:\n{text[-4000:]}"
        time.sleep(0.5)


def _finite_bridge(untied_model, replicas, gateway_url: str, database_url: str, run: str,
                   tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path, Path]:
    """A bridge over `run`'s rollouts with the defaults and only --num-generations 4
    --token-budget 256 --max-steps 2 (and where things are, and `extra`): its process, output
    dir and log."""
    out, log_path = tmp_path / "bridge", tmp_path / "bridge.log"
    command = [
        sys.executable, "-m", "trainer_bridge.cli", "bridge",
        "--model", str(untied_model), "--gateway", gateway_url,
        "--vllm", replicas[0], "--vllm", replicas[1],
        "--admin-key", ADMIN_KEY, "--database-url", database_url,
        "--num-generations", "4", "--max-steps", "2", "--token-budget", "256",
        "--weight-sync", "disk", "--threads", "1", "--match", match_arg("run", run),
        "--output-dir", str(out), *extra,
    ]
    with log_path.open("w") as log:
        bridge = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    return bridge, out, log_path


def _scrape_while_running(process: subprocess.Popen, url: str, timeout: float) -> list[dict]:
    """Every /metrics scrape that answered until `process` ended: series name to value."""
    scrapes, deadline = [], time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        try:
            body = httpx.get(url, timeout=5).text
        except httpx.HTTPError:
            pass  # not serving yet, or already shut down
        else:
            scrapes.append({series_name(s.name, s.labels): s.value
                            for family in text_string_to_metric_families(body)
                            for s in family.samples})
        time.sleep(0.5)
    return scrapes


def test_plain_chat_rollouts_train_and_a_group_of_side_calls_says_why_it_does_not(
        untied_model, replicas, training_gateway, database_url, tmp_path):
    run = uuid.uuid4().hex[:12]
    admin = httpx.Client(base_url=training_gateway.url, timeout=60,
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    base = admin.get("/admin/policy").json()["version"]
    # A tool-using harness whose every rollout died after its toolless title call.
    side = _chat_group(admin, run, "side", side_calls="toolless")
    bridge, out, log_path = _finite_bridge(untied_model, replicas, training_gateway.url,
                                           database_url, run, tmp_path)
    try:
        # The side-call group is consumed, and within 30 s one line names the cause and the
        # flag that changes it.
        deadline = time.monotonic() + 240
        while not admin.get(f"/admin/rollouts/{side[0]}").json()["ledger"]:
            assert bridge.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, "the side-call group was never consumed"
            time.sleep(0.5)
        line, seen = _wait_for_line(log_path, bridge, "gives the trainer no trainable token",
                                    0, timeout=30)
        assert f"group {run}-side (4 rollouts)" in line and "excluded auxiliary" in line
        assert "--train-auxiliary" in line
        for rid in side:
            summary = admin.get(f"/admin/rollouts/{rid}").json()
            assert summary["ledger"]["trained_tokens"] == 0
            assert summary["ledger"]["excluded_tokens"]["auxiliary"] > 0
            assert summary["trained_nothing"].startswith("trained nothing: ")
            assert "excluded as auxiliary" in summary["trained_nothing"]

        # One group of plain chat rollouts, less than a step: within 30 s the bridge says what
        # the trainer holds, counted as TRL's packer counts it, and when it trains as it is.
        first = _chat_group(admin, run, "plain-0")
        tokens = sum(len(s["input_ids"]) for rid in first
                     for s in admin.get(f"/admin/rollouts/{rid}/traces").json()["sequences"])
        assert tokens <= 256, "a group of this test must be less than a step"
        line, seen = _wait_for_line(log_path, bridge, "holds a partial micro-batch: 4 samples",
                                    seen, timeout=35)
        held = re.search(r"(\d+) unique tokens and (\d+) loss terms .*--token-budget 256\); "
                         r"it trains as it is in (\d+) s", line)
        assert held, line
        unique, terms, flush_in = map(int, held.groups())
        # Its numbers do not contradict it: the group shares its prompt, so fewer unique
        # tokens than raw ones, and all within a row.
        assert 0 < terms < unique <= tokens <= 256 and flush_in <= 60, line

        # The other 28 rollouts: 32 toolless single-call rollouts make two steps.
        for group in range(1, 8):
            _chat_group(admin, run, f"plain-{group}")
        try:
            code = bridge.wait(timeout=300)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the bridge did not finish:\n{log_path.read_text()[-4000:]}")
    finally:
        if bridge.poll() is None:
            bridge.kill()
    assert code == 0, log_path.read_text()[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["versions"] == [base + 1, base + 3]
    assert admin.get("/admin/policy").json()["version"] == base + 3

    # Every consumed rollout is accounted for, in the database, progress.jsonl and /metrics.
    consumed = summary["consumed"]
    assert consumed["trained_tokens"] > 0 and consumed["excluded_tokens/auxiliary"] > 0
    assert consumed["trained_nothing"] >= 4
    steps = [json.loads(line) for line in (out / "progress.jsonl").read_text().splitlines()]
    assert steps[-1]["consumed"]["trained_tokens"] > 0
    ledgers = [admin.get(f"/admin/rollouts/{rid}").json()["ledger"] for rid in first]
    assert all(ledger["trained_tokens"] > 0 for ledger in ledgers)
    time.sleep(10.5)  # the database-derived gauges are refreshed at most every 10 s
    metrics = {(s.name, s.labels.get("cause")): s.value for family in
               text_string_to_metric_families(admin.get("/metrics").text)
               for s in family.samples}
    assert metrics[("rolltap_consumed_excluded_tokens", "auxiliary")] > 0
    assert metrics[("rolltap_consumed_trained_tokens", None)] > 0


async def _deliverable(database_url: str, run: str) -> list:
    conn = await asyncpg.connect(database_url)
    try:
        await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads,
                                  schema="pg_catalog")
        return await deliveries.pending_groups(conn, {"run": run})
    finally:
        await conn.close()


def test_a_finite_run_trains_every_sample_it_took_and_leaves_the_rest(
        untied_model, replicas, training_gateway, database_url, tmp_path):
    """Issue #40's run: 32 one-call chat rollouts in 8 groups, recorded before the bridge
    starts; a bridge with the defaults and only --num-generations 4 --token-budget 256
    --max-steps 2 takes only what its two steps can train, trains every sample it took, ends
    by itself, logs exactly what it trained, leaves every other rollout deliverable to the next
    run (under no lease), and no waiting line it says contradicts its own numbers."""
    run = uuid.uuid4().hex[:12]
    admin = httpx.Client(base_url=training_gateway.url, timeout=60,
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    for group in range(8):
        _chat_group(admin, run, f"g{group}")
    port = free_port()
    bridge, out, log_path = _finite_bridge(untied_model, replicas, training_gateway.url,
                                           database_url, run, tmp_path,
                                           "--metrics-port", str(port))
    scrapes = _scrape_while_running(bridge, f"http://127.0.0.1:{port}/metrics", timeout=900)
    if bridge.poll() is None:
        bridge.kill()
        pytest.fail(f"the bridge did not end by itself:\n{log_path.read_text()[-4000:]}")
    text = log_path.read_text()
    assert bridge.returncode == 0, text[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2, summary
    trained = summary["source"]["trained_samples"]
    rollouts, log = asyncio.run(_run_state(database_url, run))
    assert 0 < trained == sum(row["outcome"] == "trained" for row in log), (summary, text[-4000:])
    assert summary["source"]["samples"] == trained, (summary, text[-4000:])
    # One trace a rollout: the consumed ones are exactly those the two steps trained.
    assert sum(consumed for consumed, _ in rollouts.values()) == trained
    groups = asyncio.run(_deliverable(database_url, run))
    assert sum(g.ready for g in groups) == 32 - trained and not any(g.leased for g in groups)
    # Its /metrics, as scraped while it ran: the trainer's idle fraction, and samples taken
    # never fewer than trained.
    assert scrapes, text[-4000:]
    idle = [s["rolltap_trainer_idle_fraction"] for s in scrapes
            if "rolltap_trainer_idle_fraction" in s]
    assert idle and all(0 <= f <= 1 for f in idle), scrapes[-1]
    for s in scrapes:
        handed = s['rolltap_trainer_samples_total{what="handed_over"}']
        assert s['rolltap_trainer_samples_total{what="trained"}'] <= handed <= trained
    for line in text.splitlines():
        held = re.search(r"partial micro-batch: (\d+) samples, (\d+) unique tokens and (\d+) "
                         r"loss terms", line)
        if held:
            samples, unique, terms = map(int, held.groups())
            assert 0 < samples <= terms < unique <= 256, line
