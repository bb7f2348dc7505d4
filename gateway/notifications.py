"""What the gateways of a deployment tell each other through Postgres: one LISTEN connection per
gateway, the channels it follows, and what to do whenever it (re)connects or is lost.

Notifications are delivered on commit, to whoever listens then: one sent while the connection
was down is lost. So whatever a gateway follows is read again on each (re)connection (`on_connect`,
after LISTEN, so a change committed in between is seen one way or the other), and whatever it
holds on the strength of notifications is distrusted while it is not listening (`on_lost`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import asyncpg

if TYPE_CHECKING:
    from core.store.conn import Conn

log = logging.getLogger(__name__)


class Notifications:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool
        self._handlers: dict[str, Callable[[str], None]] = {}
        self._connected: list[Callable[[Conn], Awaitable[None]]] = []
        self._lost: list[Callable[[], None]] = []
        self._task: asyncio.Task | None = None
        self._ready = asyncio.Event()

    def on(self, channel: str, handler: Callable[[str], None]) -> None:
        """`handler(payload)` for every notification on `channel`."""
        self._handlers[channel] = handler

    def on_connect(self, read: Callable[[Conn], Awaitable[None]]) -> None:
        """`await read(conn)` once listening, on every (re)connection."""
        self._connected.append(read)

    def on_lost(self, lost: Callable[[], None]) -> None:
        """`lost()` when the connection goes: notifications may be missed until it is back."""
        self._lost.append(lost)

    async def start(self) -> None:
        """Returns once the gateway listens and every `on_connect` has read."""
        self._task = asyncio.create_task(self._listen_forever(), name="rolltap-notifications")
        await self._ready.wait()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def _notified(self, conn, pid, channel: str, payload: str) -> None:
        handler = self._handlers.get(channel)
        if handler is None:
            return
        try:
            handler(payload)
        except ValueError:
            log.error("ignoring a notification on %s with payload %r", channel, payload)

    async def _listen_forever(self) -> None:
        while True:
            conn = None
            try:
                conn = await self._pool.acquire()
                gone = asyncio.Event()
                conn.add_termination_listener(lambda _conn, gone=gone: gone.set())
                for channel in self._handlers:
                    await conn.add_listener(channel, self._notified)
                for read in self._connected:
                    await read(conn)
                self._ready.set()
                await gone.wait()
                log.warning("lost the notification listener's connection; reconnecting")
            except (asyncpg.PostgresError, OSError) as exc:
                log.warning("notification listener: %s; retrying in 1 s", exc)
            finally:
                for lost in self._lost:
                    lost()
                if conn is not None:
                    for channel in self._handlers:
                        try:
                            await conn.remove_listener(channel, self._notified)
                        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
                            pass
                    await self._pool.release(conn)
            await asyncio.sleep(1.0)
