"""The `rollouts` and `policy` tables."""

from __future__ import annotations

from typing import TYPE_CHECKING
from uuid import UUID

import asyncpg

if TYPE_CHECKING:
    from core.store.conn import Conn


def identity(row) -> dict:
    """What names a rollout and its outcome, as every listing, summary and export shows it."""
    return {
        "rollout_id": str(row["id"]),
        "task_id": row["task_id"],
        "group_id": row["group_id"],
        "harness": row["harness"],
        "status": row["status"],
        "reward": row["reward"],
    }


async def backlog(conn: Conn, run_id: str) -> tuple[int, int]:
    """(running, waiting) rollouts of a runner's run: waiting ones ended, and no trainer bridge
    has taken them yet (released their group to its trainer, consumed or put them aside)."""
    row = await conn.fetchrow(
        "SELECT count(*) FILTER (WHERE status = 'running') AS running,"
        " count(*) FILTER (WHERE status <> 'running' AND released_at IS NULL"
        "                  AND consumed_at IS NULL AND quarantined_at IS NULL) AS waiting"
        " FROM rollouts WHERE metadata @> jsonb_build_object('run_id', $1::text)",
        run_id,
    )
    assert row is not None  # an aggregate without GROUP BY returns one row
    return row["running"], row["waiting"]


async def create(
    conn: Conn,
    rollout_id: UUID,
    key_hash: bytes,
    task_id: str | None,
    group_id: str | None,
    metadata: dict,
    timeout_s: float | None,
    side_calls: str = "auto",
) -> None:
    await conn.execute(
        "INSERT INTO rollouts (id, key_hash, task_id, group_id, metadata, deadline, side_calls)"
        " VALUES ($1, $2, $3, $4, $5,"
        "         CASE WHEN $6::float8 IS NULL THEN NULL"
        "              ELSE now() + make_interval(secs => $6::float8) END, $7)",
        rollout_id,
        key_hash,
        task_id,
        group_id,
        metadata,
        timeout_s,
        side_calls,
    )


async def by_key_hash(conn: Conn, key_hash: bytes) -> asyncpg.Record | None:
    """id, status and `left`: seconds to the deadline by the database's clock (None: none)."""
    return await conn.fetchrow(
        "SELECT id, status, extract(epoch FROM deadline - now())::float8 AS left"
        " FROM rollouts WHERE key_hash = $1",
        key_hash,
    )


async def get(conn: Conn, rollout_id: UUID) -> asyncpg.Record | None:
    return await conn.fetchrow(
        "SELECT id, task_id, group_id, metadata, status, reward, metrics, call_count,"
        " created_at, deadline, finished_at, harness, merge_stats, merge_options, merged_at,"
        " merge_error, side_calls, ledger, consumed_at"
        " FROM rollouts WHERE id = $1",
        rollout_id,
    )


# A rollout ended through the admin API (the payload is its id). Rollouts
# past their deadline are not announced: no gateway trusts a key past its rollout's deadline.
ENDED_CHANNEL = "rolltap_rollout_ended"


async def finish(
    conn: Conn,
    rollout_id: UUID,
    status: str,
    reward: float | None,
    metrics: dict | None,
) -> bool:
    """Ends a running rollout; False when it was not running (already ended or unknown). Every
    listening gateway is told when it commits (`ENDED_CHANNEL`): its key stops working there."""
    done = await conn.fetchval(
        "WITH u AS (UPDATE rollouts SET status = $2, reward = $3, metrics = $4,"
        " finished_at = now() WHERE id = $1 AND status = 'running' RETURNING id)"
        f" SELECT true FROM u, pg_notify('{ENDED_CHANNEL}', u.id::text)",
        rollout_id,
        status,
        reward,
        metrics,
    )
    return bool(done)


async def expire_overdue(conn: Conn) -> list[UUID]:
    """Ends every running rollout past its deadline as `timeout` (unscorable)."""
    rows = await conn.fetch(
        "UPDATE rollouts SET status = 'timeout', finished_at = now()"
        " WHERE status = 'running' AND deadline < now() RETURNING id"
    )
    return [r["id"] for r in rows]


async def policy_version(conn: Conn) -> int:
    version = await conn.fetchval("SELECT version FROM policy")
    assert version is not None  # the migrations insert the policy's one row
    return version


# Every gateway LISTENs here and stamps the payload (the new version) from then on.
POLICY_CHANNEL = "rolltap_policy"


async def set_policy_version(conn: Conn, version: int) -> None:
    """Stores the version and notifies every listening gateway when it commits."""
    await conn.execute(
        "WITH u AS (UPDATE policy SET version = $1, updated_at = now() RETURNING version)"
        f" SELECT pg_notify('{POLICY_CHANNEL}', version::text) FROM u",
        version,
    )


async def count_by_status(conn: Conn) -> list[asyncpg.Record]:
    return await conn.fetch("SELECT status, count(*) AS count FROM rollouts GROUP BY status")


async def ledger_totals(conn: Conn) -> list[tuple[str | None, int]]:
    """Tokens of consumed rollouts (core/store/ledger.py): (None, trained) and (cause,
    excluded) for each cause any ledger names."""
    rows = await conn.fetch(
        "SELECT NULL AS cause, coalesce(sum((ledger->>'trained_tokens')::bigint), 0) AS tokens"
        " FROM rollouts WHERE ledger IS NOT NULL"
        " UNION ALL"
        " SELECT e.key, sum(e.value::bigint) FROM rollouts,"
        " jsonb_each_text(ledger->'excluded_tokens') AS e WHERE ledger IS NOT NULL GROUP BY 1"
    )
    return [(r["cause"], int(r["tokens"])) for r in rows]
