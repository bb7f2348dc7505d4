"""What the trainer sees of the bridge: TRL's rollout-worker protocol, and the extension the
bridge's trainer (trainer_bridge/trainer.py) uses when the worker declares it.

TRL's `AsyncGRPOTrainer` drains `rollout_buffer`, reads `metrics_queue`, and calls `start`,
`stop`, `update_model_version` and `check_health`. A `DeliveryWorker` also hears which samples
each optimizer step took (`acknowledge`, after the step: delivery is logged then, not when a
sample is queued) and which ones the trainer failed on (`fault`), and shares the micro-batch the
trainer holds open (`open_batch`), so a partial one trains once no sample comes. The trainer
checks for it with `isinstance`; a plain TRL worker trains without any of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from trl.experimental.async_grpo.async_grpo_trainer import RolloutWorkerProtocol

from trainer_bridge.handover import OpenBatch

# The source's number for a sample, in `RolloutSample.metrics` (the one free-form field that
# reaches TRL's collator); the trainer's collator takes it out before TRL logs the metrics.
DELIVERY_KEY = "rolltap/delivery"
# Each token's policy version (in the trainer's count, -1 on context), the same way: the
# collator lines them up with TRL's loss terms so that sampler/trainer agreement can be taken
# over the tokens the trainer's current weights sampled.
VERSIONS_KEY = "rolltap/versions"


@runtime_checkable
class DeliveryWorker(RolloutWorkerProtocol, Protocol):
    """A rollout worker whose samples are delivered once an optimizer step took them."""

    open_batch: OpenBatch

    def acknowledge(self, step: int, keys: Sequence[int]) -> None:
        """Optimizer step `step` took the samples numbered `keys` (their `DELIVERY_KEY`):
        returns once that is durable."""
        ...

    def fault(self, keys: Sequence[int]) -> None:
        """The trainer failed on the samples numbered `keys`: a fault of their groups."""
        ...
