"""Ending a rollout: merge its calls into traces, store them, announce them.

Runs on finish, on deadline expiry, and for any ended rollout found unmerged (a gateway that
died between the two). The merge itself is pure (core/merge/) and runs in a worker thread:
a 200-call rollout takes milliseconds, but the event loop serves streams meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from uuid import UUID

import asyncpg
import msgspec
import numpy as np

from core.merge import merge
from core.merge.values import STATUSES, CallTokens, MergeOptions
from core.store import traces as traces_store
from core.store.tokens import (
    StoredTokens,
    ids_from_bytes,
    logprobs_from_bytes,
    reconstruct_prompts,
)

log = logging.getLogger(__name__)


def harness_of(user_agent: str | None) -> str | None:
    """`opencode/1.18.33 ai-sdk/…` -> `opencode`: the product token names the harness."""
    if not user_agent:
        return None
    return user_agent.split()[0].split("/")[0][:64] or None


def _call(row, prompt: np.ndarray) -> CallTokens:
    completion = ids_from_bytes(row["completion_ids"])
    logprobs = logprobs_from_bytes(row["logprobs"])
    versions = ids_from_bytes(row["versions"])
    # A failed call may hold the engine's ids with logprobs or versions that do not line up
    # (that is why it failed): its tokens stay context, never trained.
    context_only = logprobs.size != completion.size or versions.size != completion.size
    if context_only:
        logprobs = np.zeros(completion.size, dtype=np.float32)
        versions = np.zeros(completion.size, dtype=np.int32)
    return CallTokens(
        id=str(row["id"]),
        seq=row["seq"],
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=logprobs,
        versions=versions,
        status=row["status"] if row["status"] in STATUSES else "failed",
        offered_tools=row["offered_tools"],
        constrained=row["constrained"],
        context_only=context_only,
        digest=row["body_digest"],
        retry_count=row["retry_count"],
        started=row["started_at"].timestamp() if row["started_at"] else 0.0,
    )


def _calls(rows) -> list[CallTokens]:
    prompts = reconstruct_prompts(
        StoredTokens(r["id"], r["base_id"], r["prefix_len"], r["prompt_delta"], r["completion_ids"])
        for r in rows
    )
    return [_call(r, prompts[r["id"]]) for r in rows]


async def merge_rollout(pool: asyncpg.Pool, rollout_id: UUID, options: MergeOptions) -> dict | None:
    """Merges and stores the traces of one rollout; returns the merge statistics, or None when
    its records could not be merged (the rollout is then marked with the reason, shown by the
    admin API, and not tried again by the sweeper)."""
    async with pool.acquire() as conn:
        rows = await traces_store.merge_inputs(conn, rollout_id)
        side_calls = await traces_store.side_calls(conn, rollout_id)
    # The gateway's options, with the rollout's own word on its side calls.
    options = msgspec.structs.replace(options, side_calls=side_calls)
    try:
        result = await asyncio.to_thread(lambda: merge(_calls(rows), options))
    except Exception as exc:  # noqa: BLE001 - bad data must not stop the merging of others
        log.exception("rollout %s cannot be merged", rollout_id)
        async with pool.acquire() as conn:
            await traces_store.mark_merge_failed(conn, rollout_id, f"{type(exc).__name__}: {exc}")
        return None
    stats = msgspec.to_builtins(result.stats)
    harness = next((h for h in map(harness_of, (r["user_agent"] for r in rows)) if h), None)
    async with pool.acquire() as conn, conn.transaction():
        # Two gateways may merge one rollout at once (a finish and another's deadline sweep):
        # the lock makes the second wait and then replace the first's identical result.
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))", str(rollout_id))
        await traces_store.replace(
            conn,
            rollout_id,
            result.sequences,
            stats,
            msgspec.to_builtins(options),
            harness,
            [UUID(c) for c in result.abandoned],
        )
    return stats
