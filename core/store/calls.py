"""The `calls` table: one row per model call, written in group commits, read back whole."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any, NamedTuple
from uuid import UUID

import msgspec
import numpy as np

from core.store import bodies
from core.store.tokens import (
    StoredTokens,
    chain_ids,
    ids_from_bytes,
    logprobs_from_bytes,
    reconstruct_prompts,
)

if TYPE_CHECKING:
    from core.store.conn import Conn


class CallRecord(msgspec.Struct, kw_only=True):
    """Everything recorded about one call, in storage form (token arrays as bytes)."""

    id: UUID
    rollout_id: UUID
    protocol: str
    status: str  # ok | aborted | failed
    started_at: datetime
    base_id: UUID | None
    prefix_len: int
    prompt_len: int
    prompt_delta: bytes
    completion_ids: bytes
    logprobs: bytes
    versions: bytes
    finish_reason: str | None
    offered_tools: bool
    model: str | None
    requested: dict
    applied: dict
    request_body: bytes | None  # zstd, whole or a delta against `request_base` (store/bodies)
    response_body: bytes | None  # zstd
    upstream: str | None
    latency_ms: float
    ttft_ms: float | None
    error: str | None
    user_agent: str | None
    response_id: str | None = None
    continuation: dict | None = None
    reply_keys: list[bytes] | None = None
    rerouted: str | None = None  # why the call left its rollout's replica
    constrained: bool = False
    body_digest: bytes | None = None
    retry_count: int = 0
    request_base: UUID | None = None  # the call whose body `request_body` is a delta against


# The rollout row lock taken by the UPDATE numbers a rollout's calls in commit order, also when
# several gateways record calls of one rollout at once. A call of a rollout that has ended is
# refused (SQLSTATE RT409), not silently kept out of its traces: finishing takes the same row
# lock, and the UPDATE returns the status as of that lock, so either the call commits before
# the finish (and is merged) or it is refused.
#
# The same statement holds each rollout to its limits ($33 calls, $34 stored body bytes): past
# either the call is refused (SQLSTATE RT413), whichever gateway records it.
INSERT = """
WITH bump AS (
    UPDATE rollouts SET call_count = call_count + 1,
        stored_bytes = stored_bytes + coalesce(octet_length($17::bytea), 0)
                                    + coalesce(octet_length($18::bytea), 0)
    WHERE id = $2 RETURNING call_count, status, stored_bytes
)
INSERT INTO calls (
    id, rollout_id, seq, protocol, status, base_id, prefix_len, prompt_len, prompt_delta,
    completion_ids, logprobs, versions, finish_reason, offered_tools, model, requested, applied,
    request_body, response_body, upstream, latency_ms, ttft_ms, error, user_agent, response_id,
    continuation, reply_keys, rerouted, constrained, body_digest, retry_count, started_at,
    request_base
)
SELECT $1, $2,
       CASE WHEN bump.status <> 'running' THEN rolltap_refuse_call($2)
            WHEN bump.call_count > $33 THEN rolltap_refuse_over($2, 'limit of calls')
            WHEN bump.stored_bytes > $34 THEN rolltap_refuse_over($2, 'storage quota')
            ELSE bump.call_count END,
       $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16,
       $17, $18, $19, $20, $21, $22, $23, $24, $25, $26, $27, $28, $29, $30, $31, $32
FROM bump
"""


class Limits(NamedTuple):
    """What one rollout may store: calls, and body bytes (as stored, compressed)."""

    calls: int
    stored_bytes: int


NO_LIMITS = Limits(2**31 - 1, 2**63 - 1)


def insert_args(r: CallRecord, limits: Limits = NO_LIMITS) -> tuple[object, ...]:
    return (
        r.id,
        r.rollout_id,
        r.protocol,
        r.status,
        r.base_id,
        r.prefix_len,
        r.prompt_len,
        r.prompt_delta,
        r.completion_ids,
        r.logprobs,
        r.versions,
        r.finish_reason,
        r.offered_tools,
        r.model,
        r.requested,
        r.applied,
        r.request_body,
        r.response_body,
        r.upstream,
        r.latency_ms,
        r.ttft_ms,
        r.error,
        r.user_agent,
        r.response_id,
        r.continuation,
        r.reply_keys,
        r.rerouted,
        r.constrained,
        r.body_digest,
        r.retry_count,
        r.started_at,
        r.request_base,
        limits.calls,
        limits.stored_bytes,
    )


_TOKEN_COLUMNS = "id, base_id, prefix_len, prompt_delta, completion_ids"


async def rollout_tokens(conn: Conn, rollout_id: UUID) -> list[StoredTokens]:
    rows = await conn.fetch(
        f"SELECT {_TOKEN_COLUMNS} FROM calls WHERE rollout_id = $1 ORDER BY seq", rollout_id
    )
    return [StoredTokens(*r) for r in rows]


async def recent_full_ids(
    conn: Conn, rollout_id: UUID, limit: int
) -> list[tuple[UUID, np.ndarray]]:
    """(call id, prompt + completion ids) of the rollout's last `limit` calls, oldest first."""
    stored = await rollout_tokens(conn, rollout_id)
    return [(s.id, chain_ids(stored, s.id)) for s in stored[-limit:]]


async def full_ids(conn: Conn, rollout_id: UUID, call_id: UUID) -> np.ndarray | None:
    """Prompt + completion ids of one call, from its chain of bases only; None if no such call
    in this rollout."""
    rows = await conn.fetch(
        f"""
        WITH RECURSIVE chain AS (
            SELECT {_TOKEN_COLUMNS} FROM calls WHERE id = $2 AND rollout_id = $1
            UNION ALL
            SELECT c.id, c.base_id, c.prefix_len, c.prompt_delta, c.completion_ids
            FROM calls c JOIN chain ON c.id = chain.base_id
        )
        SELECT {_TOKEN_COLUMNS} FROM chain
        """,
        rollout_id,
        call_id,
    )
    if not rows:
        return None
    return chain_ids([StoredTokens(*r) for r in rows], call_id)


async def last_upstream(conn: Conn, rollout_id: UUID) -> str | None:
    """The replica the rollout's last recorded call went to (by any gateway)."""
    return await conn.fetchval(
        "SELECT upstream FROM calls WHERE rollout_id = $1 ORDER BY seq DESC LIMIT 1", rollout_id
    )


async def find_replies(
    conn: Conn, rollout_id: UUID, keys: list[bytes]
) -> list[tuple[UUID, list[bytes]]]:
    """(call id, reply keys) of the rollout's successful calls whose reply has one of `keys`,
    oldest first."""
    rows = await conn.fetch(
        "SELECT id, reply_keys FROM calls WHERE rollout_id = $1 AND status = 'ok'"
        " AND reply_keys && $2::bytea[] ORDER BY seq",
        rollout_id,
        keys,
    )
    return [(r["id"], list(r["reply_keys"])) for r in rows]


def decompress_json(raw: bytes | None):
    return None if raw is None else msgspec.json.decode(bodies.unwhole(raw))


async def rollout_calls(
    conn: Conn, rollout_id: UUID, with_tokens: bool, with_bodies: bool
) -> list[dict]:
    """The rollout's calls as the admin API returns them (field names are public API)."""
    rows = await conn.fetch("SELECT * FROM calls WHERE rollout_id = $1 ORDER BY seq", rollout_id)
    prompts = (
        reconstruct_prompts(
            StoredTokens(
                r["id"], r["base_id"], r["prefix_len"], r["prompt_delta"], r["completion_ids"]
            )
            for r in rows
        )
        if with_tokens
        else {}
    )
    requests = (
        bodies.reconstruct(
            bodies.StoredBody(r["id"], r["request_base"], r["request_body"], r["response_body"])
            for r in rows
        )
        if with_bodies
        else {}
    )
    out = []
    for r in rows:
        call = {
            "call_id": str(r["id"]),
            "seq": r["seq"],
            "protocol": r["protocol"],
            "status": r["status"],
            "finish_reason": r["finish_reason"],
            "model": r["model"],
            "prompt_tokens": r["prompt_len"],
            "completion_tokens": len(r["completion_ids"]) // 4,
            "stored_prompt_tokens": len(r["prompt_delta"]) // 4,
            "base_call_id": str(r["base_id"]) if r["base_id"] else None,
            "offered_tools": r["offered_tools"],
            "constrained": r["constrained"],
            "abandoned": r["abandoned"],
            "retry_count": r["retry_count"],
            "upstream": r["upstream"],
            "latency_ms": r["latency_ms"],
            "ttft_ms": r["ttft_ms"],
            "error": r["error"],
            "user_agent": r["user_agent"],
            "requested": r["requested"],
            "applied": r["applied"],
            "continuation": r["continuation"],
            "rerouted": r["rerouted"],
            "created_at": r["created_at"].isoformat(),
        }
        if with_tokens:
            call["prompt_ids"] = prompts[r["id"]].tolist()
            call["completion_ids"] = ids_from_bytes(r["completion_ids"]).tolist()
            call["logprobs"] = logprobs_from_bytes(r["logprobs"]).tolist()
            call["versions"] = ids_from_bytes(r["versions"]).tolist()
        if with_bodies:
            raw = requests[r["id"]]
            call["request"] = None if raw is None else msgspec.json.decode(raw)
            call["response"] = decompress_json(r["response_body"])
        out.append(call)
    return out


async def request_body(conn: Conn, rollout_id: UUID, call_id: UUID) -> bytes | None:
    """The request body of one call, exactly as the harness sent it, from its chain of parent
    bodies only; None if none was kept."""
    rows = await conn.fetch(
        """
        WITH RECURSIVE chain AS (
            SELECT id, request_base, request_body, response_body FROM calls
            WHERE id = $2 AND rollout_id = $1
            UNION ALL
            SELECT c.id, c.request_base, c.request_body, c.response_body
            FROM calls c JOIN chain ON c.id = chain.request_base
        )
        SELECT id, request_base, request_body, response_body FROM chain
        """,
        rollout_id,
        call_id,
    )
    return bodies.reconstruct(bodies.StoredBody(*r) for r in rows).get(call_id)


async def response_state(conn: Conn, rollout_id: UUID, response_id: str) -> Any:
    """The stored summary of the call that produced `response_id` in this rollout, or None."""
    raw = await conn.fetchval(
        "SELECT response_body FROM calls WHERE rollout_id = $1 AND response_id = $2",
        rollout_id, response_id,
    )
    return decompress_json(raw)
