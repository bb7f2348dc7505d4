"""A history of the gateway's run gauges for the viewer's run page.

Every few seconds the watched metric families (the trainer's idle fraction, each pool's queue
wait, the engines' busy fraction, the policy version: whatever of them the gateway's Prometheus
registry holds) are read and kept in memory. A gauge is kept as its value; a histogram or
summary as its mean over the interval since the last sample (Δsum / Δcount, nothing when it
saw no observation). When the history is full every other sample goes, so it always spans the
gateway's whole life, more coarsely as it ages. Each gateway process keeps its own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from gateway.app_keys import METRICS

# Family name prefixes the run page plots (rolltap_pool_queue_wait_seconds{pool=...},
# rolltap_trainer_idle_fraction, ...): a family added under one of them shows with no change here.
WATCHED = ("rolltap_trainer_", "rolltap_pool_", "rolltap_engine_", "rolltap_policy_version",
           "rolltap_staleness")
INTERVAL_S = 5.0
MAX_SAMPLES = 720  # one hour at INTERVAL_S, then coarser


def series_name(name: str, labels: dict[str, str]) -> str:
    """Prometheus' own notation: name{label="value",...}."""
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


class MetricHistory:
    def __init__(self, registry: CollectorRegistry, *, watched: tuple[str, ...] = WATCHED,
                 max_samples: int = MAX_SAMPLES) -> None:
        self.registry, self.watched, self.max_samples = registry, watched, max_samples
        self.times: list[float] = []
        self.points: list[dict[str, float]] = []
        self._totals: dict[str, tuple[float, float]] = {}  # histogram series: (sum, count)

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

    def sample(self, now: float) -> None:
        point: dict[str, float] = {}
        for family in self.registry.collect():
            if not family.name.startswith(self.watched):
                continue
            if family.type == "gauge":
                for s in family.samples:
                    point[series_name(s.name, s.labels)] = s.value
            elif family.type in ("histogram", "summary"):
                self._means(family, point)
        self.times.append(now)
        self.points.append(point)
        if len(self.times) > self.max_samples:
            # Every other sample, counted from the newest, which is always kept.
            keep = slice((len(self.times) - 1) % 2, None, 2)
            self.times, self.points = self.times[keep], self.points[keep]

    def series(self) -> dict[str, list[list[float]]]:
        """Each series' [time, value] points, oldest first (unix seconds)."""
        out: dict[str, list[list[float]]] = {}
        for t, point in zip(self.times, self.points, strict=True):
            for key, value in point.items():
                out.setdefault(key, []).append([t, value])
        return out


HISTORY = web.AppKey("metric_history", MetricHistory)


async def _sample_forever(history: MetricHistory, interval_s: float) -> None:
    while True:
        history.sample(time.time())
        await asyncio.sleep(interval_s)


def install(app: web.Application, interval_s: float = INTERVAL_S) -> None:
    """Keep a history of the app's metrics while it runs (after the runtime set METRICS)."""
    history = app[HISTORY] = MetricHistory(app[METRICS].registry)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(_sample_forever(history, interval_s))
        yield
        task.cancel()

    app.cleanup_ctx.append(lifecycle)
