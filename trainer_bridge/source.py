"""The rollout source: finished rollouts from Postgres into TRL's AsyncGRPO trainer, each trace
taken into exactly one optimizer step.

It is TRL's rollout worker (`RolloutWorkerProtocol`) without generation: harnesses generate
through the gateway, the gateway merges each finished rollout into traces and announces it on
`FINISHED_CHANNEL`. A feeder thread here wakes on that NOTIFY (or polls, should the listening
connection drop), waits until a group is complete or past its deadline, claims it with a lease,
releases it (fixes its advantages in the database), and puts its samples on the trainer's queue.

Delivery (trainer_bridge/deliveries.py holds the SQL): a sample is not delivered when it is
queued but when an optimizer step has taken it. The trainer acknowledges each step's samples
right after `optimizer.step()` (trainer_bridge/trainer.py); only then does the delivery log
say so, and a rollout is consumed once all its traces are in the log. Until then the feeder
renews the lease of every rollout with samples out. A crash before the acknowledgement leaves
the rollouts to the next claim, which delivers again the traces not in the log, with the
advantages fixed at release; a crash after it delivers nothing again. A sample is handed to
the trainer only while its lease is confirmed for at least half its length, so a bridge cut
off from the database stops training what another bridge may be about to claim. Transient
database errors are retried with backoff; a group whose claims failed `max_attempts` times is
quarantined (`rollouts.quarantined_at`) and reported.

Staleness is per token, judged when the trainer takes a sample off the queue: trained tokens
more than `max_staleness` versions behind the trainer are masked out of the loss, the rest of
the sequence trains, and a sample with no fresh token left is put aside (logged 'stale').

Versions: the trainer counts its pushes from 1 (the cold sync before training); the gateway
stamps tokens with `version_offset` + that count (trainer_bridge/weights.py). Token versions are
brought back to the trainer's count, so staleness compares like with like; tokens sampled before
this run began come out at 0 or below, as stale as they are.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import itertools
import logging
import math
import os
import queue
import random
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal
from uuid import UUID

import asyncpg
import numpy as np
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from core.store.db import open_pool
from core.store.traces import FINISHED_CHANNEL
from trainer_bridge import deliveries
from trainer_bridge.advantages import group_advantages
from trainer_bridge.faults import crash_point
from trainer_bridge.narration import Narrator, Waiting, group_account
from trainer_bridge.samples import MergedSequence, Skip, rollout_samples, trained_mask

log = logging.getLogger(__name__)

PartialGroups = Literal["train", "drop"]
# How often a full trainer queue is looked at again: the trainer drains it without telling us.
_ROOM_POLL_S = 0.2
# The source's number for a sample, in `RolloutSample.metrics` (the one free-form field that
# reaches TRL's collator); the trainer's collator takes it out before TRL logs the metrics.
DELIVERY_KEY = "rolltap/delivery"
_OUTCOME = {Skip.TOO_LONG: "too_long", Skip.NO_TRAINED_TOKENS: "untrained"}


@dataclass(frozen=True)
class SourceConfig:
    database_url: str
    num_generations: int
    token_budget: int  # longer sequences are skipped and logged, never truncated
    group_deadline_s: float = 600.0  # from the first member's merge to releasing a partial group
    partial_groups: PartialGroups = "train"
    scale_std: bool = True  # divide advantages by the group's reward std
    shuffle_rewards: bool = False  # control runs: rewards permuted within each group
    max_staleness: int = 4  # trained tokens more versions behind than this are masked out
    queue_size: int = 64  # new groups are claimed only while fewer samples wait in the queue
    lease_s: float = 60.0
    poll_interval_s: float = 2.0
    match: dict = field(default_factory=dict)  # only rollouts whose metadata contains this
    version_offset: int = 0  # gateway version = trainer version + offset
    max_attempts: int = 5  # failed claims of a group (its own faults) before it is quarantined
    db_give_up_s: float = 600.0  # database unreachable this long: the source fails
    report_every_s: float = 30.0  # what it waits for, or why it trains nothing, this often

    def __post_init__(self) -> None:
        if self.num_generations < 1:
            raise ValueError("num_generations must be at least 1")
        if self.partial_groups not in ("train", "drop"):
            raise ValueError("partial_groups must be 'train' or 'drop'")
        if self.group_deadline_s < 0 or self.lease_s <= 0 or self.poll_interval_s <= 0:
            raise ValueError("group_deadline_s, lease_s and poll_interval_s must be positive")
        if self.report_every_s <= 0:
            raise ValueError("report_every_s must be positive")
        if self.max_attempts < 1 or self.max_staleness < 0:
            raise ValueError("max_attempts must be at least 1 and max_staleness at least 0")


class Release(enum.Enum):
    WAIT = "wait"
    COMPLETE = "complete"  # num_generations rollouts finished: train
    PARTIAL = "partial"  # deadline passed, partial groups are trained
    EXPIRED = "expired"  # deadline passed, partial groups are dropped
    REDELIVER = "redeliver"  # released before: its released members again, any others are late

    @property
    def trains(self) -> bool:
        return self is not Release.WAIT and self is not Release.EXPIRED


def decide(ready: int, waited_s: float, released: bool, config: SourceConfig) -> Release:
    """What to do with a group's `ready` deliverable rollouts, the first merged `waited_s` ago."""
    if released:
        # Its advantages were fixed at release: the members released then train with them (a
        # bridge died before their step); members that came later would need statistics of
        # their own and are dropped. A group is one decision.
        return Release.REDELIVER
    if ready >= config.num_generations:
        return Release.COMPLETE
    if waited_s < config.group_deadline_s:
        return Release.WAIT
    return Release.PARTIAL if config.partial_groups == "train" else Release.EXPIRED


def plan_release(
    members: Sequence[Mapping], decision: Release, config: SourceConfig
) -> tuple[dict[UUID, float], list[UUID]]:
    """Which claimed members train with which advantage, and which are dropped (pure).

    Members released before keep their stored advantage, whatever was decided from a stale
    look at the group; the others of a released group are late.
    """
    released = [m for m in members if m["released_at"] is not None]
    if released or decision is Release.REDELIVER:
        late = [m["id"] for m in members if m["released_at"] is None]
        return {m["id"]: float(m["advantage"]) for m in released}, late
    if not decision.trains:
        return {}, [m["id"] for m in members]
    if config.shuffle_rewards:
        # In id order, seeded by the ids: the same permutation whatever order they come in.
        members = sorted(members, key=lambda m: str(m["id"]))
        rewards = [m["reward"] for m in members]
        random.Random(",".join(str(m["id"]) for m in members)).shuffle(rewards)
    else:
        rewards = [m["reward"] for m in members]
    advantages = group_advantages(rewards, scale_std=config.scale_std)
    return {m["id"]: float(a) for m, a in zip(members, advantages, strict=True)}, []


def group_number(group_key: str) -> int:
    """A stable 62-bit id for TRL's `group_id` (an int): the same group gets the same number in
    every bridge, and TRL packs and counts a group's samples together by it."""
    return int.from_bytes(hashlib.blake2b(group_key.encode(), digest_size=8).digest(), "big") >> 2


@dataclass
class Pending:
    """A sample out for delivery: its trace, and its trained tokens' versions in the trainer's
    count (for the staleness mask when the trainer takes it)."""

    rollout_id: UUID
    idx: int
    versions: np.ndarray
    group: int = 0  # TRL's group id
    tokens: int = 0  # the sample's length, for what waits for a step
    taken: bool = False
    trained: int = 0  # set when the trainer takes it: tokens it trains, and those masked stale
    stale: int = 0


@dataclass
class GroupBatch:
    samples: list[RolloutSample]
    pending: list[Pending]  # one per sample
    skipped: list[deliveries.Entry]  # traces that will never train
    metrics: dict[str, float | tuple[float, float]]
    counts: Counter


def build_group(
    members: Sequence[Mapping],
    advantages: Mapping[UUID, float],
    traces: Mapping[UUID, Sequence[tuple[int, MergedSequence]]],
    *,
    group_id: int,
    config: SourceConfig,
    decode: Callable[[np.ndarray], str] | None = None,
) -> GroupBatch:
    """Samples and metrics of the members of one released group that train (pure).

    `members` are the claimed rollouts (`id`, `reward`, `merge_stats`) in `advantages`,
    `traces` their undelivered trainable sequences with their indexes. Every sequence gets its
    rollout's advantage, so a rollout merged into many sequences counts once in its group's
    statistics.
    """
    samples: list[RolloutSample] = []
    pending: list[Pending] = []
    skipped: list[deliveries.Entry] = []
    counts: Counter = Counter(rollouts=len(members))
    sequences, drift, transitions = [], 0, 0
    for member in members:
        indexed = traces.get(member["id"], [])
        seqs = [seq for _, seq in indexed]
        sequences.append(len(seqs))
        stats = member["merge_stats"] or {}
        drift += stats.get("causes", {}).get("drift", 0)
        transitions += max(stats.get("calls", 0) - 1, 0)
        counts["unscorable"] += member["reward"] is None
        prompt, completion = _texts(seqs[0], decode) if seqs and decode else (None, None)
        kept, reasons = rollout_samples(
            seqs,
            advantage=advantages[member["id"]],
            group_id=group_id,
            max_tokens=config.token_budget,
            reward=member["reward"],
            prompt=prompt,
            completion=completion,
        )
        kept_seqs = iter(kept)
        for (idx, seq), reason in zip(indexed, reasons, strict=True):
            if reason is not None:
                counts[_OUTCOME[reason]] += 1
                left_out = int(trained_mask(seq).sum())
                skipped.append(deliveries.Entry(member["id"], idx, _OUTCOME[reason], 0, left_out))
                continue
            sample = next(kept_seqs)
            sample.model_version -= config.version_offset
            samples.append(sample)
            versions = np.asarray(seq.versions, dtype=np.int64) - config.version_offset
            pending.append(Pending(member["id"], idx, versions, group_id, len(seq.input_ids)))
    counts["samples"] = len(samples)
    rewards = np.array([m["reward"] for m in members if m["reward"] is not None], np.float64)
    metrics: dict[str, float | tuple[float, float]] = {
        "rollout/reward_mean": float(rewards.mean()) if rewards.size else math.nan,
        "rollout/reward_std": float(rewards.std()) if rewards.size else math.nan,
        "rollout/group_size": float(len(members)),
        "rollout/sequences_per_rollout": float(np.mean(sequences)) if sequences else math.nan,
        "rollout/drift_rate": (float(drift), float(transitions)),
        "rollout/unscorable_total": float(counts["unscorable"]),
        "rollout/too_long_sequences_total": float(counts["too_long"]),
        "rollout/untrained_sequences_total": float(counts["untrained"]),
    }
    return GroupBatch(samples, pending, skipped, metrics, counts)


def _texts(seq: MergedSequence, decode: Callable[[np.ndarray], str]) -> tuple[str, str]:
    """Context before the first trained token, and the rest: for TRL's sample logs only."""
    first = int(np.argmax(trained_mask(seq)))
    ids = np.asarray(seq.input_ids)
    return decode(ids[:first]), decode(ids[first:])


def mask_stale(
    completion_mask: np.ndarray, versions: np.ndarray, trainer_version: int, max_staleness: int
) -> np.ndarray:
    """The trained tokens still fresh at `trainer_version` (pure): a token trains while it is at
    most `max_staleness` versions behind."""
    return (np.asarray(completion_mask) != 0) & (versions >= trainer_version - max_staleness)


class DeliveryQueue(queue.Queue):
    """The trainer's sample queue: each sample taken off it passes `take` first, which may
    change it (staleness mask) or put it aside (None), then the next one is looked at."""

    def __init__(self, take: Callable[[RolloutSample], RolloutSample | None]) -> None:
        super().__init__()
        self._take = take
        # The trainer is blocked here for its next sample (not busy with a step).
        self.trainer_waiting = False

    def get(self, block: bool = True, timeout: float | None = None) -> RolloutSample:
        deadline = None if timeout is None else time.monotonic() + timeout
        self.trainer_waiting = True
        try:
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                sample = self._take(super().get(block, left))
                if sample is not None:
                    return sample
        finally:
            self.trainer_waiting = False


class _Backoff:
    """Retry pacing for database errors: doubling pauses, and a give-up after `give_up_s` of
    nothing but failures."""

    def __init__(self, give_up_s: float) -> None:
        self.give_up_s = give_up_s
        self._failing_since: float | None = None
        self._delay = 0.1

    def ok(self) -> None:
        self._failing_since, self._delay = None, 0.1

    def failed(self, what: str, exc: BaseException) -> float:
        """The pause before the next try; raises `exc` once failures lasted `give_up_s`."""
        now = time.monotonic()
        self._failing_since = self._failing_since or now
        if now - self._failing_since >= self.give_up_s:
            raise exc
        delay, self._delay = self._delay, min(self._delay * 2, 5.0)
        log.warning("%s failed (%s: %s); retrying in %.1f s", what, type(exc).__name__, exc, delay)
        return delay


class RolloutSource:
    """TRL's rollout-worker protocol over the gateway's finished rollouts (see module doc), plus
    `acknowledge(step, keys)`, which the trainer calls after each optimizer step.

    `owner` names this bridge in leases and the delivery log (default: host, pid and a random
    suffix, so a restarted bridge never mistakes a dead one's leases for its own). `decode`
    turns token ids into text for TRL's sample logs. `stats` counts what was delivered and put
    aside, for summaries; `consumed` sums the ledgers of the rollouts this bridge consumed
    (core/store/ledger.py). `say` prints what the bridge waits for and why what it consumed
    trained nothing (trainer_bridge/narration.py).
    """

    def __init__(
        self,
        config: SourceConfig,
        *,
        owner: str | None = None,
        decode: Callable[[np.ndarray], str] | None = None,
        say: Callable[[str], None] = lambda line: print(line, flush=True),
    ) -> None:
        self.config = config
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.decode = decode
        # Unbounded on purpose: room is checked before a group is claimed, so handing over a
        # released group never blocks.
        self.rollout_buffer: DeliveryQueue = DeliveryQueue(self._take)
        self.metrics_queue: queue.Queue[dict] = queue.Queue()
        self.stats: Counter = Counter()
        self.consumed: Counter = Counter()
        self._accounted: set[UUID] = set()
        self.narrator = Narrator(num_generations=config.num_generations,
                                 token_budget=config.token_budget,
                                 group_deadline_s=config.group_deadline_s,
                                 every_s=config.report_every_s, say=say)
        self._gathering = (0, 0, None)  # groups waiting for members, their rollouts, deadline
        self.model_version = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._beat = time.time()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._pool: asyncpg.Pool | None = None
        # Shared by the feeder thread and the trainer's thread (take, acknowledge).
        self._lock = threading.Lock()
        self._numbers = itertools.count()
        self._pending: dict[int, Pending] = {}  # samples out, not acknowledged yet
        self._put_aside: list[deliveries.Entry] = []  # logged at next ack
        self._lease_until: dict[UUID, float] = {}  # monotonic time each lease is confirmed to
        self._abandoned: set[UUID] = set()  # leases to give back once nothing of theirs is out
        self._renewed_at = 0.0

    # -- TRL's RolloutWorkerProtocol ------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the rollout source was already started")
        self._beat = time.time()
        self._thread = threading.Thread(
            target=self._run, name="rolltap-rollout-source", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._nudge()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def update_model_version(self, model_version: int) -> None:
        self.model_version = model_version

    def check_health(self, stale_after_s: float) -> None:
        if self._error is not None:
            raise RuntimeError("the rollout source failed; see the chained exception") from (
                self._error
            )
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("the rollout source is not running")
        age = time.time() - self._beat
        if age > stale_after_s:
            raise RuntimeError(f"the rollout source is stuck: no heartbeat for {age:.0f} s")

    # -- the trainer's side (its thread) --------------------------------------------------------

    def _take(self, sample: RolloutSample) -> RolloutSample | None:
        """The last look at a sample before the trainer batches it; None puts it aside."""
        key = sample.metrics.get(DELIVERY_KEY)
        if key is None:  # not one of ours to track
            return sample
        config = self.config
        with self._lock:
            out = self._pending.get(int(key))
            if out is None:  # its rollout was abandoned while the sample waited
                return None
            if time.monotonic() > self._lease_until.get(out.rollout_id, 0.0) - config.lease_s / 2:
                # The lease is not confirmed for the step to come: another bridge may claim the
                # rollout before we could acknowledge. Leave it to whoever claims it next.
                self._abandon(out.rollout_id)
                self.stats["unconfirmed_lease_samples"] += 1
                return None
            keep = mask_stale(sample.completion_mask, out.versions, self.model_version,
                              config.max_staleness)
            trained = int(np.count_nonzero(sample.completion_mask))
            if not keep.any():
                del self._pending[int(key)]
                self._put_aside.append(deliveries.Entry(out.rollout_id, out.idx, "stale", 0,
                                                        trained))
                self.stats["stale"] += 1
                self.stats["stale_tokens"] += trained
                self.metrics_queue.put({"rollout/stale_samples_total": 1.0,
                                        "rollout/stale_tokens_total": float(trained)})
                return None
            out.taken = True
            out.trained = int(np.count_nonzero(keep))
            out.stale = trained - out.trained
        stale = out.stale
        if stale:
            sample.completion_mask = keep.astype(np.int64)
            sample.old_log_probs = np.where(keep, sample.old_log_probs, 0.0).astype(np.float32)
            with self._lock:
                self.stats["stale_tokens"] += stale
            self.metrics_queue.put({"rollout/stale_tokens_total": float(stale)})
        # The newest trained token: TRL then drops no sample that still has a fresh token.
        sample.model_version = int(out.versions[keep].max())
        return sample

    def fault(self, keys: Sequence[int]) -> None:
        """The trainer failed on the samples numbered `keys`: their groups count a fault
        (towards `max_attempts`) and their leases go back; the error then ends the run."""
        with self._lock:
            ids = list({out.rollout_id for key in keys
                        if (out := self._pending.get(int(key))) is not None})
        loop = self._loop
        if not ids or loop is None or self._thread is None or not self._thread.is_alive():
            return  # nothing counts it; the leases run out
        log.error("training failed on samples of %d rollouts; their groups count a fault",
                  len(ids))
        asyncio.run_coroutine_threadsafe(
            self._retry(lambda conn: deliveries.release(conn, self.owner, ids, fault=True),
                        "counting a training fault"),
            loop,
        ).result()

    def acknowledge(self, step: int, keys: Sequence[int]) -> None:
        """Log that optimizer step `step` took the samples numbered `keys`: called by the
        trainer after the step, it returns once the delivery log holds them (retrying through
        database errors)."""
        with self._lock:
            entries = []
            for key in keys:
                out = self._pending.pop(int(key), None)
                if out is not None:
                    entries.append(deliveries.Entry(out.rollout_id, out.idx, "trained",
                                                    out.trained, out.stale))
            trained = len(entries)
            entries += self._put_aside
            self._put_aside = []
        if not entries:
            return
        loop = self._loop
        if loop is None or self._thread is None or not self._thread.is_alive():
            # Nothing can log it: the next claim delivers these samples again.
            raise RuntimeError(
                f"cannot acknowledge step {step}: the rollout source is not running"
            ) from self._error
        async def log_step(conn):
            lost = await deliveries.acknowledge(conn, self.owner, step, entries)
            return lost, await deliveries.ledgers(conn, {e.rollout_id for e in entries})

        lost, ledgers = asyncio.run_coroutine_threadsafe(
            self._retry(log_step, f"acknowledging step {step}"), loop
        ).result()
        self.narrator.stepped()
        with self._lock:
            self._count_consumed(ledgers)
            self.stats["trained_samples"] += trained
            still_out = {p.rollout_id for p in self._pending.values()}
            for entry in entries:
                if entry.rollout_id not in still_out:
                    self._lease_until.pop(entry.rollout_id, None)
        if lost:
            # Trained, but the lease had run out: another bridge may train these too. The
            # delivery log marks them (leased = false).
            log.error("step %d trained %d rollouts whose lease this bridge no longer held: %s",
                      step, len(lost), ", ".join(sorted(map(str, lost))))
            self.stats["trained_without_lease"] += len(lost)
            self.metrics_queue.put({"rollout/trained_without_lease_total": float(len(lost))})

    def _count_consumed(self, ledgers: Mapping[UUID, Mapping]) -> None:
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

    def waiting(self) -> Waiting:
        """What is out for the trainer and not in a logged step yet, and what waits for
        members."""
        with self._lock:
            out = list(self._pending.values())
        gathering, gathered, deadline_in = self._gathering
        return Waiting(
            trainer_waiting=self.rollout_buffer.trainer_waiting,
            samples=len(out),
            tokens=sum(p.tokens for p in out),
            longest=max((p.tokens for p in out), default=0),
            rollouts=len({p.rollout_id for p in out}),
            groups=len({p.group for p in out}),
            gathering=gathering,
            gathered=gathered,
            deadline_in_s=deadline_in,
        )

    # -- feeder thread --------------------------------------------------------------------------

    def _nudge(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the feeder's loop already ended: nothing left to wake
                pass

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # surfaced to the trainer by check_health
            log.exception("rollout source failed")
            self._error = exc

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        backoff = _Backoff(self.config.db_give_up_s)
        while self._pool is None:
            try:
                self._pool = await open_pool(self.config.database_url, min_size=1, max_size=3)
            except deliveries.TRANSIENT as exc:
                self._beat = time.time()
                await asyncio.sleep(backoff.failed("connecting to the database", exc))
        listener = None
        try:
            while not self._stop.is_set():
                self._beat = time.time()
                if listener is None or listener.is_closed():
                    listener = await self._listen()
                # Cleared before looking, so a NOTIFY that lands while we look runs us again.
                self._wake.clear()
                try:
                    await self._keep_leases()
                    wait_s = await self._feed()
                    backoff.ok()
                    self.narrator.tick(self.waiting())
                except deliveries.TRANSIENT as exc:
                    self.stats["db_errors"] += 1
                    wait_s = backoff.failed("looking for rollouts", exc)
                timeout = min(wait_s, self.config.poll_interval_s, self.config.lease_s / 4)
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except TimeoutError:
                    pass
        finally:
            await self._give_back()
            if listener is not None and not listener.is_closed():
                await listener.close()
            await self._pool.close()

    async def _retry(self, op: Callable[[asyncpg.Connection], Awaitable], what: str):
        """`op` on a pooled connection, retried through transient database errors."""
        backoff = _Backoff(self.config.db_give_up_s)
        while True:
            try:
                async with self._pool.acquire() as conn:
                    return await op(conn)
            except deliveries.TRANSIENT as exc:
                self.stats["db_errors"] += 1
                await asyncio.sleep(backoff.failed(what, exc))

    async def _listen(self):
        """A connection that wakes the feeder on every finished rollout; None if it cannot be
        opened now (polling covers until the next attempt)."""
        try:
            conn = await asyncpg.connect(self.config.database_url)
            await conn.add_listener(FINISHED_CHANNEL, lambda *_: self._wake.set())
            return conn
        except (OSError, asyncpg.PostgresError) as exc:
            log.warning("cannot LISTEN for finished rollouts (%s); polling instead", exc)
            return None

    def _abandon(self, rollout_id: UUID) -> None:
        """Stop delivering a rollout (lock held): its samples still queued are put aside, and its
        lease is given back once none of its samples is in a step."""
        self._abandoned.add(rollout_id)
        for key in [k for k, p in self._pending.items()
                    if p.rollout_id == rollout_id and not p.taken]:
            del self._pending[key]

    async def _keep_leases(self) -> None:
        """Renew the lease of every rollout with samples out; give back abandoned ones."""
        now = time.monotonic()
        if now - self._renewed_at < self.config.lease_s / 4:
            return
        with self._lock:
            out = {p.rollout_id for p in self._pending.values()}
            renew = list(out - self._abandoned)
            give_back = list(self._abandoned - out)
        if renew:
            async with self._pool.acquire() as conn:
                held = await deliveries.renew(conn, self.owner, renew, self.config.lease_s)
            with self._lock:
                for rollout_id in renew:
                    if rollout_id in held:
                        self._lease_until[rollout_id] = now + self.config.lease_s
                    else:
                        self.stats["lease_lost"] += 1
                        self._abandon(rollout_id)
        if give_back:
            async with self._pool.acquire() as conn:
                await deliveries.release(conn, self.owner, give_back)
            with self._lock:
                self._abandoned.difference_update(give_back)
                for rollout_id in give_back:
                    self._lease_until.pop(rollout_id, None)
        self._renewed_at = now

    async def _give_back(self) -> None:
        """On stop: leases of rollouts whose samples no step took go back at once, so the next
        bridge need not wait them out (best effort; they run out anyway)."""
        with self._lock:
            out = list({p.rollout_id for p in self._pending.values()} | self._abandoned)
        if not out or self._pool is None:
            return
        try:
            async with self._pool.acquire() as conn:
                await deliveries.release(conn, self.owner, out)
        except deliveries.TRANSIENT as exc:
            log.warning("could not give back %d leases (%s); they run out by themselves",
                        len(out), exc)

    def _room(self) -> bool:
        return self.rollout_buffer.qsize() < self.config.queue_size

    async def _feed(self) -> float:
        """Release every group that is due while the queue has room; returns how long to wait."""
        if not self._room():
            return _ROOM_POLL_S
        async with self._pool.acquire() as conn:
            groups = await deliveries.pending_groups(conn, self.config.match)
        wait_s = math.inf
        gathering = [g for g in groups if not g["leased"] and not g["released"]
                     and g["ready"] < self.config.num_generations]
        self._gathering = (
            len(gathering),
            sum(g["ready"] for g in gathering),
            min((self.config.group_deadline_s - g["waited_s"] for g in gathering), default=None),
        )
        for group in groups:
            if self._stop.is_set():
                break
            if not self._room():
                return _ROOM_POLL_S
            if group["leased"]:
                continue
            decision = decide(group["ready"], group["waited_s"], group["released"], self.config)
            if decision is Release.WAIT:
                wait_s = min(wait_s, self.config.group_deadline_s - group["waited_s"])
                continue
            await self._release(group["group_key"], decision)
        return max(wait_s, 0.0)

    async def _release(self, group_key: str, decision: Release) -> None:
        config = self.config
        async with self._pool.acquire() as conn:
            members = await deliveries.claim_group(
                conn, self.owner, group_key, config.match, config.lease_s
            )
            if members is None:  # another bridge is on it
                return
            claimed_at = time.monotonic()
            crash_point("after_claim")
            ids = [m["id"] for m in members]
            faults = max(m["delivery_attempts"] for m in members)
            if faults >= config.max_attempts:
                await deliveries.quarantine(conn, self.owner, ids)
                self._report_quarantine(group_key, ids, faults)
                return
            if decision is Release.PARTIAL and len(members) >= config.num_generations:
                decision = Release.COMPLETE  # the rest arrived since we looked
            try:
                advantages, dropped = plan_release(members, decision, config)
                training = [m for m in members if m["id"] in advantages]
                traces = await deliveries.undelivered_traces(conn, list(advantages))
                batch = build_group(training, advantages, traces, group_id=group_number(group_key),
                                    config=config, decode=self.decode)
                await deliveries.release_group(conn, self.owner, advantages, dropped,
                                               batch.skipped)
                # Dropped members, and members with nothing to deliver, are consumed now.
                ledgers = await deliveries.ledgers(conn, ids)
            except deliveries.LeaseLost as exc:
                # The lease ran out and another bridge took the group: it delivers it.
                log.warning("group %s: %s; leaving it to the new owner", group_key, exc)
                self.stats["lease_lost"] += 1
                self.metrics_queue.put({"rollout/lease_lost_total": 1.0})
                return
            except deliveries.TRANSIENT:
                raise  # the lease runs out, and the group is claimed again
            except Exception:
                # Bad data (or a bug) in this group: give it back and go on with the others. It
                # counts as a fault, so a group that always fails ends in quarantine.
                log.exception("group %s failed (attempt %d of %d)", group_key, faults + 1,
                              config.max_attempts)
                self.stats["failed_claims"] += 1
                self.metrics_queue.put({"rollout/failed_claims_total": 1.0})
                await deliveries.release(conn, self.owner, ids, fault=True)
                return
        now = time.time()
        with self._lock:
            for sample, out in zip(batch.samples, batch.pending, strict=True):
                key = next(self._numbers)
                sample.metrics[DELIVERY_KEY] = float(key)
                sample.enqueued_at = now
                self._pending[key] = out
                self._lease_until[out.rollout_id] = claimed_at + config.lease_s
        for sample in batch.samples:
            self.rollout_buffer.put_nowait(sample)
        crash_point("after_put")
        self._account(decision, members, dropped, batch)
        with self._lock:
            self._count_consumed(ledgers)
        offered = [(out.rollout_id, "trained", int(np.count_nonzero(sample.completion_mask)), 0)
                   for sample, out in zip(batch.samples, batch.pending, strict=True)]
        aside = [(e.rollout_id, e.outcome, e.trained_tokens, e.excluded_tokens)
                 for e in batch.skipped]
        trained, excluded = group_account(members, advantages, dropped, [*offered, *aside])
        self.narrator.group_released(group_key, len(members), trained, excluded)

    def _report_quarantine(self, group_key: str, ids: list[UUID], faults: int) -> None:
        log.error(
            "group %s quarantined after %d failed delivery attempts; its rollouts (%s) are left "
            "out of training. Inspect them (rollouts.quarantined_at), then clear quarantined_at "
            "and delivery_attempts to deliver them again.",
            group_key, faults, ", ".join(map(str, ids)),
        )
        self.stats["quarantined_groups"] += 1
        self.stats["quarantined_rollouts"] += len(ids)
        self.metrics_queue.put({"rollout/quarantined_groups_total": 1.0,
                                "rollout/quarantined_rollouts_total": float(len(ids))})

    def _account(
        self, decision: Release, members: Sequence[Mapping], dropped: list[UUID], batch: GroupBatch
    ) -> None:
        counts = batch.counts
        metrics: dict[str, float | tuple[float, float]] = {}
        if counts["rollouts"]:
            self.stats["groups"] += 1
            self.stats["partial_groups"] += decision is Release.PARTIAL
            self.stats["redelivered_groups"] += decision is Release.REDELIVER
            self.stats["rollouts"] += counts["rollouts"]
            self.stats["samples"] += counts["samples"]
            for key in ("too_long", "untrained", "unscorable"):
                self.stats[key] += counts[key]
            now = datetime.now(UTC)
            waited = [(now - m["finished_at"]).total_seconds() for m in members
                      if m["finished_at"] is not None and m["id"] not in dropped]
            metrics.update(batch.metrics)
            metrics["rollout/partial_groups_total"] = float(decision is Release.PARTIAL)
            metrics["rollout/redelivered_groups_total"] = float(decision is Release.REDELIVER)
            if waited:
                metrics["rollout/finish_to_queue_s"] = float(np.mean(waited))
                metrics["rollout/finish_to_queue_s_max"] = float(np.max(waited))
        if dropped:
            late = decision is Release.REDELIVER
            self.stats["dropped_groups"] += not counts["rollouts"]
            self.stats["dropped_rollouts"] += len(dropped)
            metrics["rollout/dropped_groups_total"] = float(not counts["rollouts"])
            metrics["rollout/dropped_rollouts_total"] = float(len(dropped))
            metrics["rollout/late_rollouts_total"] = float(len(dropped) if late else 0)
        self.metrics_queue.put(metrics)
