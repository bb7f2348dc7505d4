"""A bare durable recorder: the floor under any proxy that records calls for training, measured
beside the gateway (`bench/bench_floors.py`).

Written for the bench and nothing else. Per call it does the least a durable recorder must:
decodes the request (msgspec), asks the upstream for the capture fields (`return_token_ids`,
`logprobs`, `top_logprobs=0`), relays the answer (a stream event by event as it arrives),
decodes the ids and logprobs out of it (typed msgspec structs), and writes ONE row a call (key,
prompt ids, sampled ids, logprobs) through one writer task that commits whatever rows are
waiting in one transaction (group commit). A call is answered only once its row is committed:
a whole answer is sent after the commit, a stream's `[DONE]` is held back until it.

It checks no key, keeps no rollout state, stores no body and continues nothing: what rolltap
costs above it is the price of those guarantees and of its own code.

    python -m bench.recorder_floor --port 8300 --upstream http://127.0.0.1:8100 \
        --database-url postgresql://postgres@127.0.0.1:5432/floor
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import aiohttp
import asyncpg
import msgspec
import numpy as np
from aiohttp import web

from bench import passthrough
from bench.passthrough import health

TABLE = """
CREATE TABLE IF NOT EXISTS floor_calls (
    id bigserial PRIMARY KEY,
    key text,
    prompt_ids bytea NOT NULL,
    completion_ids bytea NOT NULL,
    logprobs bytea NOT NULL,
    finish_reason text
)"""
INSERT = (
    "INSERT INTO floor_calls (key, prompt_ids, completion_ids, logprobs, finish_reason)"
    " VALUES ($1, $2, $3, $4, $5)"
)
CAPTURE = {"return_token_ids": True, "logprobs": True, "top_logprobs": 0}
DONE = b"data: [DONE]"


class Logprob(msgspec.Struct):
    logprob: float


class Logprobs(msgspec.Struct):
    content: list[Logprob] | None = None


class Choice(msgspec.Struct):
    token_ids: list[int] | None = None
    logprobs: Logprobs | None = None
    finish_reason: str | None = None


class Reply(msgspec.Struct):
    """A whole answer or one stream event: only what the row needs is decoded."""

    choices: list[Choice] = []
    prompt_token_ids: list[int] | None = None


_reply = msgspec.json.Decoder(Reply)


class Capture:
    """One call's ids and logprobs, gathered from its answer or its events."""

    __slots__ = ("prompt", "ids", "logprobs", "finish")

    def __init__(self) -> None:
        self.prompt: list[int] = []
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish: str | None = None

    def add(self, reply: Reply) -> None:
        if reply.prompt_token_ids:
            self.prompt = reply.prompt_token_ids
        for choice in reply.choices:
            self.ids += choice.token_ids or ()
            if choice.logprobs and choice.logprobs.content:
                self.logprobs += [e.logprob for e in choice.logprobs.content]
            self.finish = choice.finish_reason or self.finish

    def row(self, key: str | None) -> tuple:
        return (
            key,
            np.asarray(self.prompt, dtype=np.int32).tobytes(),
            np.asarray(self.ids, dtype=np.int32).tobytes(),
            np.asarray(self.logprobs, dtype=np.float32).tobytes(),
            self.finish,
        )


class Writer:
    """One task commits the rows waiting, all in one transaction; each call waits for its own."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool
        self._queue: asyncio.Queue[tuple[tuple, asyncio.Future[None]]] = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def commit(self, row: tuple) -> None:
        done = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((row, done))
        await done

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                async with self._pool.acquire() as conn:
                    await conn.executemany(INSERT, [row for row, _ in batch])
            except Exception as exc:  # noqa: BLE001 - every waiting call learns it was not kept
                for _, done in batch:
                    done.set_exception(exc)
            else:
                for _, done in batch:
                    done.set_result(None)

    async def close(self) -> None:
        self._task.cancel()


def build_app(upstream: str, dsn: str) -> web.Application:
    app = web.Application()
    url = upstream + "/v1/chat/completions"
    headers = {"Content-Type": "application/json"}

    async def lifecycle(app: web.Application):
        pool = await asyncpg.create_pool(dsn, min_size=2, max_size=2)
        async with pool.acquire() as conn:
            await conn.execute(TABLE)
        app["session"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        )
        app["writer"] = Writer(pool)
        yield
        await app["writer"].close()
        await app["session"].close()
        await pool.close()

    async def forward(request: web.Request) -> web.StreamResponse:
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        body.update(CAPTURE)
        key = request.headers.get("Authorization")
        capture = Capture()
        writer: Writer = request.app["writer"]
        async with request.app["session"].post(
            url, data=msgspec.json.encode(body), headers=headers
        ) as resp:
            if resp.status != 200 or resp.content_type != "text/event-stream":
                raw = await resp.read()
                if resp.status == 200:
                    capture.add(_reply.decode(raw))
                    await writer.commit(capture.row(key))
                return web.Response(body=raw, status=resp.status, content_type=resp.content_type)
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            async for line in resp.content:
                if line.startswith(DONE):
                    break
                if line.startswith(b"data: "):
                    capture.add(_reply.decode(line[6:]))
                    await out.write(line + b"\n")
            await writer.commit(capture.row(key))
            await out.write(DONE + b"\n\n")
            await out.write_eof()
            return out

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/chat/completions", forward)
    app.router.add_get("/health", health)
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.recorder_floor", description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--database-url", required=True)
    args = parser.parse_args(argv)
    passthrough.serve(build_app(args.upstream.rstrip("/"), args.database_url), args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
