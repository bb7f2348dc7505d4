"""`GET /healthz`: up or down for anyone, the details behind the admin key.

The route needs no key because load balancers and container health checks ask it without one.
So it must give such a caller nothing to learn (no engine URLs, versions or recorder figures)
and nothing to spend: it reads the replicas' state as the background prober last saw it, and
asks the database at most once every `DATABASE_CHECK_EVERY_S`, however many requests arrive.
Probing every engine per request let any caller feed the replicas' ejection counts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import asyncpg

from core.store.db import UNAVAILABLE
from gateway.auth import check_admin
from gateway.protocols.errors import GatewayError

DATABASE_CHECK_EVERY_S = 1.0
_DATABASE_TIMEOUT_S = 0.8  # a frozen database must make the answer "down", not no answer


async def database_health(pool: asyncpg.Pool, recorder_down: Callable[[], str | None]) -> str:
    try:
        async with pool.acquire(timeout=_DATABASE_TIMEOUT_S) as conn:
            await conn.fetchval("SELECT 1", timeout=_DATABASE_TIMEOUT_S)
    except (asyncpg.PostgresError, *UNAVAILABLE) as exc:
        return f"down: {str(exc) or type(exc).__name__}"
    down = recorder_down()
    return "ok" if down is None else f"down: {down}"


class DatabaseCheck:
    """The database's health, checked at most once per `every_s` and shared by the callers
    that ask meanwhile (one check in flight at a time)."""

    def __init__(self, check: Callable[[], Awaitable[str]],
                 every_s: float = DATABASE_CHECK_EVERY_S) -> None:
        self._check = check
        self._every_s = every_s
        self._answer = "down: not checked yet"
        self._checked_at = float("-inf")
        self._running: asyncio.Task[str] | None = None

    async def answer(self) -> str:
        if time.monotonic() - self._checked_at < self._every_s:
            return self._answer
        if self._running is None:
            self._running = asyncio.ensure_future(self._refresh())
        # shield: one caller going away must not cancel the check the others wait for
        return await asyncio.shield(self._running)

    async def _refresh(self) -> str:
        try:
            self._answer = await self._check()
            self._checked_at = time.monotonic()
            return self._answer
        finally:
            self._running = None


def healthy(database: str, upstreams: dict[str, str]) -> bool:
    return database == "ok" and any(v == "ok" for v in upstreams.values())


def public_answer(is_healthy: bool) -> tuple[int, dict]:
    return (200, {"status": "ok"}) if is_healthy else (503, {"status": "down"})


def admin_requested(headers, admin_key: str) -> bool:
    """Whether the caller showed the admin key. A caller with no key, or another key, gets the
    public answer (a health checker may send whatever its config holds), never an error."""
    try:
        check_admin(headers, admin_key)
    except GatewayError:
        return False
    return True
