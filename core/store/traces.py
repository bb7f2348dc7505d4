"""The `traces` table (merged sequences) and the merge bookkeeping on `rollouts`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING
from uuid import UUID

import asyncpg
import numpy as np

from core.store.tokens import IDS, LOGPROBS, ids_from_bytes, logprobs_from_bytes
from core.store.values import clean_text

if TYPE_CHECKING:
    from core.store.conn import Conn

# Announced once a finished rollout's traces are stored: what a trainer bridge waits for.
FINISHED_CHANNEL = "rolltap_rollout_finished"


async def merge_inputs(conn: Conn, rollout_id: UUID) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT id, seq, base_id, prefix_len, prompt_delta, completion_ids, logprobs, versions,"
        " status, offered_tools, user_agent, protocol, constrained, body_digest, retry_count,"
        " started_at FROM calls WHERE rollout_id = $1 ORDER BY seq",
        rollout_id,
    )


async def side_calls(conn: Conn, rollout_id: UUID) -> str:
    """What the rollout's creator said of its toolless calls ('auto' for an unknown rollout)."""
    value = await conn.fetchval("SELECT side_calls FROM rollouts WHERE id = $1", rollout_id)
    return value or "auto"


async def replace(
    conn: Conn,
    rollout_id: UUID,
    sequences,
    stats: dict,
    options: dict,
    harness: str | None,
    abandoned: Sequence[UUID] = (),
) -> None:
    """Stores a merge result in place of any earlier one (merging is idempotent), and marks
    the calls the merge found abandoned."""
    await conn.execute("DELETE FROM traces WHERE rollout_id = $1", rollout_id)
    await conn.executemany(
        "INSERT INTO traces (rollout_id, idx, input_ids, loss_mask, logprobs, versions,"
        " call_ids, cause, auxiliary, excluded) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
        [
            (
                rollout_id,
                idx,
                s.input_ids.astype(IDS, copy=False).tobytes(),
                s.loss_mask.astype(np.uint8, copy=False).tobytes(),
                s.logprobs.astype(LOGPROBS, copy=False).tobytes(),
                s.versions.astype(IDS, copy=False).tobytes(),
                [UUID(c) for c in s.call_ids],
                s.cause,
                s.auxiliary,
                s.excluded,
            )
            for idx, s in enumerate(sequences)
        ],
    )
    await conn.execute(
        "UPDATE calls SET abandoned = (id = ANY($2::uuid[])) WHERE rollout_id = $1",
        rollout_id,
        list(abandoned),
    )
    await conn.execute(
        "UPDATE rollouts SET merge_stats = $2, merge_options = $3, harness = $4,"
        " merged_at = now(), merge_error = NULL WHERE id = $1",
        rollout_id,
        stats,
        options,
        harness,
    )
    await conn.execute("SELECT pg_notify($1, $2)", FINISHED_CHANNEL, str(rollout_id))


class StoredTrace:
    """One merged sequence read back, arrays as numpy views of the stored bytes."""

    __slots__ = (
        "auxiliary",
        "call_ids",
        "cause",
        "excluded",
        "input_ids",
        "logprobs",
        "loss_mask",
        "versions",
    )

    def __init__(self, row: asyncpg.Record) -> None:
        self.input_ids = ids_from_bytes(row["input_ids"])
        self.loss_mask = np.frombuffer(row["loss_mask"], dtype=np.uint8)
        self.logprobs = logprobs_from_bytes(row["logprobs"])
        self.versions = ids_from_bytes(row["versions"])
        self.call_ids = [str(c) for c in row["call_ids"]]
        self.cause = row["cause"]
        self.auxiliary = row["auxiliary"]
        self.excluded = row["excluded"]

    def to_dict(self) -> dict:
        return {
            "input_ids": self.input_ids.tolist(),
            "loss_mask": self.loss_mask.tolist(),
            "logprobs": self.logprobs.tolist(),
            "versions": self.versions.tolist(),
            "call_ids": self.call_ids,
            "cause": self.cause,
            "auxiliary": self.auxiliary,
            "excluded": self.excluded,
        }


async def fetch(conn: Conn, rollout_id: UUID) -> list[StoredTrace]:
    rows = await conn.fetch("SELECT * FROM traces WHERE rollout_id = $1 ORDER BY idx", rollout_id)
    return [StoredTrace(r) for r in rows]


async def unmerged(conn: Conn, limit: int = 16) -> list[UUID]:
    """Ended rollouts whose merge has not happened (a gateway died between finish and merge)."""
    rows = await conn.fetch(
        "SELECT id FROM rollouts WHERE status <> 'running' AND merged_at IS NULL"
        " AND merge_error IS NULL ORDER BY finished_at LIMIT $1",
        limit,
    )
    return [r["id"] for r in rows]


async def mark_merge_failed(conn: Conn, rollout_id: UUID, reason: str) -> None:
    await conn.execute(
        "UPDATE rollouts SET merge_error = $2 WHERE id = $1", rollout_id, clean_text(reason)
    )


async def harness_metrics(conn: Conn) -> list[asyncpg.Record]:
    """Merge statistics summed per harness (from the user agent of each rollout's calls)."""
    return await conn.fetch(
        """
        SELECT coalesce(harness, 'unknown') AS harness, count(*) AS rollouts,
               sum((merge_stats->>'calls')::int) AS calls,
               sum((merge_stats->>'sequences')::int) AS sequences,
               sum((merge_stats->>'trained_tokens')::bigint)::bigint AS trained_tokens,
               sum((merge_stats->>'lost_tokens')::bigint)::bigint AS lost_tokens,
               sum((merge_stats->'causes'->>'drift')::int) AS drift,
               sum((merge_stats->'causes'->>'rewrite')::int) AS rewrite,
               sum((merge_stats->'causes'->>'independent')::int) AS independent,
               sum((merge_stats->'causes'->>'abandoned')::int) AS abandoned,
               sum(coalesce((merge_stats->>'constrained_calls')::int, 0)) AS constrained_calls,
               sum(coalesce((merge_stats->>'constrained_tokens')::bigint, 0))::bigint
                   AS constrained_tokens,
               sum(coalesce((merge_stats->>'retried_calls')::int, 0)) AS retried_calls,
               sum(coalesce((merge_stats->>'context_only_calls')::int, 0)) AS context_only_calls,
               count(*) FILTER (WHERE merge_error IS NOT NULL) AS merge_failed
        FROM rollouts WHERE merged_at IS NOT NULL OR merge_error IS NOT NULL
        GROUP BY 1 ORDER BY 1
        """
    )
