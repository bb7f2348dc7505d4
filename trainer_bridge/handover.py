"""Where a sample passes from the rollout source to TRL's trainer: the queue the trainer drains,
the micro-batch the trainer holds open, and when that micro-batch is trained although it is
not full.

TRL's token-budget batcher closes a micro-batch only when a sample arrives that does not fit,
so without more samples the last ones of a finite run would wait, leased and untrained,
forever. Here the open micro-batch is trained as a step once no new sample has arrived for
`flush_after_s` (the bridge's --flush-after), and with `until_empty` the stream ends once the
source has nothing left to deliver, which ends the run.

The trainer's thread drives all of it: TRL's queue reader calls `DeliveryQueue.get`, which
raises `FlushDue` or `StreamEnded` instead of waiting on; `FlushingBatcher` (TRL's batcher with
that one rule added) trains what it holds on the first and ends the epoch, and passes the second
on to the trainer, which stops. The source's feeder only reads `OpenBatch` (for the waiting
line) and sets `OpenBatch.source_empty`.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
from trl.experimental.async_grpo.async_grpo_trainer import RolloutQueueDataset, TokenBudgetBatcher
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample
from trl.experimental.async_grpo.packing import TreeRow

log = logging.getLogger(__name__)


class FlushDue(Exception):
    """No new sample for `flush_after_s` while a micro-batch is open: train it now."""


class StreamEnded(Exception):
    """`until_empty`: the source has nothing left, and the trainer holds nothing (so neither
    does accelerate's dispatcher: it holds a micro-batch only while the one after it is open).
    The trainer ends the run on it (`RolltapGRPOTrainer.get_batch_samples`)."""


class Held(msgspec.Struct, frozen=True):
    """The open micro-batch as TRL's packer counts it: samples, unique (forwarded) tokens and
    loss terms, over every row; each row holds at most the token budget of both."""

    samples: int = 0
    unique_tokens: int = 0
    loss_terms: int = 0
    rows_filled: int = 0  # rows with a sample: a micro-batch closes only with all of them
    rows: int = 1


class OpenBatch:
    """What the trainer holds between micro-batches, and when it trains it anyway."""

    def __init__(self, flush_after_s: float, until_empty: bool = False) -> None:
        self.flush_after_s = flush_after_s
        self.until_empty = until_empty
        self.held = Held()
        self.last_arrival = time.monotonic()
        # Set by the feeder: its last look found nothing deliverable and nothing queued.
        self.source_empty = False
        self.ended = False

    def arrived(self) -> None:
        self.last_arrival = time.monotonic()

    def report(self, rows: list[TreeRow]) -> None:
        self.held = Held(
            samples=sum(len(row.samples) for row in rows),
            unique_tokens=sum(len(row.tokens) for row in rows),
            loss_terms=sum(row.trained for row in rows),
            rows_filled=sum(bool(row.samples) for row in rows),
            rows=len(rows),
        )

    def flushable(self) -> bool:
        held = self.held
        return held.samples > 0 and held.rows_filled == held.rows

    def flush_in(self) -> float | None:
        """Seconds until the open micro-batch trains as it is; None while none can."""
        if not self.flushable():
            return None
        return max(0.0, self.last_arrival + self.flush_after_s - time.monotonic())

    def idle_s(self) -> float:
        return time.monotonic() - self.last_arrival


class DeliveryQueue(queue.Queue[RolloutSample]):
    """The trainer's sample queue: each sample taken off it passes `take` first, which may
    change it (staleness mask) or put it aside (None), then the next one is looked at. While
    the trainer waits, an open micro-batch due to train raises `FlushDue`, and an exhausted
    source (`until_empty`) raises `StreamEnded`."""

    def __init__(
        self, take: Callable[[RolloutSample], RolloutSample | None], open_batch: OpenBatch
    ) -> None:
        super().__init__()
        self._take = take
        self.open_batch = open_batch
        # The trainer is blocked here for its next sample (not busy with a step).
        self.trainer_waiting = False
        # The trainer's idle time: blocked here, from its first request for a sample on.
        self.idle_s = 0.0
        self.first_get: float | None = None

    def idle_fraction(self) -> float | None:
        """The share of the trainer's wall time since its first request spent waiting for
        samples (None before that request): near 1, training is starved by the rollouts."""
        if self.first_get is None:
            return None
        wall = time.monotonic() - self.first_get
        return min(1.0, self.idle_s / wall) if wall > 0 else None

    def get(self, block: bool = True, timeout: float | None = None) -> RolloutSample:
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        self.first_get = self.first_get or now
        self.trainer_waiting = True
        try:
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                flush_in = self.open_batch.flush_in()
                try:
                    raw = super().get(block, _sooner(left, flush_in))
                except queue.Empty:
                    self._raise_if_due()
                    if not block or (deadline is not None and time.monotonic() >= deadline):
                        raise
                    continue
                self.open_batch.arrived()
                sample = self._take(raw)
                if sample is not None:
                    return sample
        finally:
            self.trainer_waiting = False
            self.idle_s += time.monotonic() - now

    def _raise_if_due(self) -> None:
        batch = self.open_batch
        if batch.flush_in() == 0.0:
            raise FlushDue
        if (batch.until_empty and batch.source_empty and not batch.held.samples
                and self.empty() and batch.idle_s() >= batch.flush_after_s):
            raise StreamEnded


def _sooner(left: float | None, flush_in: float | None) -> float | None:
    if flush_in is None:
        return left
    return flush_in if left is None else min(left, flush_in)


class FlushingBatcher(TokenBudgetBatcher):
    """TRL's token-budget batcher (rows of unique tokens and loss terms within the budget,
    balanced, a group's samples together) plus one rule: the open micro-batch is emitted when
    the queue says `FlushDue`, and the iteration ends for good on `StreamEnded`."""

    def __init__(
        self,
        dataset: RolloutQueueDataset,
        num_processes: int,
        token_budget: int,
        metrics: dict[str, Any],
        open_batch: OpenBatch,
    ) -> None:
        super().__init__(dataset, num_processes, token_budget, metrics)
        self.open_batch = open_batch

    def __iter__(self) -> Iterator[list[TreeRow]]:  # pyright: ignore[reportIncompatibleMethodOverride]
        rows = self._fresh()
        try:
            for sample in self.dataset:
                rows, closed = self._add(rows, sample)
                if closed is not None:
                    yield closed
        except FlushDue:
            log.info("training a partial micro-batch of %d samples: no new sample for %.0f s",
                     self.open_batch.held.samples, self.open_batch.flush_after_s)
            yield rows
            self._fresh()
            # Accelerate's dispatcher fetches a micro-batch ahead before it hands one over: the
            # iteration (the trainer's epoch) ends here, so it hands over both it holds. The
            # trainer's next epoch iterates anew.
        except StreamEnded:
            self.open_batch.ended = True
            raise

    def _fresh(self) -> list[TreeRow]:
        rows = [TreeRow() for _ in range(self.num_processes)]
        self.open_batch.report(rows)
        return rows

    def _add(
        self, rows: list[TreeRow], sample: dict[str, Any]
    ) -> tuple[list[TreeRow], list[TreeRow] | None]:
        """TRL's placement of one sample: the open rows after it, and the micro-batch it
        closed, if it fit in no row."""
        n = len(sample["input_ids"])
        if n > self.token_budget:
            log.warning("dropping a rollout sample of %d tokens over token_budget=%d", n,
                        self.token_budget)
            self.metrics["batch/dropped_oversize_total"].append(1.0)
            return rows, None
        closed = None
        placed = self._place(rows, sample)
        if placed is None:
            closed, rows = rows, [TreeRow() for _ in range(self.num_processes)]
            # A sample within the budget fits an empty row.
            placed = self._place(rows, sample) or rows[0]
        placed.add(sample)
        self.open_batch.report(rows)
        return rows, closed
