"""The policy version every gateway stamps, followed from Postgres.

The bridge (or any gateway's POST /admin/policy) writes the version to the `policy` table and
NOTIFYs; every gateway LISTENs, and reads the stored value whenever it (re)connects, so a
gateway the bridge does not know of, or one that was restarted, never stamps a stale version.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import asyncpg

from gateway.store import rollouts as rollouts_store

log = logging.getLogger(__name__)


class PolicyFollower:
    def __init__(self, pool: asyncpg.Pool, apply: Callable[[int], None]) -> None:
        self._pool = pool
        self._apply = apply
        self._task: asyncio.Task | None = None
        self._ready = asyncio.Event()

    async def start(self) -> None:
        """Returns once the gateway listens and holds the current version."""
        self._task = asyncio.create_task(self._follow_forever(), name="rolltap-policy")
        await self._ready.wait()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def _notified(self, conn, pid, channel, payload: str) -> None:
        try:
            self._apply(int(payload))
        except ValueError:
            log.error("ignoring policy notification with payload %r", payload)

    async def _follow_forever(self) -> None:
        while True:
            conn = None
            try:
                conn = await self._pool.acquire()
                lost = asyncio.Event()
                conn.add_termination_listener(lambda _conn, lost=lost: lost.set())
                await conn.add_listener(rollouts_store.POLICY_CHANNEL, self._notified)
                # Read after LISTEN: a bump committed in between is seen one way or the other.
                self._apply(await rollouts_store.policy_version(conn))
                self._ready.set()
                await lost.wait()
                log.warning("lost the policy listener's connection; reconnecting")
            except (asyncpg.PostgresError, OSError) as exc:
                log.warning("policy listener: %s; retrying in 1 s", exc)
            finally:
                if conn is not None:
                    try:
                        await conn.remove_listener(
                            rollouts_store.POLICY_CHANNEL, self._notified
                        )
                    except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
                        pass
                    await self._pool.release(conn)
            await asyncio.sleep(1.0)
