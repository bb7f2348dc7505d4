"""Where a sample passes from the rollout source to TRL's trainer: the queue the trainer drains,
the micro-batch the trainer holds open, and when that micro-batch is trained although it is
not full.

TRL's token-budget batcher closes a micro-batch only when a sample arrives that does not fit,
so without more samples the last ones of a finite run would wait, leased and untrained,
forever. Here the open micro-batch is trained as a step once no new sample has arrived for
`flush_after_s` (the bridge's --flush-after), and with `until_empty` the stream ends once the
source has nothing left to deliver, which ends the run.

A run has a last step (--max-steps), and a sample handed over after the last micro-batch is
taken but never trained. So the trainer tells `OpenBatch` how many micro-batches its run has
left, the batcher lends it a dry run of its own placement (`micro_batches`), and before the
feeder hands a group over `DeliveryQueue.fit` places it after what the trainer holds and what
is queued. A group that fits whole is handed over. One that does not is given back while the
trainer holds anything (`OpenBatch.closing`: the open micro-batch then trains as soon as the
queue is empty, and the group is looked at again once the trainer holds nothing). A group
bigger than all that is left of the run is handed over to an idle trainer: what fits trains,
the rest is given back at the end, and the run takes nothing more (`OpenBatch.taken_all`). The
batcher's iteration ends with the run's last micro-batch.

The trainer's thread drives all of it: TRL's queue reader calls `DeliveryQueue.get`, which
raises `FlushDue` or `StreamEnded` instead of waiting on; `FlushingBatcher` (TRL's batcher with
that one rule added) trains what it holds on the first and ends the epoch, and passes the second
on to the trainer, which stops. The source's feeder only reads `OpenBatch` (for the waiting
line) and sets `OpenBatch.source_empty`.
"""

from __future__ import annotations

import enum
import logging
import queue
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
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
    The trainer ends the run on it (`RolltapGRPOTrainer.get_batch_samples`); the message says
    why."""


class Held(msgspec.Struct, frozen=True):
    """The open micro-batch as TRL's packer counts it: samples, unique (forwarded) tokens and
    loss terms, over every row; each row holds at most the token budget of both."""

    samples: int = 0
    unique_tokens: int = 0
    loss_terms: int = 0
    rows_filled: int = 0  # rows with a sample: a micro-batch closes only with all of them
    rows: int = 1


# A sample as the batcher places it: the fields of TRL's sample dict its rows read.
Placed = dict[str, Any]
# The batcher's dry run: micro-batches that the samples held in the open rows (per row) and
# more samples after them make.
Planner = Callable[[Sequence[Sequence[Placed]], Iterable[Placed]], int]


def placed(sample: RolloutSample) -> Placed:
    return {"input_ids": sample.input_ids, "completion_mask": sample.completion_mask,
            "group_id": sample.group_id}


class Fit(enum.Enum):
    """How a run's remaining micro-batches take a group (`OpenBatch.fit`)."""

    WHOLE = "whole"  # every sample trains
    LATER = "later"  # not after what the trainer holds: give it back, look again when it is idle
    PART = "part"  # bigger than all the run has left, the trainer idle: what fits trains


class OpenBatch:
    """What the trainer holds between micro-batches, when it trains it anyway, and how many
    more the run trains."""

    def __init__(self, flush_after_s: float, until_empty: bool = False) -> None:
        self.flush_after_s = flush_after_s
        self.until_empty = until_empty
        self.held = Held()
        self.rows: tuple[tuple[Placed, ...], ...] = ()  # the open rows' samples
        # Set by the trainer as its run begins (None before, or without a last step).
        self.micro_batches_left: int | None = None
        self.planner: Planner | None = None  # lent by the batcher
        # Set by the feeder: the next group does not fit after what the trainer holds, so the
        # open micro-batch trains once the queue is empty; cleared once the trainer holds none.
        self.closing = False
        # Set by the feeder: the run took a group bigger than all it has left; no more comes.
        self.taken_all = False
        self.last_arrival = time.monotonic()
        # Set by the feeder: its last look found nothing deliverable and nothing queued.
        self.source_empty = False
        self.ended = False

    def arrived(self) -> None:
        self.last_arrival = time.monotonic()

    def report(self, rows: list[TreeRow]) -> None:
        self.rows = tuple(tuple(row.samples) for row in rows)
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
        if self.closing or self.taken_all:
            return 0.0  # nothing more comes for it
        return max(0.0, self.last_arrival + self.flush_after_s - time.monotonic())

    def idle_s(self) -> float:
        return time.monotonic() - self.last_arrival

    def emitted(self) -> int | None:
        """Counts a micro-batch the batcher handed on; returns how many the run has left."""
        if self.micro_batches_left is not None:
            self.micro_batches_left -= 1
        return self.micro_batches_left

    def run_full(self) -> bool:
        """The run has taken all it trains: its last micro-batch is out, or it took a group
        bigger than what it had left."""
        return self.taken_all or self.micro_batches_left == 0

    def waiting_for_trainer(self) -> bool:
        """The batcher is built but its run has not said how much it trains: take nothing yet."""
        return self.planner is not None and self.micro_batches_left is None

    def fit(self, queued: Sequence[RolloutSample], group: Sequence[RolloutSample]) -> Fit:
        """How the run's remaining micro-batches take `group` after what the trainer holds and
        what is `queued` before it."""
        left, plan, rows = self.micro_batches_left, self.planner, self.rows
        if left is None or plan is None:
            return Fit.WHOLE
        held = sum(map(len, rows)) + len(queued)
        # Every micro-batch holds a sample, so this many samples fit in any packing.
        if held + len(group) <= left or plan(rows, map(placed, [*queued, *group])) <= left:
            return Fit.WHOLE
        return Fit.PART if held == 0 and left > 0 else Fit.LATER


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

    def fit(self, group: Sequence[RolloutSample]) -> Fit:
        """`OpenBatch.fit` for `group` after the samples queued now."""
        with self.mutex:
            queued = list(self.queue)
        return self.open_batch.fit(queued, group)

    def drained(self) -> bool:
        """The trainer holds no sample in its open micro-batch and none is queued."""
        return not self.open_batch.held.samples and self.empty()

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
            raise StreamEnded("nothing left to deliver (--until-empty)")


def _sooner(left: float | None, flush_in: float | None) -> float | None:
    if flush_in is None:
        return left
    return flush_in if left is None else min(left, flush_in)


class FlushingBatcher(TokenBudgetBatcher):
    """TRL's token-budget batcher (rows of unique tokens and loss terms within the budget,
    balanced, a group's samples together) plus three rules: the open micro-batch is emitted
    when the queue says `FlushDue`, the iteration ends for good on `StreamEnded`, and it ends
    after the run's last micro-batch."""

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
        open_batch.planner = self.micro_batches

    def __iter__(self) -> Iterator[list[TreeRow]]:  # pyright: ignore[reportIncompatibleMethodOverride]
        rows = self._fresh()
        try:
            for sample in self.dataset:
                rows, closed = self._add(rows, sample)
                if closed is not None:
                    yield closed
                    if self.open_batch.emitted() == 0:
                        # The run's last: accelerate's dispatcher, which holds one micro-batch
                        # until it has the next, hands it over only once the iteration ends.
                        return
        except FlushDue:
            if self.open_batch.closing:
                log.info("training a micro-batch of %d samples: the next group fits only after "
                         "it", self.open_batch.held.samples)
            else:
                log.info("training a partial micro-batch of %d samples: no new sample for "
                         "%.0f s", self.open_batch.held.samples, self.open_batch.flush_after_s)
            yield rows
            self.open_batch.emitted()
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
        rows, closed = self._put(rows, sample)
        self.open_batch.report(rows)
        return rows, closed

    def _put(
        self, rows: list[TreeRow], sample: Placed
    ) -> tuple[list[TreeRow], list[TreeRow] | None]:
        closed = None
        row = self._place(rows, sample)
        if row is None:
            closed, rows = rows, [TreeRow() for _ in range(self.num_processes)]
            # A sample within the budget fits an empty row.
            row = self._place(rows, sample) or rows[0]
        row.add(sample)
        return rows, closed

    def micro_batches(self, held: Sequence[Sequence[Placed]], more: Iterable[Placed]) -> int:
        """The micro-batches the samples `held` in the open rows and `more` after them make,
        placed as the iteration would place them (a dry run, on rows of its own)."""
        rows = [TreeRow() for _ in range(self.num_processes)]
        for row, samples in zip(rows, held, strict=False):
            for sample in samples:
                row.add(sample)
        closed = 0
        for sample in more:
            if len(sample["input_ids"]) <= self.token_budget:
                rows, done = self._put(rows, sample)
                closed += done is not None
        return closed + any(row.samples for row in rows)
