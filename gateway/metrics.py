"""Prometheus metrics of one gateway process (`GET /metrics`, admin key).

Counters and histograms move as calls happen. Replica state, the recorder's queue and the
policy version are read when scraped. Rollouts by status and merge statistics by harness come
from the database at scrape time (cached briefly); they describe the whole run, so every
gateway reports the same values: aggregate them with max(), not sum().
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from core.store.calls import CallRecord
from core.store.ledger import CAUSES as LEDGER_CAUSES
from gateway.stage_cpu import StageCpu

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_FORK_CAUSES = ("drift", "rewrite", "independent", "abandoned")
_DB_REFRESH_S = 10.0


class _Replicas(Collector):
    def __init__(self, replicas: Callable[[], Iterable]) -> None:
        self._replicas = replicas

    def collect(self):
        healthy = GaugeMetricFamily(
            "rolltap_replica_healthy",
            "1 if the replica takes new calls; 0 if ejected by health checks or draining",
            labels=["replica", "state"],
        )
        in_flight = GaugeMetricFamily(
            "rolltap_replica_in_flight", "calls in flight to the replica", labels=["replica"]
        )
        failures = GaugeMetricFamily(
            "rolltap_replica_consecutive_failures",
            "failed probes and calls since the replica's last success",
            labels=["replica"],
        )
        paused = GaugeMetricFamily(
            "rolltap_replica_paused_since_seconds",
            "unix time since which the replica is paused (a weight push); 0 if it is not",
            labels=["replica"],
        )
        for r in self._replicas():
            state = r.describe()["state"]
            healthy.add_metric([r.url, state], 1.0 if state == "healthy" else 0.0)
            in_flight.add_metric([r.url], r.in_flight)
            failures.add_metric([r.url], r.health.failures)
            paused.add_metric([r.url], r.paused_since or 0.0)
        yield from (healthy, in_flight, failures, paused)


class _StageCpu(Collector):
    def __init__(self, cpu: StageCpu) -> None:
        self._cpu = cpu

    def collect(self):
        seconds = CounterMetricFamily(
            "rolltap_stage_cpu_seconds",
            "the gateway's own CPU in each stage of its model calls (gateway.stage_cpu)",
            labels=["stage"],
        )
        for stage, ns in self._cpu.ns.items():
            seconds.add_metric([stage], ns / 1e9)
        calls = CounterMetricFamily("rolltap_stage_cpu_calls", "model calls the stages measured")
        calls.add_metric([], self._cpu.calls)
        yield from (seconds, calls)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "rolltap_requests", "HTTP requests served", ["protocol", "route", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "rolltap_request_seconds", "time to serve a request, to its last byte",
            ["protocol", "route"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.ttft_seconds = Histogram(
            "rolltap_ttft_seconds", "model calls: time to the first sampled token",
            ["protocol"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.calls = Counter(
            "rolltap_calls", "model calls recorded", ["protocol", "status"], registry=r
        )
        self.rerouted = Counter(
            "rolltap_calls_rerouted", "model calls sent away from their rollout's replica",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "rolltap_prompt_tokens", "prompt tokens of recorded calls", ["protocol"], registry=r
        )
        self.sampled_tokens = Counter(
            "rolltap_sampled_tokens", "sampled tokens of recorded calls", ["protocol"],
            registry=r,
        )
        self.continuation = Counter(
            "rolltap_continuation_paths", "how continuing calls were prompted", ["path"],
            registry=r,
        )
        self.commit_seconds = Histogram(
            "rolltap_commit_seconds", "one group commit of call records",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5), registry=r,
        )
        self.batch_size = Histogram(
            "rolltap_recorder_batch_size", "call records per group commit",
            buckets=_BATCH_BUCKETS, registry=r,
        )
        self.request_decodes = Counter(
            "rolltap_request_decodes",
            "model call bodies decoded, whole or resumed from an earlier request's",
            ["protocol", "how"], registry=r,
        )
        self.rejected = Counter(
            "rolltap_rejected", "model calls refused before reaching a replica", ["reason"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "rolltap_recorder_queue_depth", "call records waiting for a commit", registry=r
        )
        self.in_flight = Gauge("rolltap_in_flight", "model calls in flight here", registry=r)
        self.policy_version = Gauge(
            "rolltap_policy_version", "policy version stamped on new tokens", registry=r
        )
        self.rollouts = Gauge(
            "rolltap_rollouts", "rollouts in the database by status", ["status"], registry=r
        )
        self.forks = Gauge(
            "rolltap_merge_forks", "merged sequences started by each fork cause, by harness",
            ["harness", "cause"], registry=r,
        )
        self.lost_tokens = Gauge(
            "rolltap_merge_lost_tokens", "sampled tokens not trained after merging, by harness",
            ["harness"], registry=r,
        )
        self.consumed_tokens = Gauge(
            "rolltap_consumed_trained_tokens",
            "tokens of rollouts a trainer bridge consumed that went to the loss",
            registry=r,
        )
        self.excluded_tokens = Gauge(
            "rolltap_consumed_excluded_tokens",
            "sampled tokens of consumed rollouts that did not train, by cause",
            ["cause"], registry=r,
        )
        self._db_read = 0.0
        # Labelled children, looked up once: `labels()` takes a lock and hashes every call.
        self._children: dict[tuple, tuple] = {}

    def watch(self, replicas: Callable[[], Iterable], queue_depth: Callable[[], int],
              in_flight: Callable[[], int], policy_version: Callable[[], int],
              stage_cpu: StageCpu) -> None:
        """Values read from the live gateway at scrape time."""
        self.registry.register(_Replicas(replicas))
        self.registry.register(_StageCpu(stage_cpu))
        self.queue_depth.set_function(queue_depth)
        self.in_flight.set_function(in_flight)
        self.policy_version.set_function(policy_version)

    def _child(self, key: tuple, make: Callable[[], tuple]) -> tuple:
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = make()
        return found

    def request_done(self, protocol: str, route: str, status: int, seconds: float) -> None:
        count, = self._child(
            ("req", protocol, route, status),
            lambda: (self.requests.labels(protocol, route, str(status)),),
        )
        count.inc()
        timing, = self._child(
            ("lat", protocol, route), lambda: (self.request_seconds.labels(protocol, route),)
        )
        timing.observe(seconds)

    def request_decoded(self, protocol: str, resumed: bool) -> None:
        how = "resumed" if resumed else "whole"
        self._child(
            ("decode", protocol, how), lambda: (self.request_decodes.labels(protocol, how),)
        )[0].inc()

    def call_recorded(self, rec: CallRecord) -> None:
        p = rec.protocol
        calls, prompt, sampled, ttft = self._child(("call", p, rec.status), lambda: (
            self.calls.labels(p, rec.status), self.prompt_tokens.labels(p),
            self.sampled_tokens.labels(p), self.ttft_seconds.labels(p),
        ))
        calls.inc()
        prompt.inc(rec.prompt_len)
        sampled.inc(len(rec.completion_ids) // 4)
        if rec.ttft_ms is not None:
            ttft.observe(rec.ttft_ms / 1000)
        if rec.rerouted:
            self.rerouted.inc()
        if rec.continuation:
            path = rec.continuation["path"]
            self._child(("cont", path), lambda: (self.continuation.labels(path),))[0].inc()

    def committed(self, batch: int, seconds: float) -> None:
        self.batch_size.observe(batch)
        self.commit_seconds.observe(seconds)

    def due_for_database(self) -> bool:
        return time.monotonic() - self._db_read > _DB_REFRESH_S

    def database_values(self, statuses: Iterable, harnesses: Iterable, ledger: Iterable) -> None:
        """`ledger`: (cause, tokens) summed over consumed rollouts; cause None for trained."""
        self._db_read = time.monotonic()
        self.consumed_tokens.set(0)
        self.excluded_tokens.clear()
        for cause in LEDGER_CAUSES:
            self.excluded_tokens.labels(cause).set(0)
        for cause, tokens in ledger:
            if cause is None:
                self.consumed_tokens.set(tokens)
            else:
                self.excluded_tokens.labels(cause).set(tokens)
        self.rollouts.clear()
        for row in statuses:
            self.rollouts.labels(row["status"]).set(row["count"])
        self.forks.clear()
        self.lost_tokens.clear()
        for row in harnesses:
            for cause in _FORK_CAUSES:
                self.forks.labels(row["harness"], cause).set(row[cause] or 0)
            self.lost_tokens.labels(row["harness"]).set(row["lost_tokens"] or 0)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
