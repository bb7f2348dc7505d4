"""Trainer-bridge work claims on `rollouts`: which finished rollouts wait for a bridge, leases on
a group's rollouts, and marking them consumed exactly once.

A rollout is deliverable once its traces are stored (`merged_at`) and until a bridge consumed it
(`consumed_at`). A bridge claims a whole group at a time: it locks the group's deliverable rows
(`FOR UPDATE SKIP LOCKED`, so bridges never wait on each other) and leases them to itself until
`lease_until`. A bridge that dies holding a lease loses it when the lease runs out; another one
then claims the group. Consuming is guarded by the lease owner inside the caller's transaction,
so a bridge whose lease was taken over cannot consume the same rollouts a second time. After
consumption `lease_owner` keeps the name of the bridge that consumed the rollout.

A group is keyed by `group_id`; a rollout without one is a group of its own, keyed by its id.
"""

from __future__ import annotations

from uuid import UUID

import asyncpg

from gateway.store.traces import StoredTrace

_GROUP_KEY = "coalesce(group_id, id::text)"
_IN_GROUP = "(group_id = $1 OR (group_id IS NULL AND id::text = $1))"
_DELIVERABLE = "merged_at IS NOT NULL AND consumed_at IS NULL AND metadata @> $2"


class LeaseLost(RuntimeError):
    """The rollouts are no longer leased to this bridge: another bridge took them over."""


async def pending_groups(conn: asyncpg.Connection, match: dict) -> list[asyncpg.Record]:
    """Groups with deliverable rollouts whose metadata contains `match`, oldest first.

    Per group: `group_key`, `ready` (deliverable rollouts), `waited_s` (seconds since the first
    of them was merged), `leased` (some bridge holds a live lease on one), `released` (a member
    was consumed before: the rest are late for a group already trained or dropped).
    """
    return await conn.fetch(
        f"""
        SELECT {_GROUP_KEY} AS group_key, count(*) AS ready,
               extract(epoch FROM now() - min(merged_at))::float8 AS waited_s,
               coalesce(bool_or(lease_until > now()), false) AS leased,
               bool_or(group_id IS NOT NULL AND EXISTS (
                   SELECT 1 FROM rollouts done
                   WHERE done.group_id = rollouts.group_id AND done.consumed_at IS NOT NULL
               )) AS released
        FROM rollouts
        WHERE merged_at IS NOT NULL AND consumed_at IS NULL AND metadata @> $1
        GROUP BY 1
        ORDER BY min(merged_at)
        """,
        match,
    )


async def claim_group(
    conn: asyncpg.Connection, owner: str, group_key: str, match: dict, lease_s: float
) -> list[asyncpg.Record] | None:
    """Lease every deliverable rollout of a group to `owner`, or none of them.

    Returns the claimed rows (id, group_id, task_id, status, reward, finished_at, merge_stats),
    or None when another bridge is on the group: one of its rows is locked by a concurrent
    transaction or under someone's live lease. A group is never split between bridges, since its
    advantages need all its rewards.
    """
    async with conn.transaction():
        rows = await conn.fetch(
            "SELECT id, group_id, task_id, status, reward, finished_at, merge_stats,"
            " lease_until > now() AS live_lease"
            f" FROM rollouts WHERE {_IN_GROUP} AND {_DELIVERABLE}"
            " ORDER BY id FOR UPDATE SKIP LOCKED",
            group_key,
            match,
        )
        total = await conn.fetchval(
            f"SELECT count(*) FROM rollouts WHERE {_IN_GROUP} AND {_DELIVERABLE}",
            group_key,
            match,
        )
        if not rows or len(rows) != total or any(r["live_lease"] for r in rows):
            return None
        await conn.execute(
            "UPDATE rollouts SET lease_owner = $1,"
            " lease_until = now() + make_interval(secs => $2::float8) WHERE id = ANY($3)",
            owner,
            lease_s,
            [r["id"] for r in rows],
        )
    return rows


async def group_traces(
    conn: asyncpg.Connection, rollout_ids: list[UUID]
) -> dict[UUID, list[StoredTrace]]:
    """The trainable (not excluded) merged sequences of each rollout, in index order."""
    rows = await conn.fetch(
        "SELECT * FROM traces WHERE rollout_id = ANY($1) AND NOT excluded"
        " ORDER BY rollout_id, idx",
        rollout_ids,
    )
    traces: dict[UUID, list[StoredTrace]] = {rid: [] for rid in rollout_ids}
    for row in rows:
        traces[row["rollout_id"]].append(StoredTrace(row))
    return traces


async def consume(
    conn: asyncpg.Connection, owner: str, rollout_ids: list[UUID]
) -> dict[UUID, float]:
    """Mark rollouts leased to `owner` consumed; returns seconds from finish to now, per rollout.

    Run it inside a transaction and hand the samples over before that transaction commits: the
    updated rows stay locked until then, so no other bridge can take them in between. Raises
    LeaseLost (the caller rolls back) when any of them is no longer `owner`'s to consume.
    """
    rows = await conn.fetch(
        "UPDATE rollouts SET consumed_at = now(), lease_until = NULL"
        " WHERE id = ANY($2) AND lease_owner = $1 AND consumed_at IS NULL"
        " RETURNING id, extract(epoch FROM now() - finished_at)::float8 AS waited_s",
        owner,
        rollout_ids,
    )
    if len(rows) != len(set(rollout_ids)):
        raise LeaseLost(
            f"{len(set(rollout_ids)) - len(rows)} of {len(set(rollout_ids))} rollouts are no "
            f"longer leased to {owner}"
        )
    return {r["id"]: r["waited_s"] for r in rows}


async def release(conn: asyncpg.Connection, owner: str, rollout_ids: list[UUID]) -> None:
    """Give back a claim that will not be delivered, so another bridge need not wait it out."""
    await conn.execute(
        "UPDATE rollouts SET lease_owner = NULL, lease_until = NULL"
        " WHERE id = ANY($2) AND lease_owner = $1 AND consumed_at IS NULL",
        owner,
        rollout_ids,
    )
