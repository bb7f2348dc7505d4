"""When a group is released, and what it becomes: the bridge's release policy (pure).

A group's finished rollouts wait until `num_generations` of them are there, or until its
deadline passes (then it is trained partial or dropped, `partial_groups`). Releasing fixes each
member's advantage (group-relative, `advantages.py`) and turns its undelivered traces into TRL
`RolloutSample`s (`samples.py`); a group released before (its bridge died before the step) is
delivered again with the advantages fixed then, and members that came later are late.

Nothing here touches the database or a thread: the rows the feeder reads are decoded once, at
the edge (`deliveries.py`), into the structs below, and everything else is a function of them.
Staleness is judged per token when the trainer takes a sample (`mask_stale`).
"""

from __future__ import annotations

import enum
import hashlib
import math
import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, NamedTuple
from uuid import UUID

import msgspec
import numpy as np
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from trainer_bridge.advantages import group_advantages
from trainer_bridge.samples import MergedSequence, Skip, rollout_samples, trained_mask

PartialGroups = Literal["train", "drop"]
Outcome = Literal["trained", "stale", "too_long", "untrained"]
_OUTCOME: dict[Skip, Outcome] = {Skip.TOO_LONG: "too_long", Skip.NO_TRAINED_TOKENS: "untrained"}


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
    match: dict[str, Any] = field(default_factory=dict[str, Any])  # rollouts whose metadata has it
    version_offset: int = 0  # gateway version = trainer version + offset
    max_attempts: int = 5  # failed claims of a group (its own faults) before it is quarantined
    db_give_up_s: float = 600.0  # database unreachable this long: the source fails
    report_every_s: float = 30.0  # what it waits for, or why it trains nothing, this often
    flush_after_s: float = 60.0  # no new sample this long: the partial micro-batch trains
    until_empty: bool = False  # end the stream once nothing is left to deliver

    def __post_init__(self) -> None:
        if self.num_generations < 1:
            raise ValueError("num_generations must be at least 1")
        if self.partial_groups not in ("train", "drop"):
            raise ValueError("partial_groups must be 'train' or 'drop'")
        if self.group_deadline_s < 0 or self.lease_s <= 0 or self.poll_interval_s <= 0:
            raise ValueError("group_deadline_s, lease_s and poll_interval_s must be positive")
        if self.report_every_s <= 0 or self.flush_after_s <= 0:
            raise ValueError("report_every_s and flush_after_s must be positive")
        if self.max_attempts < 1 or self.max_staleness < 0:
            raise ValueError("max_attempts must be at least 1 and max_staleness at least 0")


class PendingGroup(msgspec.Struct, frozen=True):
    """A group with deliverable rollouts, as the feeder sees it at one look."""

    group_key: str
    ready: int  # deliverable rollouts
    waited_s: float  # since the first of them was merged
    leased: bool  # some bridge holds a live lease on one
    released: bool  # released before: its released members again, the others are late


class Member(msgspec.Struct, frozen=True):
    """A claimed rollout of a group."""

    id: UUID
    reward: float | None = None
    merge_stats: dict[str, Any] | None = None
    released_at: datetime | None = None
    advantage: float | None = None  # fixed at release
    finished_at: datetime | None = None
    delivery_attempts: int = 0  # the group's own faults so far
    group_id: str | None = None
    task_id: str | None = None
    status: str | None = None


class Entry(NamedTuple):
    """One line of the delivery log: a trace, what became of it and, for the rollout's ledger,
    the tokens the step trained and those it left out (masked stale, or the whole trace put
    aside as stale or too long). Counts may be None where they are not known (zero)."""

    rollout_id: UUID
    idx: int
    outcome: Outcome
    trained_tokens: int | None = None
    excluded_tokens: int | None = None


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
    members: Sequence[Member], decision: Release, config: SourceConfig
) -> tuple[dict[UUID, float], list[UUID]]:
    """Which claimed members train with which advantage, and which are dropped.

    Members released before keep their stored advantage, whatever was decided from a stale
    look at the group; the others of a released group are late.
    """
    released = [m for m in members if m.released_at is not None]
    if released or decision is Release.REDELIVER:
        late = [m.id for m in members if m.released_at is None]
        return {m.id: float(m.advantage or 0.0) for m in released}, late
    if not decision.trains:
        return {}, [m.id for m in members]
    rewards = [m.reward for m in members]
    if config.shuffle_rewards:
        # In id order, seeded by the ids: the same permutation whatever order they come in.
        members = sorted(members, key=lambda m: str(m.id))
        rewards = [m.reward for m in members]
        random.Random(",".join(str(m.id) for m in members)).shuffle(rewards)
    advantages = group_advantages(rewards, scale_std=config.scale_std)
    return {m.id: float(a) for m, a in zip(members, advantages, strict=True)}, []


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
    taken: bool = False
    trained: int = 0  # set when the trainer takes it: tokens it trains, and those masked stale
    stale: int = 0


Metrics = dict[str, float | tuple[float, float]]


@dataclass
class GroupBatch:
    samples: list[RolloutSample]
    pending: list[Pending]  # one per sample
    skipped: list[Entry]  # traces that will never train
    metrics: Metrics
    counts: Counter[str]


def build_group(
    members: Sequence[Member],
    advantages: Mapping[UUID, float],
    traces: Mapping[UUID, Sequence[tuple[int, MergedSequence]]],
    *,
    group_id: int,
    config: SourceConfig,
    decode: Callable[[np.ndarray], str] | None = None,
) -> GroupBatch:
    """Samples and metrics of the members of one released group that train.

    `members` are the claimed rollouts in `advantages`, `traces` their undelivered trainable
    sequences with their indexes. Every sequence gets its rollout's advantage, so a rollout
    merged into many sequences counts once in its group's statistics.
    """
    samples: list[RolloutSample] = []
    pending: list[Pending] = []
    skipped: list[Entry] = []
    counts: Counter[str] = Counter(rollouts=len(members))
    sequences: list[int] = []
    drift, transitions = 0, 0
    for member in members:
        indexed = traces.get(member.id, [])
        seqs = [seq for _, seq in indexed]
        sequences.append(len(seqs))
        stats = member.merge_stats or {}
        drift += int(stats.get("causes", {}).get("drift", 0))
        transitions += max(int(stats.get("calls", 0)) - 1, 0)
        counts["unscorable"] += member.reward is None
        prompt, completion = _texts(seqs[0], decode) if seqs and decode else (None, None)
        kept, reasons = rollout_samples(
            seqs,
            advantage=advantages[member.id],
            group_id=group_id,
            max_tokens=config.token_budget,
            reward=member.reward,
            prompt=prompt,
            completion=completion,
        )
        kept_seqs = iter(kept)
        for (idx, seq), reason in zip(indexed, reasons, strict=True):
            if reason is not None:
                counts[_OUTCOME[reason]] += 1
                left_out = int(trained_mask(seq).sum())
                skipped.append(Entry(member.id, idx, _OUTCOME[reason], 0, left_out))
                continue
            sample = next(kept_seqs)
            sample.model_version -= config.version_offset
            samples.append(sample)
            versions = np.asarray(seq.versions, dtype=np.int64) - config.version_offset
            pending.append(Pending(member.id, idx, versions))
    counts["samples"] = len(samples)
    metrics = _group_metrics(members, sequences, drift, transitions, counts)
    return GroupBatch(samples, pending, skipped, metrics, counts)


def _group_metrics(
    members: Sequence[Member], sequences: list[int], drift: int, transitions: int,
    counts: Counter[str],
) -> Metrics:
    rewards = np.array([m.reward for m in members if m.reward is not None], np.float64)
    return {
        "rollout/reward_mean": float(rewards.mean()) if rewards.size else math.nan,
        "rollout/reward_std": float(rewards.std()) if rewards.size else math.nan,
        "rollout/group_size": float(len(members)),
        "rollout/sequences_per_rollout": float(np.mean(sequences)) if sequences else math.nan,
        "rollout/drift_rate": (float(drift), float(transitions)),
        "rollout/unscorable_total": float(counts["unscorable"]),
        "rollout/too_long_sequences_total": float(counts["too_long"]),
        "rollout/untrained_sequences_total": float(counts["untrained"]),
    }


def _texts(seq: MergedSequence, decode: Callable[[np.ndarray], str]) -> tuple[str, str]:
    """Context before the first trained token, and the rest: for TRL's sample logs only."""
    first = int(np.argmax(trained_mask(seq)))
    ids = np.asarray(seq.input_ids)
    return decode(ids[:first]), decode(ids[first:])


def mask_stale(
    completion_mask: np.ndarray, versions: np.ndarray, trainer_version: int, max_staleness: int
) -> np.ndarray:
    """The trained tokens still fresh at `trainer_version`: a token trains while it is at most
    `max_staleness` versions behind."""
    return (np.asarray(completion_mask) != 0) & (versions >= trainer_version - max_staleness)
