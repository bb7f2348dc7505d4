"""Opening the database: a given DSN, or an embedded Postgres (pgserver) in a data directory."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import asyncpg

from gateway.store.migrations import migrate

log = logging.getLogger(__name__)


def start_embedded(data_dir: Path) -> str:
    """Start (or reuse) a private Postgres in `data_dir`; returns its socket DSN.

    The server outlives this process on purpose (pgserver's `cleanup_mode=None`): the next
    gateway start reuses it in about a second, and records survive a gateway crash.
    """
    import pgserver  # a wheel with Postgres binaries; imported only when needed

    data_dir.mkdir(parents=True, exist_ok=True)
    server = pgserver.get_server(data_dir / "pgdata", cleanup_mode=None)
    return server.get_uri()


async def _init_connection(conn: asyncpg.Connection) -> None:
    # jsonb in and out as Python objects, so queries pass dicts straight through.
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


async def open_pool(dsn: str, min_size: int = 2, max_size: int = 10) -> asyncpg.Pool:
    """A pool on `dsn` with the schema migrated to the newest version."""
    pool = await asyncpg.create_pool(
        dsn, min_size=min_size, max_size=max_size, init=_init_connection
    )
    async with pool.acquire() as conn:
        version = await migrate(conn)
    log.info("database ready (schema version %d)", version)
    return pool
