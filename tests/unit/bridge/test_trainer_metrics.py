"""The bridge's /metrics (trainer_bridge/metrics.py) reads the live queue and counts on each
scrape; the idle fraction appears once the trainer has asked for a sample."""

from __future__ import annotations

import queue
from collections import Counter

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trainer_bridge.handover import DeliveryQueue, OpenBatch
from trainer_bridge.metrics import TrainerCollector


def scrape(registry: CollectorRegistry) -> dict[str, float]:
    text = generate_latest(registry).decode()
    return {s.name + "".join(f"/{v}" for v in s.labels.values()): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_scrape_reads_the_queue_the_counts_and_the_steps_as_they_are_now():
    deliveries = DeliveryQueue(lambda sample: sample, OpenBatch(60))
    stats: Counter[str] = Counter()
    steps = [0]
    registry = CollectorRegistry()
    registry.register(TrainerCollector(deliveries, stats, lambda: steps[0]))
    before = scrape(registry)
    assert "rolltap_trainer_idle_fraction" not in before  # the trainer has not asked yet
    assert before["rolltap_trainer_steps_total"] == 0

    with pytest.raises(queue.Empty):
        deliveries.get(timeout=0.05)  # the trainer waits for a sample that does not come
    deliveries.put_nowait("a sample")
    stats.update(samples=5, trained_samples=3, rollouts=2, stale_tokens=7)
    steps[0] = 4
    after = scrape(registry)
    assert 0 < after["rolltap_trainer_idle_fraction"] <= 1
    assert after["rolltap_trainer_queued_samples"] == 1
    assert after["rolltap_trainer_samples_total/handed_over"] == 5
    assert after["rolltap_trainer_samples_total/trained"] == 3
    assert after["rolltap_trainer_rollouts_total"] == 2
    assert after["rolltap_trainer_stale_tokens_total"] == 7
    assert after["rolltap_trainer_steps_total"] == 4
