"""The trainer bridge's bookkeeping in Postgres: which finished rollouts wait for a bridge, leases
on a group's rollouts, the one-time release of a group, and the delivery log that says which
trace an optimizer step took.

A rollout is deliverable once its traces are stored (`merged_at`), until it is consumed
(`consumed_at`) or quarantined (`quarantined_at`). A bridge claims a whole group at a time: it
locks the group's deliverable rows (`FOR UPDATE SKIP LOCKED`, so bridges never wait on each
other) and leases them to itself until `lease_until`. A bridge that dies holding a lease loses it
when the lease runs out; another one then claims the group. `delivery_attempts` counts the
group's own faults (it could not be built into samples, or the trainer failed on them), not its
claims: a lease lost because its bridge died says nothing about the group, so crashes alone never
quarantine it.

Releasing a group fixes its members' advantages (`released_at`, `advantage`) before any of its
samples reach a trainer; a later claim of the same rollouts (after a crash) trains the same
numbers, and members that arrive after the release are late. A trace counts as delivered only
once a row in `deliveries` says an optimizer step took it, written after that step; a rollout is
consumed when all its trainable traces are. Every write that concerns claimed rollouts is fenced
by the lease owner, so a bridge whose lease was taken over changes nothing of the new owner's.

A group is keyed by `group_id`; a rollout without one is a group of its own, keyed by its id.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Literal, NamedTuple
from uuid import UUID

import asyncpg
import msgspec

from core.store.ledger import account
from core.store.traces import StoredTrace

Outcome = Literal["trained", "stale", "too_long", "untrained"]


class Entry(NamedTuple):
    """One line of the delivery log: a trace, what became of it and, for the rollout's ledger,
    the tokens the step trained and those it left out (masked stale, or the whole trace put aside
    as stale or too long). Counts may be None where they are not known (zero)."""

    rollout_id: UUID
    idx: int
    outcome: Outcome
    trained_tokens: int | None = None
    excluded_tokens: int | None = None

_GROUP_KEY = "coalesce(group_id, id::text)"
_IN_GROUP = "(group_id = $1 OR (group_id IS NULL AND id::text = $1))"
_DELIVERABLE = (
    "merged_at IS NOT NULL AND consumed_at IS NULL AND quarantined_at IS NULL AND metadata @> $2"
)
# A trainable trace no delivery row covers yet.
_UNDELIVERED = (
    "NOT t.excluded AND NOT EXISTS ("
    "SELECT 1 FROM deliveries d WHERE d.rollout_id = t.rollout_id AND d.idx = t.idx)"
)

# Errors after which the same statement may well succeed: the connection or the server went
# away for a moment, or Postgres chose this transaction as a victim. Anything else is a bug or
# bad data and is not retried.
TRANSIENT = (
    OSError,
    TimeoutError,
    asyncpg.InterfaceError,
    asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.exceptions.TransactionRollbackError,
    asyncpg.exceptions.InsufficientResourcesError,
)


class LeaseLost(RuntimeError):
    """The rollouts are no longer leased to this bridge: another bridge took them over."""


async def pending_groups(conn: asyncpg.Connection, match: dict) -> list[asyncpg.Record]:
    """Groups with deliverable rollouts whose metadata contains `match`, oldest first.

    Per group: `group_key`, `ready` (deliverable rollouts), `waited_s` (seconds since the first
    of them was merged), `leased` (some bridge holds a live lease on one), `released` (the group
    was released before: its released members are delivered again, the others are late).
    """
    return await conn.fetch(
        f"""
        SELECT {_GROUP_KEY} AS group_key, count(*) AS ready,
               extract(epoch FROM now() - min(merged_at))::float8 AS waited_s,
               coalesce(bool_or(lease_until > now()), false) AS leased,
               bool_or(released_at IS NOT NULL OR (group_id IS NOT NULL AND EXISTS (
                   SELECT 1 FROM rollouts done
                   WHERE done.group_id = rollouts.group_id AND done.released_at IS NOT NULL
               ))) AS released
        FROM rollouts
        WHERE merged_at IS NOT NULL AND consumed_at IS NULL AND quarantined_at IS NULL
          AND metadata @> $1
        GROUP BY 1
        ORDER BY min(merged_at)
        """,
        match,
    )


async def claim_group(
    conn: asyncpg.Connection, owner: str, group_key: str, match: dict, lease_s: float
) -> list[asyncpg.Record] | None:
    """Lease every deliverable rollout of a group to `owner`, or none of them.

    Returns the claimed rows (id, group_id, task_id, status, reward, finished_at, merge_stats,
    released_at, advantage, delivery_attempts: the group's faults so far), or None when another
    bridge is on the group: one of its rows is locked by a concurrent transaction or under
    someone's live lease. A group is never split between bridges, since its advantages need all
    its rewards.
    """
    async with conn.transaction():
        rows = await conn.fetch(
            "SELECT id, lease_until > now() AS live_lease"
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
        return await conn.fetch(
            "UPDATE rollouts SET lease_owner = $1,"
            " lease_until = now() + make_interval(secs => $2::float8) WHERE id = ANY($3)"
            " RETURNING id, group_id, task_id, status, reward, finished_at, merge_stats,"
            " released_at, advantage, delivery_attempts",
            owner,
            lease_s,
            [r["id"] for r in rows],
        )


async def undelivered_traces(
    conn: asyncpg.Connection, rollout_ids: list[UUID]
) -> dict[UUID, list[tuple[int, StoredTrace]]]:
    """Each rollout's trainable merged sequences that no delivery covers yet, with their index."""
    rows = await conn.fetch(
        f"SELECT * FROM traces t WHERE t.rollout_id = ANY($1) AND {_UNDELIVERED}"
        " ORDER BY t.rollout_id, t.idx",
        rollout_ids,
    )
    traces: dict[UUID, list[tuple[int, StoredTrace]]] = {rid: [] for rid in rollout_ids}
    for row in rows:
        traces[row["rollout_id"]].append((row["idx"], StoredTrace(row)))
    return traces


async def release_group(
    conn: asyncpg.Connection,
    owner: str,
    advantages: dict[UUID, float],
    dropped: Sequence[UUID],
    skipped: Iterable[Entry | tuple[UUID, int, Outcome]],
) -> None:
    """Release a claimed group, in one transaction: fix the advantage of each member that trains
    (kept if it was fixed before), consume the `dropped` members, log the `skipped` traces, and
    consume every member left with nothing to deliver. Raises LeaseLost (nothing is written)
    when any of them is no longer `owner`'s.

    Commit this before handing any sample over: a crash after it delivers the same advantages.
    """
    ids = [*advantages, *dropped]
    async with conn.transaction():
        held = await conn.fetchval(
            "SELECT count(*) FROM (SELECT 1 FROM rollouts WHERE id = ANY($2) AND lease_owner = $1"
            " AND consumed_at IS NULL FOR UPDATE) held",
            owner,
            ids,
        )
        if held != len(set(ids)):
            raise LeaseLost(f"{len(set(ids)) - held} of {len(set(ids))} rollouts are no longer "
                            f"leased to {owner}")
        await conn.execute(
            "UPDATE rollouts r SET released_at = coalesce(r.released_at, now()),"
            " advantage = coalesce(r.advantage, a.advantage)"
            " FROM unnest($1::uuid[], $2::float8[]) AS a(id, advantage) WHERE r.id = a.id",
            list(advantages),
            list(advantages.values()),
        )
        gone = await conn.fetch(
            "UPDATE rollouts SET released_at = coalesce(released_at, now()), consumed_at = now(),"
            " lease_until = NULL WHERE id = ANY($1) RETURNING id, merge_stats, advantage",
            list(dropped),
        )
        await _write_ledgers(conn, gone, dropped=True)
        await _log(conn, owner, None, skipped, leased=True)
        await _consume_complete(conn, owner, list(advantages))


async def acknowledge(
    conn: asyncpg.Connection,
    owner: str,
    step: int,
    entries: Sequence[Entry | tuple[UUID, int, Outcome]],
) -> set[UUID]:
    """Log what optimizer step `step` took (and what was put aside since the last step), and
    consume the rollouts that have nothing left to deliver; returns the rollouts whose lease
    `owner` no longer held.

    Every entry is logged, leased or not: the log records what was trained, and a trace that
    was trained after its lease ran out shows up as such. Idempotent for one (owner, step): a
    retry after a lost commit adds nothing.
    """
    async with conn.transaction():
        rows = await conn.fetch(
            "SELECT id FROM rollouts WHERE id = ANY($2) AND lease_owner = $1"
            " AND consumed_at IS NULL FOR UPDATE",
            owner,
            list({e[0] for e in entries}),
        )
        held = {r["id"] for r in rows}
        lost = {e[0] for e in entries} - held
        await _log(conn, owner, step, [e for e in entries if e[0] in held], leased=True)
        await _log(conn, owner, step, [e for e in entries if e[0] in lost], leased=False)
        await _consume_complete(conn, owner, list(held))
    return lost


async def _log(
    conn: asyncpg.Connection,
    owner: str,
    step: int | None,
    entries: Iterable[Entry | tuple[UUID, int, Outcome]],
    *,
    leased: bool,
) -> None:
    entries = [Entry(*e) for e in entries]
    if not entries:
        return
    rollout_ids, idxs, outcomes, trained, excluded = (
        list(column) for column in zip(*entries, strict=True)
    )
    # Step -1: put aside at release, before any step. The NOT EXISTS makes a retried
    # acknowledgement of the same step a no-op.
    await conn.execute(
        "INSERT INTO deliveries (rollout_id, idx, outcome, owner, step, leased, trained_tokens,"
        " excluded_tokens)"
        " SELECT e.rollout_id, e.idx, e.outcome, $4, $5, $6, e.trained, e.excluded"
        " FROM unnest($1::uuid[], $2::int[], $3::text[], $7::int[], $8::int[])"
        "   AS e(rollout_id, idx, outcome, trained, excluded)"
        " WHERE NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.rollout_id = e.rollout_id"
        "   AND d.idx = e.idx AND d.owner = $4 AND d.step = $5)",
        rollout_ids,
        idxs,
        outcomes,
        owner,
        -1 if step is None else step,
        leased,
        trained,
        excluded,
    )


async def _consume_complete(conn: asyncpg.Connection, owner: str, rollout_ids: list[UUID]) -> None:
    done = await conn.fetch(
        "UPDATE rollouts r SET consumed_at = now(), lease_until = NULL"
        " WHERE r.id = ANY($2) AND r.lease_owner = $1 AND r.consumed_at IS NULL"
        f" AND NOT EXISTS (SELECT 1 FROM traces t WHERE t.rollout_id = r.id AND {_UNDELIVERED})"
        " RETURNING r.id, r.merge_stats, r.advantage",
        owner,
        rollout_ids,
    )
    await _write_ledgers(conn, done, dropped=False)


async def _write_ledgers(conn: asyncpg.Connection, consumed: Sequence, *, dropped: bool) -> None:
    """Each consumed rollout's ledger (core/store/ledger.py), from its merge and its log."""
    if not consumed:
        return
    logged = defaultdict(list)
    for row in await conn.fetch(
        "SELECT rollout_id, outcome, trained_tokens, excluded_tokens FROM deliveries"
        " WHERE rollout_id = ANY($1)",
        [r["id"] for r in consumed],
    ):
        logged[row["rollout_id"]].append(
            (row["outcome"], row["trained_tokens"], row["excluded_tokens"])
        )
    await conn.executemany(
        "UPDATE rollouts SET ledger = $2 WHERE id = $1",
        [
            (r["id"], msgspec.to_builtins(
                account(r["merge_stats"] or {}, r["advantage"], logged[r["id"]], dropped=dropped)
            ))
            for r in consumed
        ],
    )


async def ledgers(conn: asyncpg.Connection, rollout_ids: Sequence[UUID]) -> dict[UUID, dict]:
    """The ledgers of the consumed ones among `rollout_ids`."""
    rows = await conn.fetch(
        "SELECT id, ledger FROM rollouts WHERE id = ANY($1) AND ledger IS NOT NULL",
        list(rollout_ids),
    )
    return {r["id"]: r["ledger"] for r in rows}


async def renew(
    conn: asyncpg.Connection, owner: str, rollout_ids: list[UUID], lease_s: float
) -> set[UUID]:
    """Extend `owner`'s leases on `rollout_ids`; returns the ones it still holds."""
    rows = await conn.fetch(
        "UPDATE rollouts SET lease_until = now() + make_interval(secs => $3::float8)"
        " WHERE id = ANY($2) AND lease_owner = $1 AND consumed_at IS NULL RETURNING id",
        owner,
        rollout_ids,
        lease_s,
    )
    return {r["id"] for r in rows}


async def release(
    conn: asyncpg.Connection, owner: str, rollout_ids: list[UUID], *, fault: bool = False
) -> None:
    """Give back a claim that will not be delivered (now), so another bridge need not wait it
    out; with `fault` the group itself failed, which counts towards its quarantine."""
    await conn.execute(
        "UPDATE rollouts SET lease_owner = NULL, lease_until = NULL,"
        " delivery_attempts = delivery_attempts + $3::int"
        " WHERE id = ANY($2) AND lease_owner = $1 AND consumed_at IS NULL",
        owner,
        rollout_ids,
        int(fault),
    )


async def revert_steps_after(
    conn: asyncpg.Connection, trained_through: dict[str, int]
) -> list[UUID]:
    """Take back what the delivery log says the steps after a checkpoint trained:
    `trained_through` maps each bridge of the checkpoint's history to its last step in it. Their
    later log rows are deleted and their rollouts go back to the queue (with the advantages they
    were released with), in one transaction; returns those rollouts. Idempotent.

    The lease owner stays on them, so the next claim takes them without waiting and without
    counting a fault against the group.
    """
    async with conn.transaction():
        rows = await conn.fetch(
            "DELETE FROM deliveries d USING unnest($1::text[], $2::int[]) AS h(owner, step)"
            " WHERE d.owner = h.owner AND d.step > h.step RETURNING d.rollout_id",
            list(trained_through),
            list(trained_through.values()),
        )
        ids = list({r["rollout_id"] for r in rows})
        await conn.execute(
            "UPDATE rollouts SET consumed_at = NULL, lease_until = NULL WHERE id = ANY($1)",
            ids,
        )
    return ids


async def quarantine(conn: asyncpg.Connection, owner: str, rollout_ids: list[UUID]) -> None:
    """Put a claimed group aside for good: no bridge delivers it again until someone clears
    `quarantined_at` (and `delivery_attempts`)."""
    await conn.execute(
        "UPDATE rollouts SET quarantined_at = now(), lease_until = NULL"
        " WHERE id = ANY($2) AND lease_owner = $1 AND consumed_at IS NULL",
        owner,
        rollout_ids,
    )
