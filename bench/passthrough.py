"""A bare aiohttp pass-through: the floor under any aiohttp proxy, measured beside the gateway.

It forwards `POST /v1/chat/completions` to one upstream over a keep-alive pool and relays the
answer, whole or streamed as it arrives; it parses nothing, checks nothing and records nothing.
What the gateway costs above it is what rolltap itself adds.

    python -m bench.passthrough --port 8200 --upstream http://127.0.0.1:8100
"""

from __future__ import annotations

import argparse
import sys

import aiohttp
from aiohttp import web


def build_app(upstream: str) -> web.Application:
    app = web.Application()

    async def open_session(app: web.Application):
        app["session"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        )
        yield
        await app["session"].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with request.app["session"].post(
            upstream + "/v1/chat/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        ) as resp:
            if resp.content_type != "text/event-stream":
                return web.Response(
                    body=await resp.read(), status=resp.status, content_type=resp.content_type
                )
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            async for block in resp.content.iter_any():
                await out.write(block)
            await out.write_eof()
            return out

    app.cleanup_ctx.append(open_session)
    app.router.add_post("/v1/chat/completions", forward)
    app.router.add_get("/health", health)
    return app


async def health(request: web.Request) -> web.Response:
    return web.Response(text="{}", content_type="application/json")


def serve(app: web.Application, port: int) -> None:
    """`app` on 127.0.0.1:`port` on uvloop, no access log: as the bench's proxies run."""
    import uvloop

    web.run_app(
        app, host="127.0.0.1", port=port, access_log=None, print=None,
        loop=uvloop.new_event_loop(),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.passthrough")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args(argv)
    serve(build_app(args.upstream.rstrip("/")), args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
