"""`rolltap rollouts --metrics-port`: where a run's time goes, on a Prometheus `/metrics` of the
runner's own: each phase pool's slots in use, phases queued and total queue wait, the engines'
busy fraction (engine_busy.py), and the run's rollouts by how they ended."""

from __future__ import annotations

from collections import Counter

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from sandbox.engine_busy import EngineBusy
from sandbox.pools import PhasePools


class RunCollector:
    """Reads the run's live objects on each scrape."""

    def __init__(self, pools: PhasePools | None, engines: EngineBusy | None,
                 ended: Counter) -> None:
        self.pools, self.engines, self.ended = pools, engines, ended

    def collect(self):
        busy = GaugeMetricFamily("rolltap_runner_pool_busy", "phases holding a slot",
                                 labels=["pool"])
        waiting = GaugeMetricFamily("rolltap_runner_pool_waiting", "phases queued for a slot",
                                    labels=["pool"])
        wait = CounterMetricFamily("rolltap_runner_pool_queue_wait_seconds",
                                   "time phases queued for a slot", labels=["pool"])
        taken = CounterMetricFamily("rolltap_runner_pool_slots_taken", "slots taken",
                                    labels=["pool"])
        for name, s in (self.pools.stats() if self.pools else {}).items():
            busy.add_metric([name], s.busy)
            waiting.add_metric([name], s.waiting)
            wait.add_metric([name], s.wait_s)
            taken.add_metric([name], s.taken)
        yield from (busy, waiting, wait, taken)
        fraction = self.engines.fraction() if self.engines else None
        if fraction is not None:
            yield GaugeMetricFamily("rolltap_runner_engine_busy_fraction",
                                    "share of samples with a request running on the engines",
                                    value=fraction)
        ended = CounterMetricFamily("rolltap_runner_rollouts_ended", "rollouts by how they ended",
                                    labels=["status"])
        for status, n in self.ended.items():
            ended.add_metric([status], n)
        yield ended


async def serve(collector: RunCollector, port: int) -> web.AppRunner:
    """Serves GET /metrics on 127.0.0.1:`port` until the returned runner is cleaned up."""
    registry = CollectorRegistry()
    registry.register(collector)

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry),
                            headers={"Content-Type": "text/plain; version=0.0.4"})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner
