"""The rollout source (the pure release policy is tested in tests/unit/bridge/test_release.py):
leases, releases, acknowledgements, retries and quarantine on Postgres; and exactly-once delivery of
rollouts recorded by the real gateway from the real vLLM, with two bridges on one database and
with a bridge killed mid-run and replaced. (The real trainer killed at every seam of a step is
in test_bridge_e2e.py.)"""

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

from core.store.db import open_pool
from core.store.tokens import IDS, LOGPROBS
from stack.toy_task import ToyTask
from tests.support.gateway import ADMIN_KEY
from tests.support.postgres import fresh_database
from tests.support.sequences import Seq
from trainer_bridge import deliveries
from trainer_bridge.release import SourceConfig, group_number
from trainer_bridge.source import RolloutSource
from trainer_bridge.worker import DELIVERY_KEY, VERSIONS_KEY

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


async def _rollouts(pool, group: str, n: int, match: dict, consumed: int = 0,
                    traces: list | None = None) -> list:
    """`n` finished, merged rollouts of one group, the first `consumed` already consumed (and
    released); each with the merged sequences `traces` (none by default)."""
    ids = [uuid.uuid4() for _ in range(n)]
    async with pool.acquire() as conn:
        await conn.executemany(
            "INSERT INTO rollouts (id, key_hash, group_id, metadata, status, reward, finished_at,"
            " merged_at, merge_stats, consumed_at, released_at)"
            " VALUES ($1, $2, $3, $4, 'finished', $6, now(), now(), '{}',"
            "         CASE WHEN $5 THEN now() END, CASE WHEN $5 THEN now() END)",
            [(i, os.urandom(16), group, match, k < consumed, float(k % 2))
             for k, i in enumerate(ids)],
        )
        await conn.executemany(
            "INSERT INTO traces (rollout_id, idx, input_ids, loss_mask, logprobs, versions,"
            " call_ids, cause, auxiliary, excluded)"
            " VALUES ($1, $2, $3, $4, $5, $6, '{}', 'root', false, false)",
            [(rid, idx, seq.input_ids.astype(IDS).tobytes(),
              seq.loss_mask.astype(np.uint8).tobytes(), seq.logprobs.astype(LOGPROBS).tobytes(),
              seq.versions.astype(IDS).tobytes())
             for rid in ids for idx, seq in enumerate(traces or [])],
        )
    return ids


def _trace(versions, n_context: int = 3) -> Seq:
    """A sequence: `n_context` context tokens, then one sampled token per entry of `versions`."""
    n = n_context + len(versions)
    mask = np.r_[np.zeros(n_context, np.uint8), np.ones(len(versions), np.uint8)]
    return Seq(np.arange(n, dtype=np.int32) + 5, mask,
               np.where(mask, -0.25, 0).astype(np.float32),
               np.r_[np.full(n_context, -1), versions].astype(np.int32))


async def test_a_claim_takes_the_whole_group_or_nothing(lease_pool):
    match = {"run": uuid.uuid4().hex}
    ids = await _rollouts(lease_pool, "g-all", 3, match)
    async with lease_pool.acquire() as holder, lease_pool.acquire() as other:
        async with holder.transaction():
            # Another bridge in the middle of delivering one of the rows.
            await holder.execute("SELECT 1 FROM rollouts WHERE id = $1 FOR UPDATE", ids[0])
            claim = deliveries.claim_group(other, "B", "g-all", match, 30)
            assert await asyncio.wait_for(claim, 10) is None  # skipped, not waited for
        claimed = await deliveries.claim_group(other, "B", "g-all", match, 30)
    assert sorted(r.id for r in claimed) == sorted(ids)
    assert all(r.delivery_attempts == 0 for r in claimed)


async def test_a_lease_runs_out_and_its_old_owner_changes_nothing(lease_pool):
    match = {"run": uuid.uuid4().hex}
    ids = await _rollouts(lease_pool, "g-lease", 2, match, traces=[_trace([1, 1])])
    entries = [(rid, 0, "trained") for rid in ids]
    async with lease_pool.acquire() as conn:
        assert len(await deliveries.claim_group(conn, "A", "g-lease", match, 1.0)) == 2
        [pending] = await deliveries.pending_groups(conn, match)
        assert pending.leased and pending.ready == 2
        assert await deliveries.claim_group(conn, "B", "g-lease", match, 30) is None
        deadline = time.monotonic() + 20
        while (await deliveries.pending_groups(conn, match))[0].leased:
            assert time.monotonic() < deadline, "the lease never ran out"
            await asyncio.sleep(0.2)
        claimed = await deliveries.claim_group(conn, "B", "g-lease", match, 30)
        assert [r.delivery_attempts for r in claimed] == [0, 0]
        with pytest.raises(deliveries.LeaseLost):
            await deliveries.release_group(conn, "A", dict.fromkeys(ids, 0.5), [], [])
        await deliveries.release_group(conn, "B", dict.fromkeys(ids, 0.5), [], [])
        assert await deliveries.renew(conn, "A", ids, 30) == set()
        assert await deliveries.renew(conn, "B", ids, 30) == set(ids)
        # A trained them after all (its lease ran out mid-step): logged as such, not consumed.
        assert await deliveries.acknowledge(conn, "A", 3, entries) == set(ids)
        assert await deliveries.acknowledge(conn, "B", 1, entries) == set()
        assert await deliveries.acknowledge(conn, "B", 1, entries) == set(ids)  # a retry: no row
        rows = await conn.fetch("SELECT lease_owner, consumed_at, advantage FROM rollouts"
                                " WHERE id = ANY($1)", ids)
        assert all(r["lease_owner"] == "B" and r["consumed_at"] and r["advantage"] == 0.5
                   for r in rows)
        log = await conn.fetch("SELECT owner, step, leased FROM deliveries WHERE rollout_id ="
                               " ANY($1) ORDER BY id", ids)
        assert [tuple(r) for r in log] == [("A", 3, False)] * 2 + [("B", 1, True)] * 2
        assert await deliveries.pending_groups(conn, match) == []


async def test_a_rollout_is_consumed_once_every_trace_is_delivered(lease_pool):
    match = {"run": uuid.uuid4().hex}
    [rid] = await _rollouts(lease_pool, "g-traces", 1, match,
                            traces=[_trace([1, 1]), _trace([1]), _trace([2])])
    async with lease_pool.acquire() as conn:
        await deliveries.claim_group(conn, "A", "g-traces", match, 30)
        await deliveries.release_group(conn, "A", {rid: 0.0}, [], [(rid, 2, "too_long")])
        assert len((await deliveries.undelivered_traces(conn, [rid]))[rid]) == 2
        await deliveries.acknowledge(conn, "A", 1, [(rid, 0, "trained")])
        assert not await conn.fetchval("SELECT consumed_at FROM rollouts WHERE id = $1", rid)
        [(idx, _)] = (await deliveries.undelivered_traces(conn, [rid]))[rid]
        assert idx == 1
        await deliveries.acknowledge(conn, "A", 2, [(rid, 1, "stale")])
        assert await conn.fetchval("SELECT consumed_at FROM rollouts WHERE id = $1", rid)


async def test_a_consumed_rollout_records_what_it_gave_the_trainer(lease_pool):
    match = {"run": uuid.uuid4().hex}
    traces = [_trace([1, 1, 1]), _trace([1, 1]), _trace([2] * 40)]
    rid, other = await _rollouts(lease_pool, "g-ledger", 2, match, traces=traces)
    stats = {"trained_tokens": 45, "excluded_by_cause": {"auxiliary": 7, "constrained": 2}}
    Entry = deliveries.Entry
    async with lease_pool.acquire() as conn:
        await conn.execute("UPDATE rollouts SET merge_stats = $1", stats)  # also the older rows
        await deliveries.claim_group(conn, "A", "g-ledger", match, 30)
        await deliveries.release_group(conn, "A", {rid: 0.5}, [other],
                                       [Entry(rid, 2, "too_long", 0, 40)])
        # The dropped member is consumed at once: all it could have trained is "dropped".
        dropped = (await deliveries.ledgers(conn, [other]))[other]
        assert dropped["trained_tokens"] == 0 and dropped["excluded_tokens"]["dropped"] == 45
        assert dropped["reason"].startswith("trained nothing: 45 sampled tokens excluded as "
                                            "dropped")
        await deliveries.acknowledge(conn, "A", 1, [Entry(rid, 0, "trained", 2, 1)])
        assert await deliveries.ledgers(conn, [rid]) == {}  # not consumed yet
        await deliveries.acknowledge(conn, "A", 2, [Entry(rid, 1, "stale", 0, 2)])
        ledger = (await deliveries.ledgers(conn, [rid]))[rid]
    assert ledger["trained_tokens"] == 2 and ledger["reason"] is None
    assert {k: v for k, v in ledger["excluded_tokens"].items() if v} == {
        "auxiliary": 7, "constrained": 2, "too_long": 40, "stale": 3}


async def test_a_released_claim_is_free_at_once(lease_pool):
    match = {"run": uuid.uuid4().hex}
    ids = await _rollouts(lease_pool, "g-release", 2, match)
    async with lease_pool.acquire() as conn:
        await deliveries.claim_group(conn, "A", "g-release", match, 600)
        await deliveries.release(conn, "A", ids)
        assert len(await deliveries.claim_group(conn, "B", "g-release", match, 600)) == 2


async def test_pending_groups_know_late_members_and_filter_on_metadata(lease_pool):
    match = {"run": uuid.uuid4().hex}
    await _rollouts(lease_pool, "g-late", 3, match, consumed=2)
    await _rollouts(lease_pool, "g-new", 2, match)
    await _rollouts(lease_pool, "g-other", 2, {"run": "another run"})
    async with lease_pool.acquire() as conn:
        pending = {r.group_key: r for r in await deliveries.pending_groups(conn, match)}
    assert set(pending) == {"g-late", "g-new"}
    assert pending["g-late"].released and pending["g-late"].ready == 1
    assert not pending["g-new"].released and pending["g-new"].ready == 2


class Drain:
    """A trainer's side of a source: takes every sample off its queue and, like an optimizer
    step of one sample, acknowledges it."""

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
                sample = self.source.rollout_buffer.get(timeout=0.1)
            except queue.Empty:
                continue
            self.samples.append(sample)
            self.source.acknowledge(len(self.samples), [int(sample.metrics[DELIVERY_KEY])])

    def stop(self):
        self._stop.set()
        self._thread.join()
        self.source.stop()


async def _delivery_log(conn, match: dict) -> Counter:
    """(rollout id, trace index, outcome) -> times logged, for the rollouts matching `match`."""
    rows = await conn.fetch(
        "SELECT d.rollout_id, d.idx, d.outcome FROM deliveries d JOIN rollouts r"
        " ON r.id = d.rollout_id WHERE r.metadata @> $1", match)
    return Counter((r["rollout_id"], r["idx"], r["outcome"]) for r in rows)


def _db_config(database_url, match, **overrides) -> SourceConfig:
    return SourceConfig(**{"database_url": database_url, "num_generations": 2,
                           "token_budget": 64, "poll_interval_s": 0.2, "match": match,
                           "max_staleness": 10**6, **overrides})


async def _until_db(pool, probe, message: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while True:
        async with pool.acquire() as conn:
            if await probe(conn):
                return
        assert time.monotonic() < deadline, message
        await asyncio.sleep(0.2)


async def test_a_group_that_always_fails_is_quarantined_and_the_rest_flows(
    lease_pool, lease_database
):
    match = {"run": uuid.uuid4().hex}
    broken = _trace([1, 1])
    broken.versions[-1] = -1  # a trained token without a policy version: cannot be a sample
    bad = await _rollouts(lease_pool, "g-broken", 2, match, traces=[broken])
    good = await _rollouts(lease_pool, "g-fine", 2, match, traces=[_trace([1, 2])])
    drain = Drain(RolloutSource(_db_config(lease_database, match, max_attempts=3))).start()
    try:
        await _until_db(lease_pool, lambda c: c.fetchval(
            "SELECT bool_and(quarantined_at IS NOT NULL) FROM rollouts WHERE id = ANY($1)", bad),
            "the broken group was never quarantined")
        await _until_db(lease_pool, lambda c: c.fetchval(
            "SELECT bool_and(consumed_at IS NOT NULL) FROM rollouts WHERE id = ANY($1)", good),
            "the good group was not delivered")
    finally:
        drain.stop()
    stats = drain.source.stats
    assert stats["quarantined_groups"] == 1 and stats["failed_claims"] == 3
    assert len(drain.samples) == 2
    async with lease_pool.acquire() as conn:
        assert await conn.fetchval(
            "SELECT max(delivery_attempts) FROM rollouts WHERE id = ANY($1)", bad) == 3
        assert sum((await _delivery_log(conn, match)).values()) == 2


async def test_database_errors_are_retried_and_the_feeder_lives_on(lease_pool, lease_database):
    match = {"run": uuid.uuid4().hex}
    name = f"bridge-{match['run'][:8]}"
    source = RolloutSource(_db_config(f"{lease_database}?application_name={name}", match))
    drain = Drain(source).start()
    first = await _rollouts(lease_pool, "g-before", 2, match, traces=[_trace([1, 1])])
    try:
        await _until_db(lease_pool, lambda c: c.fetchval(
            "SELECT bool_and(consumed_at IS NOT NULL) FROM rollouts WHERE id = ANY($1)", first),
            "nothing delivered")
        async with lease_pool.acquire() as conn:  # the source's connections die under it
            killed = await conn.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name = $1", name)
        assert killed >= 1
        then = await _rollouts(lease_pool, "g-after", 2, match, traces=[_trace([1, 1])])
        await _until_db(lease_pool, lambda c: c.fetchval(
            "SELECT bool_and(consumed_at IS NOT NULL) FROM rollouts WHERE id = ANY($1)", then),
            "nothing delivered after the connections died")
        source.check_health(60)
    finally:
        drain.stop()
    assert len(drain.samples) == 4
    async with lease_pool.acquire() as conn:
        log = await _delivery_log(conn, match)
    assert sorted(log.values()) == [1, 1, 1, 1]


async def test_a_rollout_spanning_many_syncs_trains_its_fresh_tokens(lease_pool, lease_database):
    """Twelve sampled tokens from versions 1..12, taken by a trainer at version 12 that allows
    4 versions of staleness: TRL's own queue reader keeps the sample, the stale tokens are out of
    its mask, the fresh ones in."""
    from trl.experimental.async_grpo.async_grpo_trainer import RolloutQueueDataset

    match = {"run": uuid.uuid4().hex}
    versions = np.arange(1, 13)
    [rid] = await _rollouts(lease_pool, "g-long", 1, match, traces=[_trace(versions)])
    source = RolloutSource(_db_config(lease_database, match, num_generations=1, max_staleness=4))
    source.update_model_version(12)
    source.start()
    metrics = defaultdict(list)
    reader = RolloutQueueDataset(source.rollout_buffer, lambda: 12, source.check_health, 60,
                                 metrics, max_staleness=4, poll_interval_s=0.5)
    try:
        taken = next(iter(reader))
        source.acknowledge(1, [int(taken["metrics"].pop(DELIVERY_KEY))])
    finally:
        source.stop()
    trained = taken["completion_mask"].astype(bool)
    np.testing.assert_array_equal(trained[3:], versions >= 8)
    assert not trained[:3].any() and not metrics["sample/dropped_stale_total"]
    assert np.all(taken["old_log_probs"][3:][versions < 8] == 0)
    # Each token's version rides to the collator (the agreement over the trainer's own version).
    np.testing.assert_array_equal(taken["metrics"][VERSIONS_KEY][3:], versions)
    assert source.stats["stale_tokens"] == 7 and source.stats["trained_samples"] == 1
    async with lease_pool.acquire() as conn:
        assert await _delivery_log(conn, match) == Counter({(rid, 0, "trained"): 1})


async def test_a_sample_with_no_fresh_token_left_is_put_aside(lease_pool, lease_database):
    match = {"run": uuid.uuid4().hex}
    [rid] = await _rollouts(lease_pool, "g-stale", 1, match, traces=[_trace([1, 2])])
    source = RolloutSource(_db_config(lease_database, match, num_generations=1, max_staleness=2))
    source.update_model_version(10)
    source.start()
    try:
        with pytest.raises(queue.Empty):
            source.rollout_buffer.get(timeout=3)
        source.acknowledge(1, [])
    finally:
        source.stop()
    async with lease_pool.acquire() as conn:
        assert await _delivery_log(conn, match) == Counter({(rid, 0, "stale"): 1})
        assert await conn.fetchval("SELECT consumed_at FROM rollouts WHERE id = $1", rid)


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
    conn = await asyncpg.connect(database_url)
    try:
        log = await conn.fetch(
            "SELECT d.rollout_id, d.owner, d.outcome FROM deliveries d JOIN rollouts r"
            " ON r.id = d.rollout_id WHERE r.metadata @> jsonb_build_object('run', $1::text)",
            run)
    finally:
        await conn.close()
    # Each toy rollout is one trainable sequence: the log holds each exactly once, trained by
    # the killed bridge or by its replacement, and the replacement trained exactly the ones the
    # killed bridge had not acknowledged.
    assert sorted(Counter(r["rollout_id"] for r in log).values()) == [1] * (groups * size)
    assert set(rows) == {r["rollout_id"] for r in log}
    owners = Counter(r["owner"] for r in log)
    assert set(owners) == {first, second} and {r["outcome"] for r in log} == {"trained"}
    assert len(replacement.samples) == owners[second]
    print(f"\ntrained before the kill: {owners[first]}, after: {owners[second]}")


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
    # Connection refused, again and again: retried for db_give_up_s, then the feeder fails.
    source = RolloutSource(SourceConfig("postgresql://postgres@127.0.0.1:1/nothing",
                                        num_generations=2, token_budget=64, db_give_up_s=1.0))
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


async def test_a_resume_takes_back_the_steps_after_its_checkpoint(lease_pool):
    """Steps A logged after its checkpoint's step 1 go back to the queue, with their leases
    still A's (a claim takes them at once, counting no fault); steps of bridges the checkpoint
    does not know, and A's release-time entries, stay."""
    match = {"run": uuid.uuid4().hex}
    # Bridge names are unique (host, pid, random), and a revert is by name: so are these.
    a, b, c = (f"{name}-{match['run'][:8]}" for name in "ABC")
    first = await _rollouts(lease_pool, "g-first", 2, match, traces=[_trace([1, 1])])
    later = await _rollouts(lease_pool, "g-later", 2, match, traces=[_trace([1, 1])])
    other = await _rollouts(lease_pool, "g-other", 1, match, traces=[_trace([1, 1])])
    async with lease_pool.acquire() as conn:
        for group, owner, ids in (("g-first", a, first), ("g-later", a, later),
                                  ("g-other", b, other)):
            await deliveries.claim_group(conn, owner, group, match, 60)
            await deliveries.release_group(conn, owner, dict.fromkeys(ids, 0.5), [], [])
        await deliveries.acknowledge(conn, a, 1, [(rid, 0, "trained") for rid in first])
        await deliveries.acknowledge(conn, a, 2, [(rid, 0, "trained") for rid in later])
        await deliveries.acknowledge(conn, b, 7, [(rid, 0, "trained") for rid in other])
        assert sorted(await deliveries.revert_steps_after(conn, {a: 1})) == sorted(later)
        assert await deliveries.revert_steps_after(conn, {a: 1}) == []  # idempotent
        assert await _delivery_log(conn, match) == Counter(
            (rid, 0, "trained") for rid in [*first, *other])
        rows = await conn.fetch("SELECT id, consumed_at IS NULL AS queued, lease_owner, advantage"
                                " FROM rollouts WHERE id = ANY($1)", [*first, *later, *other])
        assert {r["id"] for r in rows if r["queued"]} == set(later)
        [pending] = await deliveries.pending_groups(conn, match)
        assert pending.group_key == "g-later" and not pending.leased
        claimed = await deliveries.claim_group(conn, c, "g-later", match, 60)
    assert sorted(r.id for r in claimed) == sorted(later)
    assert [r.delivery_attempts for r in claimed] == [0, 0]
    assert [r.advantage for r in claimed] == [0.5, 0.5]  # trained again with the same numbers


async def test_a_group_the_trainer_fails_on_counts_a_fault_and_is_given_back(
    lease_pool, lease_database
):
    match = {"run": uuid.uuid4().hex}
    ids = await _rollouts(lease_pool, "g-untrainable", 2, match, traces=[_trace([1, 1])])
    source = RolloutSource(_db_config(lease_database, match))
    source.start()
    try:
        samples = [await asyncio.to_thread(source.rollout_buffer.get, timeout=60)
                   for _ in ids]
        await asyncio.to_thread(source.fault, [int(s.metrics[DELIVERY_KEY]) for s in samples])
    finally:
        await asyncio.to_thread(source.stop)
    async with lease_pool.acquire() as conn:
        rows = await conn.fetch("SELECT delivery_attempts, lease_owner, consumed_at"
                                " FROM rollouts WHERE id = ANY($1)", ids)
    assert [tuple(r) for r in rows] == [(1, None, None)] * 2
