"""`rolltap bridge --metrics-port`: the trainer's side of where a run's time goes, on a
Prometheus `/metrics` of the bridge's own, for dashboards and the viewer's run page (the
gateway's `--run-metrics`): the fraction of its wall time the trainer sat waiting for samples,
its optimizer steps, the samples queued for it, taken and trained, the rollouts they came from
and the tokens masked as stale. Read from the live objects on each scrape."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from trainer_bridge.handover import DeliveryQueue


class TrainerCollector:
    def __init__(self, queue: DeliveryQueue, stats: Counter[str], steps: Callable[[], int]) -> None:
        self.queue, self.stats, self.steps = queue, stats, steps

    def collect(self) -> Iterator[Metric]:
        idle = self.queue.idle_fraction()
        if idle is not None:  # before the trainer first asks for a sample there is no wall time
            yield GaugeMetricFamily(
                "rolltap_trainer_idle_fraction",
                "share of the trainer's wall time since its first request spent waiting for "
                "samples", value=idle)
        yield CounterMetricFamily("rolltap_trainer_steps", "optimizer steps done",
                                  value=self.steps())
        yield GaugeMetricFamily("rolltap_trainer_queued_samples",
                                "samples handed over, not yet taken by the trainer",
                                value=self.queue.qsize())
        samples = CounterMetricFamily("rolltap_trainer_samples",
                                      "samples handed to the trainer, and those a step trained",
                                      labels=["what"])
        samples.add_metric(["handed_over"], self.stats["samples"])
        samples.add_metric(["trained"], self.stats["trained_samples"])
        yield samples
        yield CounterMetricFamily("rolltap_trainer_rollouts", "rollouts delivered in samples",
                                  value=self.stats["rollouts"])
        yield CounterMetricFamily("rolltap_trainer_stale_tokens",
                                  "tokens masked out of the loss as too stale",
                                  value=self.stats["stale_tokens"])


def serve(collector: TrainerCollector, port: int) -> WSGIServer:
    """Serves GET /metrics on 127.0.0.1:`port` from a thread of its own; `shutdown()` ends it."""
    registry = CollectorRegistry()
    registry.register(collector)
    server, _thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    return server
