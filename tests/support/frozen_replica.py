"""A FAULT STAND-IN for a vLLM replica: a few lines of aiohttp that answer /health and
/v1/models and hold every model request open without a byte. For tests whose subject is that
fault (or the gateway's own probing), which a real engine cannot be made to show on demand."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web

from tests.support.gateway import free_port


class FrozenReplica:
    """Answers /health and /v1/models; holds every model request open without a byte."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.healthy = True
        self.held = 0
        self.health_probes = 0
        self.first_bytes = b""  # sent on a stream before the silence
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        threading.Thread(target=self._serve, args=(started,), daemon=True).start()
        assert started.wait(10)

    def _serve(self, started: threading.Event) -> None:
        async def health(_request):
            self.health_probes += 1
            return web.Response(status=200 if self.healthy else 503)

        async def models(_request):
            return web.json_response({"data": [{"id": "tiny"}]})

        async def hold(request):
            self.held += 1
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            if (await request.json()).get("stream"):
                await response.prepare(request)  # headers, then silence (as vLLM's stream)
                if self.first_bytes:
                    await response.write(self.first_bytes)
            await asyncio.sleep(3600)
            return response

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/chat/completions", hold)

        async def main():
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            started.set()
            await asyncio.Event().wait()

        self._loop.run_until_complete(main())
