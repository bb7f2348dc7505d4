"""A lean HTTP/1.1 client for the engine's whole (non-streamed) answers: one request written in
one call, the response parsed by llhttp (httptools), kept-alive connections pooled per replica.

aiohttp's client costs 150-200 µs of CPU a request on a 2-core VM (a ClientRequest, a
body-writer task, its timers, headers as multidicts); this one 40-70 (the same loopback server,
issue #41). It fails the way aiohttp's does, with aiohttp's exception classes, so the
exchange's retry (`stale_connection`), blame and re-placement read it unchanged: a refused
connection is a `ClientConnectorError`, a connection the engine closed before answering a
`ServerDisconnectedError`, one closed during the answer a `ClientPayloadError`, the request's
time running out a `TimeoutError`. Streams, probes and admin requests keep aiohttp's client.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections import deque
from typing import cast

import aiohttp
import httptools
from aiohttp.client_reqrep import ConnectionKey
from yarl import URL


class EngineResponse:
    """An answer whose status and headers arrived; `read` waits for its body."""

    __slots__ = ("status", "_conn")

    def __init__(self, status: int, conn: _Connection) -> None:
        self.status = status
        self._conn = conn

    async def read(self) -> bytes:
        return await self._conn.body()

    def close(self) -> None:
        self._conn.close()

    async def __aenter__(self) -> EngineResponse:
        return self

    async def __aexit__(self, *exc_info) -> None:
        self._conn.release()


class _Connection(asyncio.Protocol):
    """One kept-alive connection to a replica, answering one request at a time."""

    def __init__(self, pool: _Idle, keepalive_s: float) -> None:
        self._pool = pool
        self._keepalive_s = keepalive_s
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self._head: asyncio.Future[int] | None = None
        self._done: asyncio.Future[bytes] | None = None
        self._chunks: list[bytes] = []
        self._encoding = b""
        self._sized = False  # Content-Length or chunked: the end is known without EOF
        self._keep = False  # the answer read leaves the connection open for another
        self._timer: asyncio.TimerHandle | None = None
        self.idle_since = 0.0

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a TCP connection's

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self._done is not None and self._head is not None and self._head.done():
            if exc is None and not self._sized and not self._done.done():
                self.on_message_complete()  # a body that ends with the connection
                return
            self._fail(aiohttp.ClientPayloadError("response payload is not completed"))
        else:
            self._fail(aiohttp.ServerDisconnectedError())

    def data_received(self, data: bytes) -> None:
        if self._done is None:  # nothing asked: an engine does not speak first
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(aiohttp.ClientPayloadError(f"malformed response: {exc}"))
            self.close()

    # -- httptools callbacks ------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-encoding":
            self._encoding = value.strip().lower()
        elif name == b"content-length" or name == b"transfer-encoding":
            self._sized = True

    def on_headers_complete(self) -> None:
        if self._head is not None and not self._head.done():
            self._head.set_result(self._parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)

    def on_message_complete(self) -> None:
        self._keep = self._parser.should_keep_alive()  # (llhttp forgets it once back)
        if self._done is None or self._done.done():
            return
        body = b"".join(self._chunks)
        self._chunks = []
        if self._encoding in (b"gzip", b"deflate"):
            try:
                body = zlib.decompress(body, wbits=47)  # gzip or zlib, told by its header
            except zlib.error as exc:
                self._fail(aiohttp.ClientPayloadError(f"undecodable {self._encoding!r}: {exc}"))
                return
        self._done.set_result(body)

    # -- the request --------------------------------------------------------------------------

    def send(self, head: bytes, body: bytes, timeout_s: float) -> asyncio.Future[int]:
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        self._head, self._done = loop.create_future(), loop.create_future()
        self._encoding, self._sized, self._keep = b"", False, False
        self._timer = loop.call_later(timeout_s, self._expired, timeout_s)
        self.transport.writelines((head, body))
        return self._head

    async def body(self) -> bytes:
        assert self._done is not None
        try:
            return await self._done
        except BaseException:
            self.close()
            raise

    def _expired(self, timeout_s: float) -> None:
        self._fail(TimeoutError(f"no whole answer in {timeout_s:g}s"))
        self.close()

    def _fail(self, exc: BaseException) -> None:
        for fut in (self._head, self._done):
            if fut is not None and not fut.done():
                fut.set_exception(exc)
                fut.exception()  # awaited or not, it is handled: no "never retrieved" warning

    def release(self) -> None:
        """The answer is read (or given up): the connection goes back to the pool if it can
        carry another request, or is closed."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        done = self._done
        self._head = self._done = None
        if done is None or not done.done() or done.cancelled() or done.exception() is not None:
            self.close()
        elif self.transport is not None and self._keep:
            self.idle_since = now = time.monotonic()
            pool = self._pool
            pool.append(self)
            # Taken newest first, the oldest would wait for a lull: they go as they expire.
            while now - pool[0].idle_since >= self._keepalive_s:
                pool.popleft().close()
        else:
            self.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    @property
    def usable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()


_Idle = deque  # a replica's idle connections, newest last


class EngineClient:
    """Whole-answer POSTs to the replicas, over pooled kept-alive connections."""

    def __init__(self, timeout_s: float, connect_timeout_s: float, keepalive_s: float) -> None:
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        # An idle connection is given up before the engine's own idle timeout could close it
        # under a request being written.
        self._keepalive_s = keepalive_s
        self._idle: dict[str, _Idle] = {}
        self._heads: dict[tuple[str, str], tuple[str, int, bytes]] = {}

    def handles(self, base: str) -> bool:
        """Plain HTTP only: TLS replicas go through aiohttp."""
        return base.startswith("http://")

    async def post(self, base: str, path: str, body: bytes) -> EngineResponse:
        host, port, head = self._head_for(base, path)
        conn = await self._connection(base, host, port)
        try:
            status = await conn.send(b"%s%d\r\n\r\n" % (head, len(body)), body, self._timeout_s)
        except BaseException:
            conn.close()
            raise
        return EngineResponse(status, conn)

    def _head_for(self, base: str, path: str) -> tuple[str, int, bytes]:
        """(host, port, the request's head up to its Content-Length value), made once."""
        key = (base, path)
        found = self._heads.get(key)
        if found is None:
            url = URL(base + path)
            assert url.host is not None and url.port is not None
            head = (
                f"POST {url.raw_path_qs or '/'} HTTP/1.1\r\nHost: {url.raw_authority}\r\n"
                "Content-Type: application/json\r\nContent-Length: "
            )
            found = self._heads[key] = (url.host, url.port, head.encode())
        return found

    async def _connection(self, base: str, host: str, port: int) -> _Connection:
        idle = self._idle.setdefault(base, deque())
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.usable and now - conn.idle_since < self._keepalive_s:
                return conn
            conn.close()
        loop = asyncio.get_running_loop()
        keepalive_s = self._keepalive_s
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(idle, keepalive_s), host, port
                )
        except OSError as exc:
            key = ConnectionKey(host, port, False, True, None, None, None)
            raise aiohttp.ClientConnectorError(key, exc) from exc
        return conn

    def close(self) -> None:
        for idle in self._idle.values():
            while idle:
                idle.pop().close()
