"""Ending a rollout: merge its calls into traces, store them, announce them.

Runs on finish, on deadline expiry, and for any ended rollout found unmerged (a gateway that
died between the two). The merge itself is pure (core/merge/); it runs, with the reading of
the rollout's rows and the writing of its traces, in a process of its own (`MergeWorker`): a
200-call rollout takes milliseconds, but one of 40,000 calls holds a CPU for seconds, and in a
thread of the gateway's process it would hold the interpreter lock the event loop needs to serve
the other rollouts' calls (their p99 went 9x up while a 40,000-call merge ran beside them).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from uuid import UUID

import asyncpg
import msgspec
import numpy as np

from core.merge import merge
from core.merge.values import STATUSES, CallTokens, MergeOptions
from core.store import traces as traces_store
from core.store.db import init_connection
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


def _calls(rows: Sequence[asyncpg.Record]) -> list[CallTokens]:
    prompts = reconstruct_prompts(
        StoredTokens(r["id"], r["base_id"], r["prefix_len"], r["prompt_delta"], r["completion_ids"])
        for r in rows
    )
    return [_call(r, prompts[r["id"]]) for r in rows]


class MergeWorker:
    """One process that merges rollouts and stores their traces, started on the first merge;
    merges queue for it. Reading a rollout's rows, merging them and writing the traces all
    happen there: for 40,000 calls each step holds a CPU for seconds, decoding and encoding
    rows included, which in the gateway's process would hold its event loop."""

    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        self._pool: ProcessPoolExecutor | None = None

    async def merge(self, rollout_id: UUID, options: MergeOptions) -> dict | None:
        if self._pool is None:
            # Spawned, not forked: a fork of a process running an event loop and threads can
            # inherit a held lock.
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, _merge_in_worker, self._dsn, rollout_id, options)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _merge_in_worker(dsn: str, rollout_id: UUID, options: MergeOptions) -> dict | None:
    return asyncio.run(_merge_and_store(dsn, rollout_id, options))


async def merge_rollout(worker: MergeWorker, rollout_id: UUID, options: MergeOptions
                        ) -> dict | None:
    """Merges and stores the traces of one rollout (in `worker`'s process); returns the merge
    statistics, or None when its records could not be merged (the rollout is then marked with
    the reason, shown by the admin API, and not tried again by the sweeper)."""
    return await worker.merge(rollout_id, options)


async def _merge_and_store(dsn: str, rollout_id: UUID, options: MergeOptions) -> dict | None:
    conn = await asyncpg.connect(dsn)
    try:
        await init_connection(conn)
        return await _merge_on(conn, rollout_id, options)
    finally:
        await conn.close()


async def _merge_on(conn: asyncpg.Connection, rollout_id: UUID, options: MergeOptions
                    ) -> dict | None:
    rows = await traces_store.merge_inputs(conn, rollout_id)
    side_calls = await traces_store.side_calls(conn, rollout_id)
    # The gateway's options, with the rollout's own word on its side calls.
    options = msgspec.structs.replace(options, side_calls=side_calls)
    try:
        result = merge(_calls(rows), options)
    except Exception as exc:  # noqa: BLE001 - bad data must not stop the merging of others
        log.exception("rollout %s cannot be merged", rollout_id)
        await traces_store.mark_merge_failed(conn, rollout_id, f"{type(exc).__name__}: {exc}")
        return None
    stats = msgspec.to_builtins(result.stats)
    harness = next((h for h in map(harness_of, (r["user_agent"] for r in rows)) if h), None)
    async with conn.transaction():
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
