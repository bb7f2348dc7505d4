"""The samples out for delivery and the leases of their rollouts: the one state the feeder thread
and the trainer's thread share, behind the one lock.

The feeder adds each released group's samples (`add`), renews the leases of rollouts with
samples out and gives back the abandoned ones (`leases_due`, `renewed`, `given_back`). The
trainer takes samples (`take`: the lease must be confirmed for half its length, stale tokens
are masked) and acknowledges steps (`step_entries`, then `stepped` once the log holds them).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from uuid import UUID

import numpy as np
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from trainer_bridge.release import Entry, GroupBatch, Pending, mask_stale
from trainer_bridge.worker import DELIVERY_KEY, VERSIONS_KEY

Metric = dict[str, float]


class Outstanding:
    """Samples numbered for the trainer, not in a logged step yet, and their rollouts' leases.
    `stats` and `consumed` (the ledgers of consumed rollouts, summed) are read for summaries."""

    def __init__(self, lease_s: float, max_staleness: int) -> None:
        self.lease_s = lease_s
        self.max_staleness = max_staleness
        self.model_version = 0
        self.stats: Counter[str] = Counter()
        self.consumed: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._numbers = itertools.count()
        self._pending: dict[int, Pending] = {}
        self._put_aside: list[Entry] = []  # logged with the next step
        self._lease_until: dict[UUID, float] = {}  # monotonic time each lease is confirmed to
        self._abandoned: set[UUID] = set()  # leases to give back once nothing of theirs is out
        self._accounted: set[UUID] = set()

    def count(self, **counts: int) -> None:
        with self._lock:
            self.stats.update(counts)

    def add(self, batch: GroupBatch, claimed_at: float) -> None:
        """Number a released group's samples (in their metrics) and hold their leases as
        confirmed from the claim on."""
        now = time.time()
        with self._lock:
            for sample, out in zip(batch.samples, batch.pending, strict=True):
                key = next(self._numbers)
                sample.metrics[DELIVERY_KEY] = float(key)
                sample.enqueued_at = now
                self._pending[key] = out
                self._lease_until[out.rollout_id] = claimed_at + self.lease_s

    def take(self, sample: RolloutSample) -> tuple[RolloutSample | None, Metric]:
        """The last look at a sample before the trainer batches it (None puts it aside), and
        the metrics that look produced."""
        key = sample.metrics.get(DELIVERY_KEY)
        if key is None:  # not one of ours to track
            return sample, {}
        with self._lock:
            out = self._pending.get(int(key))
            if out is None:  # its rollout was abandoned while the sample waited
                return None, {}
            if time.monotonic() > self._lease_until.get(out.rollout_id, 0.0) - self.lease_s / 2:
                # The lease is not confirmed for the step to come: another bridge may claim the
                # rollout before we could acknowledge. Leave it to whoever claims it next.
                self._abandon(out.rollout_id)
                self.stats["unconfirmed_lease_samples"] += 1
                return None, {}
            keep = mask_stale(sample.completion_mask, out.versions, self.model_version,
                              self.max_staleness)
            trained = int(np.count_nonzero(sample.completion_mask))
            if not keep.any():
                del self._pending[int(key)]
                self._put_aside.append(Entry(out.rollout_id, out.idx, "stale", 0, trained))
                self.stats.update(stale=1, stale_tokens=trained)
                return None, {"rollout/stale_samples_total": 1.0,
                              "rollout/stale_tokens_total": float(trained)}
            out.taken = True
            out.trained = int(np.count_nonzero(keep))
            out.stale = trained - out.trained
            self.stats["stale_tokens"] += out.stale
        metrics: Metric = {}
        if out.stale:
            sample.completion_mask = keep.astype(np.int64)
            sample.old_log_probs = np.where(keep, sample.old_log_probs, 0.0).astype(np.float32)
            metrics["rollout/stale_tokens_total"] = float(out.stale)
        # The newest trained token: TRL then drops no sample that still has a fresh token.
        sample.model_version = int(out.versions[keep].max())
        sample.metrics[VERSIONS_KEY] = out.versions  # type: ignore[assignment]  # see VERSIONS_KEY
        return sample, metrics

    def rollouts_of(self, keys: Iterable[int]) -> list[UUID]:
        with self._lock:
            return list({out.rollout_id for key in keys
                         if (out := self._pending.get(int(key))) is not None})

    def step_entries(self, keys: Sequence[int]) -> tuple[list[Entry], int]:
        """The delivery log lines of a step that took the samples `keys` (and of what was put
        aside since the last step), and how many of them it trained. They leave the
        outstanding samples now: a step that cannot be logged ends the run."""
        with self._lock:
            entries = [Entry(out.rollout_id, out.idx, "trained", out.trained, out.stale)
                       for key in keys if (out := self._pending.pop(int(key), None)) is not None]
            trained = len(entries)
            entries += self._put_aside
            self._put_aside = []
        return entries, trained

    def stepped(self, entries: Sequence[Entry], trained: int,
                ledgers: Mapping[UUID, Mapping[str, Any]]) -> None:
        """The log holds a step's `entries`: count what it consumed, and stop holding the
        leases of rollouts with nothing out any more."""
        with self._lock:
            self._count_consumed(ledgers)
            self.stats["trained_samples"] += trained
            still_out = {p.rollout_id for p in self._pending.values()}
            for entry in entries:
                if entry.rollout_id not in still_out:
                    self._lease_until.pop(entry.rollout_id, None)

    def count_consumed(self, ledgers: Mapping[UUID, Mapping[str, Any]]) -> None:
        with self._lock:
            self._count_consumed(ledgers)

    def _count_consumed(self, ledgers: Mapping[UUID, Mapping[str, Any]]) -> None:
        """Add consumed rollouts' ledgers to `consumed`, each rollout once (lock held)."""
        for rollout_id, ledger in ledgers.items():
            if rollout_id in self._accounted:
                continue
            self._accounted.add(rollout_id)
            self.consumed["rollouts"] += 1
            self.consumed["trained_nothing"] += not ledger["trained_tokens"]
            self.consumed["trained_tokens"] += ledger["trained_tokens"]
            for cause, tokens in ledger["excluded_tokens"].items():
                self.consumed[f"excluded_tokens/{cause}"] += tokens

    def _abandon(self, rollout_id: UUID) -> None:
        """Stop delivering a rollout (lock held): its samples still queued are put aside, and its
        lease is given back once none of its samples is in a step."""
        self._abandoned.add(rollout_id)
        for key in [k for k, p in self._pending.items()
                    if p.rollout_id == rollout_id and not p.taken]:
            del self._pending[key]

    def leases_due(self) -> tuple[list[UUID], list[UUID]]:
        """Rollouts whose lease to renew (samples out), and abandoned ones to give back."""
        with self._lock:
            out = {p.rollout_id for p in self._pending.values()}
            return list(out - self._abandoned), list(self._abandoned - out)

    def renewed(self, renew: Sequence[UUID], held: set[UUID], at: float) -> int:
        """Leases renewed at `at` (monotonic): `held` are still ours, the others of `renew`
        are lost and their rollouts abandoned. Returns how many were lost."""
        lost = 0
        with self._lock:
            for rollout_id in renew:
                if rollout_id in held:
                    self._lease_until[rollout_id] = at + self.lease_s
                else:
                    lost += 1
                    self.stats["lease_lost"] += 1
                    self._abandon(rollout_id)
        return lost

    def given_back(self, rollout_ids: Sequence[UUID]) -> None:
        with self._lock:
            self._abandoned.difference_update(rollout_ids)
            for rollout_id in rollout_ids:
                self._lease_until.pop(rollout_id, None)

    def leased(self) -> list[UUID]:
        """Every rollout this bridge still holds a lease on (to give back on stop)."""
        with self._lock:
            return list({p.rollout_id for p in self._pending.values()} | self._abandoned)

    def snapshot(self) -> list[Pending]:
        with self._lock:
            return list(self._pending.values())
