"""The rollout source: finished rollouts from Postgres into TRL's AsyncGRPO trainer queue.

It is TRL's rollout worker (`RolloutWorkerProtocol`) without generation: harnesses generate
through the gateway, the gateway merges each finished rollout into traces and announces it on
`FINISHED_CHANNEL`. A feeder thread here wakes on that NOTIFY (or polls, should the listening
connection drop), waits until a group is complete or past its deadline, claims it with a lease
(gateway/store/leases.py), turns its trainable traces into `RolloutSample`s with group-relative
advantages, and hands them to the trainer's queue in the same transaction that marks the
rollouts consumed. Hand-over and consumption thus happen together: a bridge that dies before
the commit leaves the rollouts to the next bridge, one that lost its lease hands over nothing.

Versions: the trainer counts its pushes from 1 (the cold sync before training); the gateway
stamps tokens with `version_offset` + that count (trainer_bridge/weights.py). A sample's
`model_version` is brought back to the trainer's count, so TRL's staleness check compares like
with like; tokens sampled before this run began come out at 0 or below, as stale as they are.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import math
import os
import queue
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import asyncpg
import numpy as np
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from gateway.store import leases
from gateway.store.db import open_pool
from gateway.store.traces import FINISHED_CHANNEL
from trainer_bridge.advantages import group_advantages
from trainer_bridge.samples import MergedSequence, Skip, rollout_samples, trained_mask

log = logging.getLogger(__name__)

PartialGroups = Literal["train", "drop"]
# How often a full trainer queue is looked at again: the trainer drains it without telling us.
_ROOM_POLL_S = 0.2


@dataclass(frozen=True)
class SourceConfig:
    database_url: str
    num_generations: int
    token_budget: int  # longer sequences are skipped and counted, never truncated
    group_deadline_s: float = 600.0  # from the first member's merge to releasing a partial group
    partial_groups: PartialGroups = "train"
    scale_std: bool = True  # divide advantages by the group's reward std
    max_staleness: int = 4  # samples more versions behind than this are dropped, not queued
    queue_size: int = 64  # new groups are claimed only while fewer samples wait in the queue
    lease_s: float = 60.0
    poll_interval_s: float = 2.0
    match: dict = field(default_factory=dict)  # only rollouts whose metadata contains this
    version_offset: int = 0  # gateway version = trainer version + offset

    def __post_init__(self) -> None:
        if self.num_generations < 1:
            raise ValueError("num_generations must be at least 1")
        if self.partial_groups not in ("train", "drop"):
            raise ValueError("partial_groups must be 'train' or 'drop'")
        if self.group_deadline_s < 0 or self.lease_s <= 0 or self.poll_interval_s <= 0:
            raise ValueError("group_deadline_s, lease_s and poll_interval_s must be positive")


class Release(enum.Enum):
    WAIT = "wait"
    COMPLETE = "complete"  # num_generations rollouts finished: train
    PARTIAL = "partial"  # deadline passed, partial groups are trained
    EXPIRED = "expired"  # deadline passed, partial groups are dropped
    LATE = "late"  # members of a group that was already trained or dropped: dropped

    @property
    def trains(self) -> bool:
        return self in (Release.COMPLETE, Release.PARTIAL)


def decide(ready: int, waited_s: float, released: bool, config: SourceConfig) -> Release:
    """What to do with a group's `ready` deliverable rollouts, the first merged `waited_s` ago."""
    if released:
        # Its advantages were computed without these: training them now would give them
        # statistics of their own. A group is one decision.
        return Release.LATE
    if ready >= config.num_generations:
        return Release.COMPLETE
    if waited_s < config.group_deadline_s:
        return Release.WAIT
    return Release.PARTIAL if config.partial_groups == "train" else Release.EXPIRED


def group_number(group_key: str) -> int:
    """A stable 62-bit id for TRL's `group_id` (an int): the same group gets the same number in
    every bridge, and TRL packs and counts a group's samples together by it."""
    return int.from_bytes(hashlib.blake2b(group_key.encode(), digest_size=8).digest(), "big") >> 2


@dataclass
class GroupBatch:
    samples: list[RolloutSample]
    metrics: dict[str, float | tuple[float, float]]
    counts: Counter


def build_group(
    members: Sequence[Mapping],
    traces: Mapping[object, Sequence[MergedSequence]],
    *,
    group_id: int,
    config: SourceConfig,
    trainer_version: int,
    decode: Callable[[np.ndarray], str] | None = None,
) -> GroupBatch:
    """Samples and metrics of one released group (pure).

    `members` are the claimed rollouts (`id`, `reward`, `merge_stats`), `traces` their trainable
    sequences. Advantages are per rollout, so a rollout merged into many sequences counts once in
    the group's statistics; every sequence gets its rollout's advantage.
    """
    rewards = [m["reward"] for m in members]
    advantages = group_advantages(rewards, scale_std=config.scale_std)
    samples: list[RolloutSample] = []
    counts: Counter = Counter(rollouts=len(members))
    sequences, drift, transitions = [], 0, 0
    for member, advantage in zip(members, advantages, strict=True):
        seqs = traces.get(member["id"], [])
        sequences.append(len(seqs))
        stats = member["merge_stats"] or {}
        drift += stats.get("causes", {}).get("drift", 0)
        transitions += max(stats.get("calls", 0) - 1, 0)
        counts["unscorable"] += member["reward"] is None
        prompt, completion = _texts(seqs[0], decode) if seqs and decode else (None, None)
        kept, skipped = rollout_samples(
            seqs,
            advantage=float(advantage),
            group_id=group_id,
            max_tokens=config.token_budget,
            reward=member["reward"],
            prompt=prompt,
            completion=completion,
        )
        counts["too_long"] += skipped[Skip.TOO_LONG]
        counts["untrained"] += skipped[Skip.NO_TRAINED_TOKENS]
        for sample in kept:
            sample.model_version -= config.version_offset
            if trainer_version - sample.model_version > config.max_staleness:
                counts["stale"] += 1
            else:
                samples.append(sample)
    counts["samples"] = len(samples)
    scored = np.array([r for r in rewards if r is not None], dtype=np.float64)
    staleness = [trainer_version - s.model_version for s in samples]
    metrics: dict[str, float | tuple[float, float]] = {
        "rollout/reward_mean": float(scored.mean()) if scored.size else math.nan,
        "rollout/reward_std": float(scored.std()) if scored.size else math.nan,
        "rollout/group_size": float(len(members)),
        "rollout/sequences_per_rollout": float(np.mean(sequences)),
        "rollout/drift_rate": (float(drift), float(transitions)),
        "rollout/staleness_mean": float(np.mean(staleness)) if staleness else math.nan,
        "rollout/staleness_max": float(max(staleness)) if staleness else math.nan,
        "rollout/unscorable_total": float(counts["unscorable"]),
        "rollout/too_long_sequences_total": float(counts["too_long"]),
        "rollout/untrained_sequences_total": float(counts["untrained"]),
        "rollout/stale_samples_total": float(counts["stale"]),
    }
    return GroupBatch(samples, metrics, counts)


def _texts(seq: MergedSequence, decode: Callable[[np.ndarray], str]) -> tuple[str, str]:
    """Context before the first trained token, and the rest: for TRL's sample logs only."""
    first = int(np.argmax(trained_mask(seq)))
    ids = np.asarray(seq.input_ids)
    return decode(ids[:first]), decode(ids[first:])


class RolloutSource:
    """TRL's rollout-worker protocol over the gateway's finished rollouts (see module doc).

    `owner` names this bridge in leases (default: host, pid and a random suffix, so a restarted
    bridge never mistakes a dead one's leases for its own). `decode` turns token ids into text
    for TRL's sample logs. `stats` counts what was delivered and dropped, for summaries.
    """

    def __init__(
        self,
        config: SourceConfig,
        *,
        owner: str | None = None,
        decode: Callable[[np.ndarray], str] | None = None,
    ) -> None:
        self.config = config
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.decode = decode
        # Unbounded on purpose: room is checked before a group is claimed, so handing over a
        # claimed group never blocks while its transaction holds the rows.
        self.rollout_buffer: queue.Queue[RolloutSample] = queue.Queue()
        self.metrics_queue: queue.Queue[dict] = queue.Queue()
        self.stats: Counter = Counter()
        self.model_version = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._beat = time.time()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None

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
        pool = await open_pool(self.config.database_url, min_size=1, max_size=2)
        listener = None
        try:
            while not self._stop.is_set():
                self._beat = time.time()
                if listener is None or listener.is_closed():
                    listener = await self._listen()
                # Cleared before looking, so a NOTIFY that lands while we look runs us again.
                self._wake.clear()
                wait_s = await self._feed(pool)
                timeout = min(wait_s, self.config.poll_interval_s)
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except TimeoutError:
                    pass
        finally:
            if listener is not None and not listener.is_closed():
                await listener.close()
            await pool.close()

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

    def _room(self) -> bool:
        return self.rollout_buffer.qsize() < self.config.queue_size

    async def _feed(self, pool) -> float:
        """Release every group that is due while the queue has room; returns how long to wait."""
        if not self._room():
            return _ROOM_POLL_S
        async with pool.acquire() as conn:
            groups = await leases.pending_groups(conn, self.config.match)
        wait_s = math.inf
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
            await self._release(pool, group["group_key"], decision)
        return max(wait_s, 0.0)

    async def _release(self, pool, group_key: str, decision: Release) -> None:
        config = self.config
        async with pool.acquire() as conn:
            members = await leases.claim_group(
                conn, self.owner, group_key, config.match, config.lease_s
            )
            if members is None:  # another bridge is on it
                return
            ids = [m["id"] for m in members]
            if decision.trains:
                if decision is Release.PARTIAL and len(members) >= config.num_generations:
                    decision = Release.COMPLETE  # the rest arrived since we looked
                traces = await leases.group_traces(conn, ids)
                batch = build_group(
                    members,
                    traces,
                    group_id=group_number(group_key),
                    config=config,
                    trainer_version=self.model_version,
                    decode=self.decode,
                )
            else:
                batch = GroupBatch([], {}, Counter(rollouts=len(members)))
            try:
                async with conn.transaction():
                    waited = await leases.consume(conn, self.owner, ids)
                    now = time.time()
                    for sample in batch.samples:
                        sample.enqueued_at = now
                        self.rollout_buffer.put_nowait(sample)
            except leases.LeaseLost as exc:
                # The lease ran out and another bridge took the group: it delivers it.
                log.warning("group %s: %s; leaving it to the new owner", group_key, exc)
                self.stats["lease_lost"] += 1
                self.metrics_queue.put({"rollout/lease_lost_total": 1.0})
                return
        self._account(decision, batch, list(waited.values()))

    def _account(self, decision: Release, batch: GroupBatch, waited_s: list[float]) -> None:
        counts = batch.counts
        if decision.trains:
            self.stats["groups"] += 1
            self.stats["partial_groups"] += decision is Release.PARTIAL
            self.stats["rollouts"] += counts["rollouts"]
            self.stats["samples"] += counts["samples"]
            for key in ("stale", "too_long", "untrained", "unscorable"):
                self.stats[key] += counts[key]
            metrics = {
                **batch.metrics,
                "rollout/partial_groups_total": float(decision is Release.PARTIAL),
                "rollout/finish_to_queue_s": float(np.mean(waited_s)),
                "rollout/finish_to_queue_s_max": float(np.max(waited_s)),
            }
        else:
            self.stats["dropped_groups"] += 1
            self.stats["dropped_rollouts"] += counts["rollouts"]
            metrics = {
                "rollout/dropped_groups_total": 1.0,
                "rollout/dropped_rollouts_total": float(counts["rollouts"]),
                "rollout/late_rollouts_total": float(
                    counts["rollouts"] if decision is Release.LATE else 0
                ),
            }
        self.metrics_queue.put(metrics)
