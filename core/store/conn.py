"""The connection the store's functions take: a bare one or one acquired from the pool.

`pool.acquire()` hands out an `asyncpg.pool.PoolConnectionProxy`, which forwards every
`Connection` method through `__getattr__`; asyncpg ships no stubs that say so, hence the union.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Sequence
from types import TracebackType
from typing import Any, Protocol, TypeAlias

import asyncpg
from asyncpg.pool import PoolConnectionProxy

Conn: TypeAlias = asyncpg.Connection | PoolConnectionProxy


class Connection(Protocol):
    """What the strictly typed modules call on a connection (asyncpg ships no type stubs)."""

    async def execute(self, query: str, *args: object, timeout: float | None = None) -> str: ...

    async def executemany(
        self, command: str, args: Iterable[Sequence[object]], *, timeout: float | None = None
    ) -> None: ...

    async def fetchval(
        self, query: str, *args: object, column: int = 0, timeout: float | None = None
    ) -> Any: ...


class Acquiring(Protocol):
    """`pool.acquire()`: awaited for a connection to release later, or entered for one."""

    def __await__(self) -> Generator[Any, Any, Conn]: ...

    async def __aenter__(self) -> Conn: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> object: ...


class Pool(Protocol):
    """What the strictly typed modules call on asyncpg's pool."""

    def acquire(self, *, timeout: float | None = None) -> Acquiring: ...

    async def release(self, connection: Conn, *, timeout: float | None = None) -> None: ...
