"""A `DeliveryWorker` over a fixed list of synthetic samples, for trainer tests that need no
database: it numbers and queues them all at start, through the bridge's own `DeliveryQueue` and
`OpenBatch`, and records what each step acknowledges. (A test double of the rollout source:
the real one is tested on Postgres in tests/integration/bridge/test_bridge_source.py.)"""

from __future__ import annotations

import queue
from collections.abc import Sequence

import numpy as np

from tests.support.sequences import Seq
from trainer_bridge.handover import DeliveryQueue, OpenBatch
from trainer_bridge.samples import rollout_samples
from trainer_bridge.worker import DELIVERY_KEY, VERSIONS_KEY


def synthetic_samples(groups: int, size: int, *, prompt: int = 12, completion: int = 8,
                      vocab: int = 256, seed: int = 0) -> list:
    """`groups` groups of `size` one-sequence rollouts: a shared prompt, then a sampled reply."""
    rng = np.random.default_rng(seed)
    samples = []
    for group in range(groups):
        shared = rng.integers(0, vocab, prompt)
        for member in range(size):
            ids = np.r_[shared, rng.integers(0, vocab, completion)].astype(np.int32)
            mask = np.r_[np.zeros(prompt, np.uint8), np.ones(completion, np.uint8)]
            seq = Seq(ids, mask, np.where(mask, -5.5, 0).astype(np.float32),
                      np.where(mask, 1, -1).astype(np.int32))
            kept, _ = rollout_samples([seq], advantage=1.0 if member % 2 else -1.0,
                                      group_id=group, max_tokens=10**6)
            samples += kept
    return samples


class ListDeliveryWorker:
    def __init__(self, samples: Sequence, *, flush_after_s: float = 1.0,
                 until_empty: bool = False) -> None:
        self.samples = list(samples)
        self.open_batch = OpenBatch(flush_after_s, until_empty)
        self.rollout_buffer = DeliveryQueue(lambda sample: sample, self.open_batch)
        self.metrics_queue: queue.Queue = queue.Queue()
        self.acknowledged: list[tuple[int, list[int]]] = []
        self.faults: list[list[int]] = []
        self.versions: list[int] = []
        self.running = False

    def start(self) -> None:
        self.running = True
        for number, sample in enumerate(self.samples):
            sample.metrics[DELIVERY_KEY] = float(number)
            # As the source's last look gives them: every trained token sampled at version 1.
            sample.metrics[VERSIONS_KEY] = np.where(sample.completion_mask, 1, -1)
            self.rollout_buffer.put_nowait(sample)
        self.open_batch.source_empty = True

    def stop(self) -> None:
        self.running = False

    def update_model_version(self, model_version: int) -> None:
        self.versions.append(model_version)

    def check_health(self, stale_after_s: float) -> None:
        if not self.running:
            raise RuntimeError("the list worker is not running")

    def acknowledge(self, step: int, keys: Sequence[int]) -> None:
        self.acknowledged.append((step, sorted(keys)))

    def fault(self, keys: Sequence[int]) -> None:
        self.faults.append(list(keys))

    def trained(self) -> list[int]:
        return sorted(key for _, keys in self.acknowledged for key in keys)
