"""A history of the run's gauges for the viewer's run page.

Every few seconds the watched metric families are read from the gateway's own Prometheus
registry (the policy version, ...) and from the run's other processes' `/metrics` named by
`--run-metrics` (the runner's `--metrics-port`: its pools' queues and waits, the engines' busy
fraction, rollouts ended; a bridge's trainer idle fraction), and kept in memory. A gauge is
kept as its value; a counter as its rate per second over the interval; a histogram or summary
as its mean over the interval (Δsum / Δcount, nothing when it saw no observation). When the
history is full every other sample goes, so it always spans the gateway's whole life, more
coarsely as it ages. Each gateway process keeps its own."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from gateway.app_keys import CONFIG, METRICS

log = logging.getLogger(__name__)

# Family name prefixes the run page plots: a family added under one of them shows with no
# change here.
WATCHED = ("rolltap_trainer_", "rolltap_runner_", "rolltap_pool_", "rolltap_engine_",
           "rolltap_policy_version", "rolltap_staleness")
INTERVAL_S = 5.0
SCRAPE_TIMEOUT_S = 2.0
MAX_SAMPLES = 720  # one hour at INTERVAL_S, then coarser


def series_name(name: str, labels: dict[str, str]) -> str:
    """Prometheus' own notation: name{label="value",...}."""
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


class MetricHistory:
    def __init__(self, registry: CollectorRegistry, sources: Iterable[str] = (), *,
                 watched: tuple[str, ...] = WATCHED, max_samples: int = MAX_SAMPLES) -> None:
        self.registry, self.sources = registry, tuple(sources)
        self.watched, self.max_samples = watched, max_samples
        self.times: list[float] = []
        self.points: list[dict[str, float]] = []
        self.unreachable: dict[str, str] = {}  # source URL: why its last scrape failed
        self._totals: dict[str, tuple[float, float]] = {}  # histograms: (sum, count)
        self._counted: dict[str, tuple[float, float]] = {}  # counters: (time, value)

    def _means(self, family: Metric, point: dict[str, float]) -> None:
        sums: dict[str, float] = {}
        counts: dict[str, float] = {}
        for s in family.samples:
            if s.name.endswith("_sum"):
                sums[series_name(family.name, s.labels)] = s.value
            elif s.name.endswith("_count"):
                counts[series_name(family.name, s.labels)] = s.value
        for key, total in sums.items():
            count = counts.get(key, 0.0)
            before_total, before_count = self._totals.get(key, (0.0, 0.0))
            if count > before_count:
                point[key + " mean"] = (total - before_total) / (count - before_count)
            self._totals[key] = (total, count)

    def _rates(self, family: Metric, now: float, point: dict[str, float]) -> None:
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            key = series_name(family.name, s.labels)
            before = self._counted.get(key)
            if before is not None and now > before[0] and s.value >= before[1]:
                point[key + " per s"] = (s.value - before[1]) / (now - before[0])
            self._counted[key] = (now, s.value)

    def sample(self, now: float, families: Iterable[Metric]) -> None:
        point: dict[str, float] = {}
        for family in families:
            if not family.name.startswith(self.watched):
                continue
            if family.type == "gauge":
                for s in family.samples:
                    # A counter's creation time, a family of its own once parsed from text.
                    if not s.name.endswith("_created"):
                        point[series_name(s.name, s.labels)] = s.value
            elif family.type == "counter":
                self._rates(family, now, point)
            elif family.type in ("histogram", "summary"):
                self._means(family, point)
        self.times.append(now)
        self.points.append(point)
        if len(self.times) > self.max_samples:
            # Every other sample, counted from the newest, which is always kept.
            keep = slice((len(self.times) - 1) % 2, None, 2)
            self.times, self.points = self.times[keep], self.points[keep]

    async def scrape(self, session: aiohttp.ClientSession, url: str) -> list[Metric]:
        try:
            async with session.get(url) as resp:
                resp.raise_for_status()
                families = list(text_string_to_metric_families(await resp.text()))
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            if url not in self.unreachable:
                log.warning("run metrics from %s: %r (retrying every %.0f s)", url, exc,
                            INTERVAL_S)
            self.unreachable[url] = repr(exc)
            return []
        self.unreachable.pop(url, None)
        return families

    async def sample_all(self, session: aiohttp.ClientSession) -> None:
        families = list(self.registry.collect())
        for found in await asyncio.gather(*(self.scrape(session, u) for u in self.sources)):
            families += found
        self.sample(time.time(), families)

    def series(self) -> dict[str, list[list[float]]]:
        """Each series' [time, value] points, oldest first (unix seconds)."""
        out: dict[str, list[list[float]]] = {}
        for t, point in zip(self.times, self.points, strict=True):
            for key, value in point.items():
                out.setdefault(key, []).append([t, value])
        return out


HISTORY = web.AppKey("metric_history", MetricHistory)


async def _sample_forever(history: MetricHistory, interval_s: float) -> None:
    timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while True:
            await history.sample_all(session)
            await asyncio.sleep(interval_s)


def install(app: web.Application, interval_s: float = INTERVAL_S) -> None:
    """Keep a history of the run's metrics while the app runs (after the runtime set METRICS
    and CONFIG)."""
    history = app[HISTORY] = MetricHistory(app[METRICS].registry, app[CONFIG].run_metrics)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(_sample_forever(history, interval_s))
        yield
        task.cancel()

    app.cleanup_ctx.append(lifecycle)
