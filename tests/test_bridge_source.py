"""The rollout source: release decisions and sample building (pure), leases on Postgres, and
exactly-once delivery of rollouts recorded by the real gateway from the real vLLM, with two
bridges on one database and with a bridge killed mid-run and replaced."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import signal
import threading
import time
import uuid
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor

import asyncpg
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.store import leases
from gateway.store.db import open_pool
from tests.support.gateway import ADMIN_KEY
from tests.support.postgres import fresh_database
from tests.support.sequences import Seq
from trainer_bridge.advantages import group_advantages
from trainer_bridge.samples import ROLLOUT_TOKENS_METRIC
from trainer_bridge.source import (
    Release,
    RolloutSource,
    SourceConfig,
    build_group,
    decide,
    group_number,
)
from trainer_bridge.toy_task import ToyTask

# -- release decisions and sample building (pure) -------------------------------------------


@given(
    ready=st.integers(0, 20),
    waited=st.floats(0, 1000),
    released=st.booleans(),
    g=st.integers(1, 10),
    deadline=st.floats(0, 500),
    partial=st.sampled_from(["train", "drop"]),
)
def test_release_decision(ready, waited, released, g, deadline, partial):
    config = SourceConfig("", num_generations=g, token_budget=1, group_deadline_s=deadline,
                          partial_groups=partial)
    decision = decide(ready, waited, released, config)
    if released:
        assert decision is Release.LATE
    elif ready >= g:
        assert decision is Release.COMPLETE
    elif waited < deadline:
        assert decision is Release.WAIT
    else:
        assert decision is (Release.PARTIAL if partial == "train" else Release.EXPIRED)
    assert decision.trains == (decision in (Release.COMPLETE, Release.PARTIAL))


@given(st.text(max_size=80), st.text(max_size=80))
def test_group_number_is_stable_and_fits_62_bits(a, b):
    assert group_number(a) == group_number(a)
    assert 0 <= group_number(a) < 2**62
    if a != b:
        assert group_number(a) != group_number(b)  # 62-bit collisions: not in this lifetime


@st.composite
def rollout(draw):
    """A claimed rollout (reward, merge stats) and its merged sequences."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    seqs = []
    for _ in range(draw(st.integers(0, 3))):
        n = int(rng.integers(3, 40))
        mask = np.zeros(n, np.uint8)
        mask[int(rng.integers(1, n - 1)):] = 1
        seqs.append(Seq(rng.integers(0, 2048, n).astype(np.int32), mask,
                        np.where(mask, -rng.random(n), 0).astype(np.float32),
                        np.where(mask, rng.integers(10, 16), -1).astype(np.int32)))
    member = {
        "id": uuid.uuid4(),
        "reward": draw(st.one_of(st.none(), st.floats(-5, 5))),
        "merge_stats": {"calls": draw(st.integers(1, 6)),
                        "causes": {"drift": draw(st.integers(0, 3))}},
    }
    return member, seqs


@given(st.lists(rollout(), min_size=1, max_size=6), st.integers(10, 20), st.integers(0, 6))
def test_group_samples_share_their_rollouts_advantage(rollouts, trainer_version, staleness):
    members = [m for m, _ in rollouts]
    traces = {m["id"]: seqs for m, seqs in rollouts}
    config = SourceConfig("", num_generations=4, token_budget=30, max_staleness=staleness,
                          version_offset=10)
    batch = build_group(members, traces, group_id=7, config=config,
                        trainer_version=trainer_version)
    advantages = group_advantages([m["reward"] for m in members])
    expected = []
    for member, advantage in zip(members, advantages):
        for seq in traces[member["id"]]:
            if len(seq.input_ids) > 30:
                continue
            version = int(seq.versions[seq.loss_mask.astype(bool)].min()) - 10
            if trainer_version - version <= staleness:
                expected.append((advantage, version, member["reward"]))
    got = [(s.advantage, s.model_version, s.metrics["reward"]) for s in batch.samples]
    assert len(got) == len(expected)
    for (adv, version, reward), (g_adv, g_version, g_reward) in zip(expected, got):
        assert g_adv == pytest.approx(adv) and g_version == version
        assert g_reward == reward or (reward is None and np.isnan(g_reward))
    assert all(s.group_id == 7 for s in batch.samples)
    # One trained-token count per rollout, whatever its sequences (rollout-level loss weights).
    assert all(s.metrics[ROLLOUT_TOKENS_METRIC] > 0 for s in batch.samples)
    assert batch.counts["rollouts"] == len(members)
    assert batch.counts["stale"] + batch.counts["samples"] + batch.counts["too_long"] == sum(
        len(seqs) for _, seqs in rollouts)
    assert batch.metrics["rollout/group_size"] == len(members)
    assert batch.metrics["rollout/drift_rate"] == (
        sum(m["merge_stats"]["causes"]["drift"] for m in members),
        sum(m["merge_stats"]["calls"] - 1 for m in members))
    scored = [m["reward"] for m in members if m["reward"] is not None]
    if scored:
        assert batch.metrics["rollout/reward_mean"] == pytest.approx(np.mean(scored))


# -- leases on Postgres (rows written directly: these tests are about the lease logic) -------


@pytest.fixture(scope="module")
def lease_database():
    dsn, drop = fresh_database("rolltap_leases")
    yield dsn
    drop()


@pytest.fixture(scope="module")
async def lease_pool(lease_database):
    pool = await open_pool(lease_database, min_size=3, max_size=6)
    yield pool
    await pool.close()


async def _rollouts(pool, group: str, n: int, match: dict, consumed: int = 0) -> list:
    """`n` finished, merged rollouts of one group, the first `consumed` already consumed."""
    ids = [uuid.uuid4() for _ in range(n)]
    async with pool.acquire() as conn:
        await conn.executemany(
            "INSERT INTO rollouts (id, key_hash, group_id, metadata, status, reward, finished_at,"
            " merged_at, merge_stats, consumed_at)"
            " VALUES ($1, $2, $3, $4, 'finished', 1.0, now(), now(), '{}',"
            "         CASE WHEN $5 THEN now() END)",
            [(i, os.urandom(16), group, match, k < consumed) for k, i in enumerate(ids)],
        )
    return ids


async def test_a_claim_takes_the_whole_group_or_nothing(lease_pool):
    match = {"run": uuid.uuid4().hex}
    ids = await _rollouts(lease_pool, "g-all", 3, match)
    async with lease_pool.acquire() as holder, lease_pool.acquire() as other:
        async with holder.transaction():
            # Another bridge in the middle of delivering one of the rows.
            await holder.execute("SELECT 1 FROM rollouts WHERE id = $1 FOR UPDATE", ids[0])
            claim = leases.claim_group(other, "B", "g-all", match, 30)
            assert await asyncio.wait_for(claim, 10) is None  # skipped, not waited for
        claimed = await leases.claim_group(other, "B", "g-all", match, 30)
    assert sorted(r["id"] for r in claimed) == sorted(ids)


async def test_a_lease_runs_out_and_its_old_owner_cannot_consume(lease_pool):
    match = {"run": uuid.uuid4().hex}
    ids = await _rollouts(lease_pool, "g-lease", 2, match)
    async with lease_pool.acquire() as conn:
        assert len(await leases.claim_group(conn, "A", "g-lease", match, 1.0)) == 2
        [pending] = await leases.pending_groups(conn, match)
        assert pending["leased"] and pending["ready"] == 2
        assert await leases.claim_group(conn, "B", "g-lease", match, 30) is None
        deadline = time.monotonic() + 20
        while (await leases.pending_groups(conn, match))[0]["leased"]:
            assert time.monotonic() < deadline, "the lease never ran out"
            await asyncio.sleep(0.2)
        assert len(await leases.claim_group(conn, "B", "g-lease", match, 30)) == 2
        with pytest.raises(leases.LeaseLost):
            async with conn.transaction():
                await leases.consume(conn, "A", ids)
        async with conn.transaction():
            waited = await leases.consume(conn, "B", ids)
        assert set(waited) == set(ids) and all(w >= 0 for w in waited.values())
        with pytest.raises(leases.LeaseLost):  # once
            async with conn.transaction():
                await leases.consume(conn, "B", ids)
        rows = await conn.fetch("SELECT lease_owner, consumed_at FROM rollouts WHERE id = ANY($1)",
                                ids)
        assert all(r["lease_owner"] == "B" and r["consumed_at"] for r in rows)
        assert await leases.pending_groups(conn, match) == []


async def test_a_released_claim_is_free_at_once(lease_pool):
    match = {"run": uuid.uuid4().hex}
    ids = await _rollouts(lease_pool, "g-release", 2, match)
    async with lease_pool.acquire() as conn:
        await leases.claim_group(conn, "A", "g-release", match, 600)
        await leases.release(conn, "A", ids)
        assert len(await leases.claim_group(conn, "B", "g-release", match, 600)) == 2


async def test_pending_groups_know_late_members_and_filter_on_metadata(lease_pool):
    match = {"run": uuid.uuid4().hex}
    await _rollouts(lease_pool, "g-late", 3, match, consumed=2)
    await _rollouts(lease_pool, "g-new", 2, match)
    await _rollouts(lease_pool, "g-other", 2, {"run": "another run"})
    async with lease_pool.acquire() as conn:
        pending = {r["group_key"]: r for r in await leases.pending_groups(conn, match)}
    assert set(pending) == {"g-late", "g-new"}
    assert pending["g-late"]["released"] and pending["g-late"]["ready"] == 1
    assert not pending["g-new"]["released"] and pending["g-new"]["ready"] == 2


# -- the source against the real gateway and vLLM -------------------------------------------


def _config(database_url, run, **overrides) -> SourceConfig:
    return SourceConfig(**{
        "database_url": database_url,
        "num_generations": 4,
        "token_budget": 4096,
        "poll_interval_s": 0.5,
        "match": {"run": run},
        "queue_size": 10**6,
        "max_staleness": 10**6,  # this test trains nothing; versions do not matter here
        **overrides,
    })


class Drain:
    """A trainer's side of a source: takes every sample off its queue."""

    def __init__(self, source: RolloutSource) -> None:
        self.source = source
        self.samples = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self):
        self.source.start()
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            try:
                self.samples.append(self.source.rollout_buffer.get(timeout=0.1))
            except queue.Empty:
                continue

    def stop(self):
        self.source.stop()
        self._stop.set()
        self._thread.join()
        while not self.source.rollout_buffer.empty():
            self.samples.append(self.source.rollout_buffer.get())


def _toy(gateway, vllm_server, tiny_model_dir, run) -> ToyTask:
    return ToyTask(gateway.url, ADMIN_KEY, vllm_server.model, tiny_model_dir,
                   metadata={"run": run})


async def _consumers(database_url, run) -> dict:
    """rollout id -> (group key, lease_owner) of every consumed rollout of the run, and the
    number of the run's trainable sequences."""
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(
            "SELECT id, group_id, lease_owner, consumed_at IS NOT NULL AS consumed FROM rollouts"
            " WHERE metadata @> jsonb_build_object('run', $1::text)", run)
        sequences = await conn.fetchval(
            "SELECT count(*) FROM traces t JOIN rollouts r ON r.id = t.rollout_id"
            " WHERE NOT t.excluded AND r.metadata @> jsonb_build_object('run', $1::text)", run)
    finally:
        await conn.close()
    return {r["id"]: (r["group_id"], r["lease_owner"], r["consumed"]) for r in rows}, sequences


async def _wait_all_consumed(database_url, run, expected: int, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        rows, _ = await _consumers(database_url, run)
        if len(rows) == expected and all(consumed for _, _, consumed in rows.values()):
            return rows
        assert time.monotonic() < deadline, f"not all delivered: {Counter(rows.values())}"
        await asyncio.sleep(0.3)


def _by_group(samples) -> Counter:
    return Counter(s.group_id for s in samples)


async def test_two_bridges_deliver_every_rollout_exactly_once(
    gateway, vllm_server, tiny_model_dir, database_url
):
    run = uuid.uuid4().hex
    config = _config(database_url, run)
    bridges = {owner: Drain(RolloutSource(config, owner=f"{owner}-{run}")).start()
               for owner in ("A", "B")}
    task = _toy(gateway, vllm_server, tiny_model_dir, run)
    groups, size = 12, 4
    try:
        # Two groups in flight at a time: finishes interleave, both bridges race for them.
        with ThreadPoolExecutor(2) as pool:
            await asyncio.to_thread(
                lambda: list(pool.map(lambda g: task.play_group(f"{run}-{g}", size),
                                      range(groups))))
        rows = await _wait_all_consumed(database_url, run, groups * size)
    finally:
        for bridge in bridges.values():
            bridge.stop()
        task.close()
    _, sequences = await _consumers(database_url, run)
    owners = {f"{o}-{run}": bridge for o, bridge in bridges.items()}
    delivered = [s for bridge in bridges.values() for s in bridge.samples]
    # Every trainable sequence of every rollout reached exactly one trainer queue, once.
    assert len(delivered) == sequences >= groups * size
    by_owner = defaultdict(set)
    for group_key, owner, _ in rows.values():
        by_owner[group_key].add(owner)
    for group_key, group_owners in by_owner.items():
        [owner] = group_owners  # a group is never split between bridges
        counts = _by_group(owners[owner].samples)
        assert counts[group_number(group_key)] == size
        other = next(b for o, b in owners.items() if o != owner)
        assert group_number(group_key) not in _by_group(other.samples)
    split = {o: len(b.samples) for o, b in bridges.items()}
    print(f"\nsamples per bridge: {split}")


def _bridge_process(database_url: str, owner: str, run: str) -> None:
    """A bridge in its own process (the test kills it): a source and a trainer-side drain."""
    Drain(RolloutSource(_config(database_url, run, lease_s=2.0), owner=owner)).start()
    threading.Event().wait()


async def test_a_killed_bridge_is_replaced_without_loss_or_repeat(
    gateway, vllm_server, tiny_model_dir, database_url
):
    run = uuid.uuid4().hex
    first, second = f"first-{run}", f"second-{run}"
    conn = await asyncpg.connect(database_url)
    listening = await _listeners(conn)
    child = multiprocessing.get_context("spawn").Process(
        target=_bridge_process, args=(database_url, first, run), daemon=True)
    child.start()
    task = _toy(gateway, vllm_server, tiny_model_dir, run)
    groups, size = 10, 4
    replacement = None
    try:
        await _until(lambda: _listeners(conn), lambda n: n > listening, "the bridge never started")
        producer = asyncio.create_task(asyncio.to_thread(
            lambda: [task.play_group(f"{run}-{g}", size) for g in range(groups)]))
        await _until(lambda: _consumers(database_url, run),
                     lambda found: sum(o == first for _, o, c in found[0].values() if c)
                     >= 3 * size, "the first bridge never consumed three groups")
        os.kill(child.pid, signal.SIGKILL)  # mid-run: more groups are on their way
        child.join()
        replacement = Drain(RolloutSource(_config(database_url, run), owner=second)).start()
        await producer
        rows = await _wait_all_consumed(database_url, run, groups * size)
    finally:
        if child.is_alive():
            os.kill(child.pid, signal.SIGKILL)
        if replacement is not None:
            replacement.stop()
        task.close()
        await conn.close()
    owners = Counter(owner for _, owner, _ in rows.values())
    assert set(owners) == {first, second}
    # Each toy rollout is one trainable sequence: the replacement delivered exactly the
    # rollouts the killed bridge had not consumed, whole groups, none of the first's groups.
    assert len(replacement.samples) == owners[second]
    first_groups = {group_number(g) for g, o, _ in rows.values() if o == first}
    assert not first_groups & set(_by_group(replacement.samples))
    assert all(n == size for n in _by_group(replacement.samples).values())
    print(f"\nconsumed before the kill: {owners[first]}, after: {owners[second]}")


async def _until(probe, done, message: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not done(await probe()):
        assert time.monotonic() < deadline, message
        await asyncio.sleep(0.2)


async def test_partial_groups_at_the_deadline_and_late_members(
    gateway, vllm_server, tiny_model_dir, database_url
):
    run = uuid.uuid4().hex
    task = _toy(gateway, vllm_server, tiny_model_dir, run)
    trains = Drain(RolloutSource(_config(database_url, run, group_deadline_s=1.0,
                                         match={"run": run, "mode": "train"})))
    drops = Drain(RolloutSource(_config(database_url, run, group_deadline_s=1.0,
                                        partial_groups="drop",
                                        match={"run": run, "mode": "drop"})))
    trains.start()
    drops.start()
    try:
        task.metadata["mode"] = "train"
        await asyncio.to_thread(task.play_group, f"{run}-train", 3)
        task.metadata["mode"] = "drop"
        await asyncio.to_thread(task.play_group, f"{run}-drop", 2)
        await _wait_all_consumed(database_url, run, 5)
        task.metadata["mode"] = "train"
        await asyncio.to_thread(task.play_group, f"{run}-train", 1)  # late for its group
        await _wait_all_consumed(database_url, run, 6)
    finally:
        trains.stop()
        drops.stop()
        task.close()
    assert _by_group(trains.samples) == {group_number(f"{run}-train"): 3}
    assert drops.samples == []
    assert trains.source.stats["partial_groups"] == 1
    assert trains.source.stats["dropped_rollouts"] == 1  # the late one
    assert drops.source.stats["dropped_groups"] == 1
    assert drops.source.stats["dropped_rollouts"] == 2
    metrics = _metrics(trains)
    assert any(m.get("rollout/partial_groups_total") == 1.0 for m in metrics)
    assert any(m.get("rollout/late_rollouts_total") == 1.0 for m in metrics)


def _metrics(drain: Drain) -> list[dict]:
    out = []
    while not drain.source.metrics_queue.empty():
        out.append(drain.source.metrics_queue.get())
    return out


async def _listeners(conn) -> int:
    return await conn.fetchval(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND query LIKE 'LISTEN%'")


async def test_notify_wakes_the_source_and_polling_covers_a_lost_listener(
    gateway, vllm_server, tiny_model_dir, database_url
):
    run = uuid.uuid4().hex
    task = _toy(gateway, vllm_server, tiny_model_dir, run)
    conn = await asyncpg.connect(database_url)
    before = await _listeners(conn)
    # Polls once an hour: only the NOTIFY can make it deliver within this test.
    deaf = Drain(RolloutSource(_config(database_url, run, num_generations=2,
                                       poll_interval_s=3600, match={"run": run, "n": 1})))
    deaf.start()
    try:
        await _until(lambda: _listeners(conn), lambda n: n > before, "the source never listened")
        task.metadata["n"] = 1
        await asyncio.to_thread(task.play_group, f"{run}-1", 2)
        await _wait_all_consumed(database_url, run, 2, timeout=60)
    finally:
        deaf.stop()
    assert len(deaf.samples) == 2

    polling = Drain(RolloutSource(_config(database_url, run, num_generations=2,
                                          match={"run": run, "n": 2})))
    polling.start()
    try:
        await _until(lambda: _listeners(conn), lambda n: n > before, "the source never listened")
        killed = await conn.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND query LIKE 'LISTEN%'")
        assert killed >= 1
        task.metadata["n"] = 2
        await asyncio.to_thread(task.play_group, f"{run}-2", 2)
        await _wait_all_consumed(database_url, run, 4, timeout=60)
        polling.source.check_health(60)  # losing the listener is not a failure
    finally:
        polling.stop()
        task.close()
        await conn.close()
    assert len(polling.samples) == 2


def test_check_health_raises_once_the_feeder_died():
    source = RolloutSource(SourceConfig("postgresql://postgres@127.0.0.1:1/nothing",
                                        num_generations=2, token_budget=64))
    with pytest.raises(RuntimeError, match="not running"):
        source.check_health(60)
    source.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                source.check_health(60)
            except RuntimeError as exc:
                assert "failed" in str(exc) and isinstance(exc.__cause__, OSError)
                break
            assert time.monotonic() < deadline, "the feeder did not die"
            time.sleep(0.1)
    finally:
        source.stop()
