"""The vLLM replicas: one shared connection pool, sticky routing, SSE reading, health."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from uuid import UUID

import aiohttp

from gateway.protocols.errors import GatewayError


class Upstreams:
    def __init__(self, urls: list[str], timeout_s: float) -> None:
        self.urls = urls
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=10)
        self.session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        # One pool for all requests; no per-host cap: concurrency is bounded by the harnesses.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
            timeout=self._timeout,
            auto_decompress=True,
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def pick(self, rollout_id: UUID) -> str:
        """The same replica for every call of a rollout, so its growing prompt hits the prefix
        cache. uuid4 bits are uniform, so their value modulo N spreads rollouts evenly."""
        return self.urls[rollout_id.int % len(self.urls)]

    async def post(self, base: str, path: str, body: bytes) -> aiohttp.ClientResponse:
        assert self.session is not None
        try:
            return await self.session.post(
                base + path, data=body, headers={"Content-Type": "application/json"}
            )
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise GatewayError(
                502, f"upstream {base} unreachable: {exc or type(exc).__name__}", "upstream_error"
            ) from exc

    async def get_json(self, base: str, path: str, timeout_s: float = 5.0):
        assert self.session is not None
        async with self.session.get(
            base + path, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            resp.raise_for_status()
            return await resp.json(content_type=None)

    async def health(self) -> dict[str, str]:
        async def one(url: str) -> str:
            try:
                assert self.session is not None
                # Within /healthz's 2 s, with the database checked alongside.
                async with self.session.get(
                    url + "/health", timeout=aiohttp.ClientTimeout(total=1.5)
                ) as resp:
                    return "ok" if resp.status == 200 else f"http {resp.status}"
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                return f"down: {exc or type(exc).__name__}"

        results = await asyncio.gather(*(one(u) for u in self.urls))
        return dict(zip(self.urls, results))

    async def served_models(self) -> set[str]:
        names: set[str] = set()
        for url in self.urls:
            try:
                data = await self.get_json(url, "/v1/models")
            except (TimeoutError, aiohttp.ClientError, OSError):
                continue
            names.update(m["id"] for m in data.get("data", ()))
        return names


async def sse_batches(resp: aiohttp.ClientResponse) -> AsyncIterator[list[bytes]]:
    """The `data:` payloads of a server-sent-event stream, grouped by what arrived together,
    so the relay answers each network read with one write instead of one per event."""
    pending = b""
    async for block in resp.content.iter_any():
        lines = (pending + block).split(b"\n")
        pending = lines.pop()  # an incomplete last line waits for the next read
        batch = [line[5:].strip() for line in lines if line.startswith(b"data:")]
        if batch:
            yield batch
    if pending.startswith(b"data:"):
        yield [pending[5:].strip()]
