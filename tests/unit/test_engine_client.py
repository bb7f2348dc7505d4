"""The lean engine client against a scripted HTTP server on loopback: exact bodies, kept-alive
connections, and failures raised as aiohttp's, so the exchange retries, blames and re-places as
before (issue #41)."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import Sequence

import aiohttp
import pytest

from gateway.engine_client import EngineClient
from gateway.engine_exchange import stale_connection

BODY = b'{"model":"m","prompt":[1,2,3]}'
ANSWER = b'{"choices":[{"text":"hi","token_ids":[5,6]}],"prompt_token_ids":[1,2,3]}'


def ok(body: bytes = ANSWER, extra: bytes = b"") -> list[bytes]:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n"
    return [head % (extra, len(body)), body]


class Scripted:
    """A loopback server answering each request with the next script entry: the pieces it
    writes (each its own write), then whether it closes the connection."""

    def __init__(self, script: Sequence[tuple[list[bytes] | None, bool]]) -> None:
        script = list(script)
        self.script = script
        self.requests: list[bytes] = []
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc_info) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        while self.script:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:  # the client gave the connection up
                break
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            self.requests.append(head + await reader.readexactly(length))
            pieces, close = self.script.pop(0)
            if pieces is None:  # an engine that never answers
                await asyncio.Event().wait()
                return
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0)
            if close:
                break
        writer.close()


async def whole(client: EngineClient, base: str) -> tuple[int, bytes]:
    resp = await client.post(base, "/v1/completions", BODY)
    async with resp:
        return resp.status, await resp.read()


def answered(script: Sequence[tuple[list[bytes] | None, bool]]) -> tuple[Scripted, list]:
    """Each script entry's answer, asked for in turn through one client."""

    async def main():
        server = Scripted(script)
        async with server as base:
            client = EngineClient(60, 10, 4)
            answers = [await whole(client, base) for _ in script]
            client.close()
        return server, answers

    return asyncio.run(main())


def test_exact_bodies_over_one_kept_alive_connection():
    server, answers = answered([(ok(), False), (ok(ANSWER[:10], b""), False), (ok(), False)])
    assert answers == [(200, ANSWER), (200, ANSWER[:10]), (200, ANSWER)]
    assert server.connections == 1
    port = server.requests[0].split(b"Host: 127.0.0.1:")[1].split(b"\r\n")[0]
    assert server.requests[0] == (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%s\r\nContent-Type: application/json"
        b"\r\nContent-Length: %d\r\n\r\n%s" % (port, len(BODY), BODY)
    )


def test_chunked_split_and_compressed_answers_read_whole():
    chunked = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
               b"%x\r\n%s\r\n" % (10, ANSWER[:10]), b"%x\r\n" % (len(ANSWER) - 10),
               ANSWER[10:] + b"\r\n", b"0\r\n\r\n"]  # fmt: skip
    split = [piece[i : i + 7] for piece in ok() for i in range(0, len(piece), 7)]
    gzipped = ok(gzip.compress(ANSWER), b"Content-Encoding: gzip\r\n")
    _, answers = answered([(chunked, False), (split, False), (gzipped, False)])
    assert answers == [(200, ANSWER)] * 3


def test_a_closing_answer_is_read_and_its_connection_not_kept():
    server, answers = answered([(ok(extra=b"Connection: close\r\n"), True), (ok(), False)])
    assert answers == [(200, ANSWER)] * 2
    assert server.connections == 2


def test_errors_are_aiohttps_as_the_exchange_reads_them():
    async def main():
        # Closed before answering (an engine's idle timeout racing the request): safe to retry.
        async with Scripted([([], True)]) as base:
            client = EngineClient(60, 10, 4)
            with pytest.raises(aiohttp.ServerDisconnectedError) as before:
                await client.post(base, "/v1/completions", BODY)
        # Closed during the answer: the engine took the request, not retried.
        async with Scripted([(ok()[:1] + [ANSWER[:5]], True)]) as base:
            resp = await client.post(base, "/v1/completions", BODY)
            with pytest.raises(aiohttp.ClientPayloadError) as during:
                async with resp:
                    await resp.read()
        # Never answered: the request's time runs out.
        async with Scripted([(None, False)]) as base:
            slow = EngineClient(0.2, 10, 4)
            with pytest.raises(TimeoutError):
                await whole(slow, base)
        # Refused: the engine took nothing, another replica may take the call.
        with pytest.raises(aiohttp.ClientConnectorError) as refused:
            await client.post(base, "/v1/completions", BODY)
        return before.value, during.value, refused.value

    before, during, refused = asyncio.run(main())
    assert stale_connection(before)
    assert not stale_connection(during)
    assert not stale_connection(refused)


def test_a_connection_idle_past_its_keepalive_is_not_reused():
    async def main():
        server = Scripted([(ok(), False), (ok(), False)])
        async with server as base:
            client = EngineClient(60, 10, keepalive_s=0.01)
            first = await whole(client, base)
            await asyncio.sleep(0.1)  # longer than the keepalive: given up, not reused
            second = await whole(client, base)
            client.close()
        return server, [first, second]

    server, answers = asyncio.run(main())
    assert answers == [(200, ANSWER)] * 2
    assert server.connections == 2
