"""Ending a rollout: merge its calls into traces, store them, announce them.

Runs on finish, on deadline expiry, and for any ended rollout found unmerged (a gateway that
died between the two). The merge itself is pure (gateway/merge.py) and runs in a worker thread:
a 200-call rollout takes milliseconds, but the event loop serves streams meanwhile.
"""

from __future__ import annotations

import asyncio
from uuid import UUID

import asyncpg
import msgspec

from gateway.merge import CallTokens, MergeOptions, merge
from gateway.store import traces as traces_store
from gateway.store.tokens import (
    StoredTokens,
    ids_from_bytes,
    logprobs_from_bytes,
    reconstruct_prompts,
)


def harness_of(user_agent: str | None) -> str | None:
    """`opencode/1.18.33 ai-sdk/…` -> `opencode`: the product token names the harness."""
    if not user_agent:
        return None
    return user_agent.split()[0].split("/")[0][:64] or None


def _calls(rows) -> list[CallTokens]:
    prompts = reconstruct_prompts(
        StoredTokens(r["id"], r["base_id"], r["prefix_len"], r["prompt_delta"], r["completion_ids"])
        for r in rows
    )
    return [
        CallTokens(
            id=str(r["id"]),
            seq=r["seq"],
            prompt_ids=prompts[r["id"]],
            completion_ids=ids_from_bytes(r["completion_ids"]),
            logprobs=logprobs_from_bytes(r["logprobs"]),
            versions=ids_from_bytes(r["versions"]),
            status=r["status"],
            offered_tools=r["offered_tools"],
        )
        for r in rows
    ]


async def merge_rollout(pool: asyncpg.Pool, rollout_id: UUID, options: MergeOptions) -> dict:
    """Merges and stores the traces of one rollout; returns the merge statistics."""
    async with pool.acquire() as conn:
        rows = await traces_store.merge_inputs(conn, rollout_id)
    result = await asyncio.to_thread(lambda: merge(_calls(rows), options))
    stats = msgspec.to_builtins(result.stats)
    harness = next((h for h in map(harness_of, (r["user_agent"] for r in rows)) if h), None)
    async with pool.acquire() as conn, conn.transaction():
        # Two gateways may merge one rollout at once (a finish and another's deadline sweep):
        # the lock makes the second wait and then replace the first's identical result.
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))", str(rollout_id))
        await traces_store.replace(
            conn, rollout_id, result.sequences, stats, msgspec.to_builtins(options), harness
        )
    return stats
