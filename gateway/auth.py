"""Rollout keys and the admin key.

A rollout key is 256 random bits; only its SHA-256 is stored (a fast hash is enough for keys
that cannot be guessed). A sandboxed agent holds only its rollout key, which opens the model
routes for that one rollout and nothing else (invariant 6). Unknown and ended keys get 401:
a key is never adopted.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from uuid import UUID

import asyncpg

from core.store import rollouts as rollouts_store
from gateway.protocols.errors import GatewayError

KEY_PREFIX = "rt-"
# Refused keys remembered, so one that is sent again costs no query (issue #28: a rollout's
# agent could otherwise make the database answer for every made-up key it sends). Bounded: a
# flood of distinct keys only pushes out older refusals, each of which still costs one query.
REFUSALS_KEPT = 65_536


def new_rollout_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def presented_key(headers) -> str | None:
    """The key a client sent: `Authorization: Bearer KEY` (OpenAI style) or `x-api-key`
    (Anthropic style)."""
    auth = headers.get("Authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    return headers.get("x-api-key") or None


def check_admin(headers, admin_key: str) -> None:
    key = presented_key(headers)
    if key is None:
        raise GatewayError(
            401,
            "admin key required: send `Authorization: Bearer ADMIN_KEY`",
            "authentication_error",
        )
    if not hmac.compare_digest(key.encode(), admin_key.encode()):
        kind = "permission_error" if key.startswith(KEY_PREFIX) else "authentication_error"
        raise GatewayError(
            403 if kind == "permission_error" else 401, "this key cannot use the admin API", kind
        )


class RolloutKeys:
    """Key -> running rollout, cached so the hot path rarely touches the database.

    An agent's calls are seconds apart (its tools run in between), so an entry must outlive
    that gap to be of use. Ending a rollout drops its entry at once on this gateway and, told
    through Postgres (`ended`), on every other one; while this gateway is not listening
    (`listening(False)`: it could miss that news) entries live at most `ttl_s`, otherwise up to
    `listening_ttl_s`. An entry never outlives the rollout's deadline, and a lookup that an end
    may have overtaken is cached for `ttl_s` only. A call that slips through still is not
    recorded: the database refuses calls of an ended rollout.
    """

    def __init__(
        self, pool: asyncpg.Pool, ttl_s: float = 2.0, listening_ttl_s: float = 60.0
    ) -> None:
        self._pool = pool
        self._ttl_s = ttl_s
        self._listening_ttl_s = listening_ttl_s
        self._listening = False
        self._ends = 0  # ends heard of so far: a lookup that saw this change is suspect
        self._cache: dict[bytes, tuple[UUID, float]] = {}
        self._digests: dict[UUID, bytes] = {}  # the cache's keys by rollout, to forget one
        # digest -> why it was refused; kept for good: keys are made here, never adopted, so
        # an unknown key never becomes valid, and an ended or overdue rollout never runs again
        self._refused: OrderedDict[bytes, str] = OrderedDict()

    def listening(self, yes: bool) -> None:
        """Whether ends of rollouts are heard of now. Either way the cache starts afresh: ends
        may have been missed while they were not."""
        self._listening = yes
        self._cache.clear()
        self._digests.clear()

    def ended(self, rollout_id: UUID) -> None:
        """A rollout ended (on any gateway)."""
        self._ends += 1
        self.forget(rollout_id)

    async def rollout_for(self, headers) -> UUID:
        key = presented_key(headers)
        if key is None:
            raise GatewayError(
                401,
                "missing API key: send the rollout key as `Authorization: Bearer KEY` "
                "or `x-api-key: KEY`",
                "authentication_error",
            )
        digest = hash_key(key)
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and hit[1] > now:
            return hit[0]
        refused = self._refused.get(digest)
        if refused is not None:
            self._refused.move_to_end(digest)
            raise _refusal(refused)
        ends, listening = self._ends, self._listening
        async with self._pool.acquire() as conn:
            row = await rollouts_store.by_key_hash(conn, digest)
        why = _why_refused(row)
        if why is not None:
            self._cache.pop(digest, None)
            self._refused[digest] = why
            if len(self._refused) > REFUSALS_KEPT:
                self._refused.popitem(last=False)
            raise _refusal(why)
        assert row is not None
        left = row["left"]
        if len(self._cache) > 100_000:
            self._cache.clear()
            self._digests.clear()
        # Cached no longer than the deadline: the key stops working the moment it passes,
        # not at the next sweep.
        trusted = listening and self._listening and ends == self._ends
        ttl = self._listening_ttl_s if trusted else self._ttl_s
        ttl = ttl if left is None else min(ttl, left)
        self._cache[digest] = (row["id"], now + ttl)
        self._digests[row["id"]] = digest
        return row["id"]

    def forget(self, rollout_id: UUID) -> None:
        digest = self._digests.pop(rollout_id, None)
        if digest is not None:
            self._cache.pop(digest, None)


def _why_refused(row) -> str | None:
    """Why a key's rollout (None: no rollout has it) opens no model route, or None if it does."""
    if row is None:
        return "unknown API key"
    if row["status"] != "running":
        return f"this rollout has ended ({row['status']}); its key no longer works"
    if row["left"] is not None and row["left"] <= 0:
        return "this rollout is past its deadline; its key no longer works"
    return None


def _refusal(why: str) -> GatewayError:
    return GatewayError(401, why, "authentication_error", code="invalid_api_key")
