"""How busy the engines are while a run goes: the share of time each vLLM had at least one
request running, sampled from its Prometheus `/metrics` (`vllm:num_requests_running`).

A low fraction with a starved trainer means the time goes elsewhere (sandbox setup, verifiers,
the slowest member of a group); a high one means the engines are the limit."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp

SAMPLE_EVERY_S = 0.5
RUNNING = "vllm:num_requests_running"


def running_requests(text: str) -> float | None:
    """The engine's running requests (summed over its models), from its metrics text."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(RUNNING)]
    return sum(values) if values else None


class EngineBusy:
    """Samples every engine in `urls` (vLLM base URLs) until stopped."""

    def __init__(self, urls: list[str], every_s: float = SAMPLE_EVERY_S) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.every_s = every_s
        self.samples = dict.fromkeys(self.urls, 0)
        self.busy = dict.fromkeys(self.urls, 0)
        self.failures = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.urls:
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def fraction(self) -> float | None:
        """Busy samples over all samples, every engine weighed alike (None: none taken)."""
        taken = sum(self.samples.values())
        return sum(self.busy.values()) / taken if taken else None

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                await asyncio.gather(*(self._sample(session, url) for url in self.urls))
                await asyncio.sleep(self.every_s)

    async def _sample(self, session: aiohttp.ClientSession, url: str) -> None:
        try:
            async with session.get(url + "/metrics") as r:
                running = running_requests(await r.text())
        except (aiohttp.ClientError, TimeoutError):
            self.failures += 1
            return
        if running is None:
            self.failures += 1
            return
        self.samples[url] += 1
        self.busy[url] += running > 0
