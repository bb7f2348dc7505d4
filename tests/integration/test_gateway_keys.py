"""Rollout keys on a real Postgres: a refused key (unknown, ended, past its deadline) sent again
costs no query (issue #28: an agent could make the database answer for every made-up key), and
a running rollout's key is still looked up and cached as before."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from core.store import rollouts as rollouts_store
from core.store.db import open_pool
from gateway.auth import RolloutKeys, hash_key, new_rollout_key
from gateway.protocols.errors import GatewayError


class CountingPool:
    """The real pool, counting the connections taken from it (one per key lookup)."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self.taken = 0

    def acquire(self, **kwargs):
        self.taken += 1
        return self.pool.acquire(**kwargs)


def _headers(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def _refused(keys: RolloutKeys, key: str) -> str:
    with pytest.raises(GatewayError) as info:
        await keys.rollout_for(_headers(key))
    assert info.value.status == 401
    return info.value.message


async def test_refused_keys_cost_one_query_each(database_url):
    pool = await open_pool(database_url, min_size=1, max_size=2)
    try:
        counting = CountingPool(pool)
        keys = RolloutKeys(counting)  # type: ignore[arg-type]
        running, ended, overdue = new_rollout_key(), new_rollout_key(), new_rollout_key()
        ids = {}
        async with pool.acquire() as conn:
            for name, key, timeout_s in (("running", running, None), ("ended", ended, None),
                                         ("overdue", overdue, 0.001)):
                ids[name] = uuid.uuid4()
                await rollouts_store.create(conn, ids[name], hash_key(key), None, None, {},
                                            timeout_s)
            await rollouts_store.finish(conn, ids["ended"], "finished", 1.0, {})
        await asyncio.sleep(0.01)

        unknown = new_rollout_key()
        messages = {k: await _refused(keys, k) for k in (unknown, ended, overdue)}
        assert counting.taken == 3
        assert "unknown API key" in messages[unknown]
        assert "has ended (finished)" in messages[ended]
        assert "past its deadline" in messages[overdue]
        for _ in range(20):
            for key, message in messages.items():
                assert await _refused(keys, key) == message
        assert counting.taken == 3

        assert await keys.rollout_for(_headers(running)) == ids["running"]
        assert await keys.rollout_for(_headers(running)) == ids["running"]
        assert counting.taken == 4
    finally:
        await pool.close()


async def test_a_flood_of_made_up_keys_keeps_a_bounded_memory(database_url, monkeypatch):
    monkeypatch.setattr("gateway.auth.REFUSALS_KEPT", 50)
    pool = await open_pool(database_url, min_size=1, max_size=2)
    try:
        counting = CountingPool(pool)
        keys = RolloutKeys(counting)  # type: ignore[arg-type]
        flood = [new_rollout_key() for _ in range(120)]
        for key in flood:
            await _refused(keys, key)
        assert counting.taken == 120
        # the newest 50 are remembered; the oldest were pushed out and cost a query again
        for key in flood[-50:]:
            await _refused(keys, key)
        assert counting.taken == 120
        await _refused(keys, flood[0])
        assert counting.taken == 121
    finally:
        await pool.close()
