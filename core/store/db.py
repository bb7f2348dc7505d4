"""Opening the database: a given DSN, or an embedded Postgres (pgserver) in a data directory."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import asyncpg

from core.store.migrations import migrate

log = logging.getLogger(__name__)


def start_embedded(data_dir: Path) -> str:
    """Start (or reuse) a private Postgres in `data_dir`; returns its socket DSN.

    The server outlives this process on purpose (pgserver's `cleanup_mode=None`): the next
    gateway start reuses it in about a second, and records survive a gateway crash.
    """
    # A wheel with Postgres binaries; imported only when needed. From the module that defines
    # get_server: pgserver's __init__ re-exports it without __all__ (private to pyright).
    from pgserver.postgres_server import get_server

    data_dir.mkdir(parents=True, exist_ok=True)
    server = get_server(data_dir / "pgdata", cleanup_mode=None)
    return server.get_uri()


async def init_connection(conn: asyncpg.Connection) -> None:
    # jsonb in and out as Python objects, so queries pass dicts straight through.
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


# Errors that mean the database cannot be reached or did not answer in time (as opposed to
# refusing a statement): the call fails with 503 and the caller may retry.
UNAVAILABLE: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.InterfaceError,
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.TooManyConnectionsError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    asyncpg.QueryCanceledError,  # the command timeout, as the server reports it
    # asyncpg's own protocol state errors ("cannot switch to state 12; another operation is in
    # progress"): a pooled connection the server terminated in the middle of an operation,
    # seen while it shuts down.
    asyncpg.InternalClientError,
)


async def _keep_session(conn: asyncpg.Connection) -> None:
    """What a released connection needs beyond asyncpg's own clean-up (which rolls back a
    transaction left open and drops listener callbacks): nothing. asyncpg's default also sends
    a reset query (advisory locks, cursors, LISTEN, settings), a round trip on every release, so
    on every use of the pool; nothing here leaves that state behind (the migration lock is
    released explicitly, the policy listener unlistens before it gives its connection back)."""


class _Pool(asyncpg.Pool):
    """A pool whose `acquire()` (and so the matching release) waits at most `acquire_timeout`
    unless told otherwise: a database that is down or frozen fails a call fast, not never."""

    acquire_timeout: float | None = None

    def acquire(self, *, timeout: float | None = None):
        return super().acquire(timeout=self.acquire_timeout if timeout is None else timeout)


async def open_pool(
    dsn: str,
    min_size: int = 2,
    max_size: int = 10,
    acquire_timeout: float | None = None,
    command_timeout: float | None = None,
) -> asyncpg.Pool:
    """A pool on `dsn` with the schema migrated to the newest version. `acquire_timeout` also
    bounds connecting; `command_timeout` is every statement's default limit."""
    connect_kwargs = {} if acquire_timeout is None else {"timeout": acquire_timeout}
    pool = _Pool(
        dsn,
        min_size=min_size,
        max_size=max_size,
        max_queries=50000,
        max_inactive_connection_lifetime=300.0,
        init=init_connection,
        reset=_keep_session,
        loop=None,
        connection_class=asyncpg.Connection,
        record_class=asyncpg.Record,
        command_timeout=command_timeout,
        **connect_kwargs,
    )
    await pool
    pool.acquire_timeout = acquire_timeout
    async with pool.acquire(timeout=None) as conn:  # migrations may wait for another gateway
        version = await migrate(conn)
    log.info("database ready (schema version %d)", version)
    return pool
