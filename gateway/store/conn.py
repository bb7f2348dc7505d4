"""The connection the store's functions take: a bare one or one acquired from the pool.

`pool.acquire()` hands out an `asyncpg.pool.PoolConnectionProxy`, which forwards every
`Connection` method through `__getattr__`; asyncpg ships no stubs that say so, hence the union.
"""

from __future__ import annotations

from typing import TypeAlias

import asyncpg
from asyncpg.pool import PoolConnectionProxy

Conn: TypeAlias = asyncpg.Connection | PoolConnectionProxy
