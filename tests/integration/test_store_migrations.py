"""Schema migrations on a real Postgres: an upgrade keeps every stored value, and the recorder's
INSERT numbers a rollout's calls and refuses calls of an ended rollout."""

from __future__ import annotations

import asyncio
import os
import uuid
from datetime import UTC, datetime

import asyncpg
import numpy as np
import pytest

from core.store import calls as calls_store
from core.store import migrations
from core.store.db import init_connection
from tests.support.postgres import fresh_database


@pytest.fixture
def dsn():
    url, drop = fresh_database("rolltap_migrations")
    yield url
    drop()


def _call(rollout_id: uuid.UUID, prompt: np.ndarray) -> calls_store.CallRecord:
    return calls_store.CallRecord(
        id=uuid.uuid4(), rollout_id=rollout_id, protocol="chat", status="ok",
        started_at=datetime.now(UTC), base_id=None, prefix_len=0, prompt_len=prompt.size,
        prompt_delta=prompt.tobytes(), completion_ids=prompt[:8].tobytes(),
        logprobs=np.zeros(8, "<f4").tobytes(), versions=np.zeros(8, "<i4").tobytes(),
        finish_reason="stop", offered_tools=False, model="m", requested={"temperature": 0.5},
        applied={}, request_body=os.urandom(5000), response_body=os.urandom(3000),
        upstream="u", latency_ms=1.0, ttft_ms=None, error=None, user_agent=None,
    )  # fmt: skip


def _prompt(tokens: int, seed: int) -> np.ndarray:
    # Compressible, as token ids are: few distinct ids, each under 2^18.
    vocab = np.random.default_rng(seed).integers(0, 150_000, 300)
    return vocab[np.random.default_rng(seed + 1).integers(0, 300, tokens)].astype("<i4")


async def _rollout(conn, status: str = "running") -> uuid.UUID:
    # Not the store's create: these rows are written under older schemas too.
    rid = uuid.uuid4()
    await conn.execute(
        "INSERT INTO rollouts (id, key_hash, task_id, group_id, status)"
        " VALUES ($1, $2, 't', 'g', $3)",
        rid, os.urandom(16), status,
    )
    return rid


def test_an_upgrade_keeps_stored_calls_and_refuses_late_ones(dsn, monkeypatch):
    async def scenario():
        conn = await asyncpg.connect(dsn)
        await init_connection(conn)
        try:
            # The schema before this change, with a call stored under it (pglz, trigger).
            with monkeypatch.context() as m:
                m.setattr(migrations, "MIGRATIONS", migrations.MIGRATIONS[:6])
                assert await migrations.migrate(conn) == 6
            old_rollout = await _rollout(conn)
            old = _call(old_rollout, _prompt(32768, 1))
            listed = calls_store.INSERT.split("INSERT INTO calls (")[1].split(")")[0]
            columns = [c.strip() for c in listed.split(",")]
            values = dict(zip(  # the last two arguments are the limits, not columns
                [c for c in columns if c != "seq"], calls_store.insert_args(old)[:-2], strict=True
            ))  # fmt: skip
            await conn.execute(
                f"INSERT INTO calls ({', '.join(values)}, seq)"
                f" VALUES ({', '.join(f'${i + 1}' for i in range(len(values)))}, 1)",
                *values.values(),
            )
            before = dict(await conn.fetchrow("SELECT * FROM calls WHERE id = $1", old.id))

            assert await migrations.migrate(conn) == migrations.MIGRATIONS[-1][0]
            assert await migrations.migrate(conn) == migrations.MIGRATIONS[-1][0]  # idempotent
            after = dict(await conn.fetchrow("SELECT * FROM calls WHERE id = $1", old.id))
            assert after == before
            assert after["prompt_delta"] == old.prompt_delta

            # Recorded the new way: numbered after the rollout's earlier calls, read back whole.
            await conn.execute("UPDATE rollouts SET call_count = 1 WHERE id = $1", old_rollout)
            new = [_call(old_rollout, _prompt(8192, 2 + i)) for i in range(2)]
            await conn.executemany(calls_store.INSERT, [calls_store.insert_args(r) for r in new])
            rows = await conn.fetch(
                "SELECT id, seq, prompt_delta, request_body,"
                " pg_column_compression(prompt_delta) AS method"
                " FROM calls WHERE rollout_id = $1 ORDER BY seq",
                old_rollout,
            )
            assert [r["id"] for r in rows] == [old.id, new[0].id, new[1].id]
            assert [r["seq"] for r in rows] == [1, 2, 3]
            assert [r["prompt_delta"] for r in rows[1:]] == [r.prompt_delta for r in new]
            assert [r["request_body"] for r in rows[1:]] == [r.request_body for r in new]
            assert rows[0]["method"] == "pglz"
            lz4 = await conn.fetchval(
                "SELECT attcompression = 'l' FROM pg_attribute"
                " WHERE attrelid = 'calls'::regclass AND attname = 'prompt_delta'"
            )
            assert rows[1]["method"] == ("lz4" if lz4 else "pglz")

            # A call of an ended rollout is refused, and nothing of it is kept.
            for status in ("finished", "failed", "timeout"):
                ended = await _rollout(conn, status)
                late = _call(ended, _prompt(64, 9))
                with pytest.raises(asyncpg.PostgresError, match="has ended") as refused:
                    await conn.execute(calls_store.INSERT, *calls_store.insert_args(late))
                assert refused.value.sqlstate == "RT409"
                assert await conn.fetchval(
                    "SELECT call_count FROM rollouts WHERE id = $1", ended
                ) == 0
                assert not await conn.fetchval("SELECT count(*) FROM calls WHERE id = $1", late.id)
        finally:
            await conn.close()

    asyncio.run(scenario())


def test_a_schema_newer_than_this_rolltap_is_refused(dsn):
    """An older gateway must not record into a schema whose rules it does not apply."""
    async def scenario():
        conn = await asyncpg.connect(dsn)
        try:
            newest = await migrations.migrate(conn)
            await conn.execute("INSERT INTO schema_migrations (version) VALUES ($1)", newest + 1)
            with pytest.raises(migrations.SchemaTooNew, match=f"version {newest + 1}, newer"):
                await migrations.migrate(conn)
        finally:
            await conn.close()

    asyncio.run(scenario())


def test_a_rollout_past_its_limits_has_its_calls_refused(dsn):
    """Issue #28: each rollout's calls and stored body bytes are bounded in the INSERT itself
    (whichever gateway records), and a refused call changes nothing."""
    async def scenario():
        conn = await asyncpg.connect(dsn)
        await init_connection(conn)
        try:
            await migrations.migrate(conn)
            counted = await _rollout(conn)
            limits = calls_store.Limits(calls=2, stored_bytes=1 << 30)
            for i in range(2):
                await conn.execute(calls_store.INSERT,
                                   *calls_store.insert_args(_call(counted, _prompt(8, i)), limits))
            with pytest.raises(asyncpg.PostgresError, match="limit of calls") as refused:
                await conn.execute(calls_store.INSERT,
                                   *calls_store.insert_args(_call(counted, _prompt(8, 3)), limits))
            assert refused.value.sqlstate == "RT413"
            assert await conn.fetchval("SELECT call_count FROM rollouts WHERE id = $1",
                                       counted) == 2

            stored = await _rollout(conn)
            one = _call(stored, _prompt(8, 4))
            size = len(one.request_body) + len(one.response_body)
            limits = calls_store.Limits(calls=100, stored_bytes=size + size // 2)
            await conn.execute(calls_store.INSERT, *calls_store.insert_args(one, limits))
            with pytest.raises(asyncpg.PostgresError, match="storage quota") as refused:
                await conn.execute(calls_store.INSERT,
                                   *calls_store.insert_args(_call(stored, _prompt(8, 5)), limits))
            assert refused.value.sqlstate == "RT413"
            assert await conn.fetchval("SELECT stored_bytes FROM rollouts WHERE id = $1",
                                       stored) == size
        finally:
            await conn.close()

    asyncio.run(scenario())
