"""A fresh database per test session on the machine's Postgres server.

ROLLTAP_TEST_DATABASE_URL names the server (default: the local one on 127.0.0.1:5432, trust
auth, as on every CI machine of this project)."""

from __future__ import annotations

import asyncio
import os
import uuid

import asyncpg
import pytest

SERVER_URL = os.environ.get(
    "ROLLTAP_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)

def fresh_database(prefix: str = "rolltap_test") -> tuple[str, callable]:
    """Creates an empty database; returns its DSN and a function that drops it."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(SERVER_URL)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    try:
        asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    except OSError as exc:
        pytest.exit(
            f"cannot reach Postgres at {SERVER_URL} ({exc}). Start it with: pg_ctlcluster "
            "--skip-systemctl-redirect $(ls /etc/postgresql) main start, or set "
            "ROLLTAP_TEST_DATABASE_URL.", returncode=3)
    base, _, _ = SERVER_URL.rpartition("/")

    def drop() -> None:
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))

    return f"{base}/{name}", drop
