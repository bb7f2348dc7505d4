"""What the bridge says while it trains nothing: a group that gives the trainer no trainable
token, a run of such groups, and a wait for a step that does not come.

A bridge fed useless rollouts (side calls only, everything constrained, equal rewards) or too
few tokens for a step looks exactly like a stuck one unless it says so. The `Narrator` decides
what to say and when (pure, with a clock given); the rollout source feeds it and prints.
- A group that contributes no trainable token: one line naming the cause and what changes it,
  at most one per cause every `every_s`, with the count of such groups since the last line.
- The last `window` released groups all trained nothing: a warning every `every_s`.
- No optimizer step for `every_s` while the trainer waits for samples (not while a long step
  runs), every `every_s`: the micro-batch the trainer holds open, counted as TRL's packer counts
  it (unique tokens and loss terms, each bounded by --token-budget per row) and when it trains
  as it is (--flush-after), and what waits for members.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from core.store.ledger import FLAGS, account
from trainer_bridge.handover import Held
from trainer_bridge.release import Member


@dataclass(frozen=True)
class Waiting:
    """What the source holds for the trainer, and what it waits for, at one look."""

    samples: int  # handed to the trainer, not yet in a logged step
    taken: int  # of them, taken off the queue by the trainer (in a micro-batch)
    gathering: int = 0  # groups with finished members that wait for the rest
    gathered: int = 0  # finished rollouts in those groups
    deadline_in_s: float | None = None  # until the first of them is released partial
    # The trainer is blocked for its next sample, not busy with a long step.
    trainer_waiting: bool = True
    held: Held = Held()  # the micro-batch the trainer holds open
    flush_in_s: float | None = None  # until it trains as it is; None: it cannot yet
    queued: int = 0  # samples on the queue, not taken by the trainer yet


def _causes(excluded: Mapping[str, int]) -> str:
    top = sorted(((n, c) for c, n in excluded.items() if n), key=lambda nc: (-nc[0], nc[1]))
    return ", ".join(f"{c} {n}" for n, c in top) or "no sampled token"


def _lead(excluded: Mapping[str, int]) -> str | None:
    top = max(((n, c) for c, n in excluded.items() if n), default=None)
    return top[1] if top else None


class Narrator:
    def __init__(
        self,
        *,
        num_generations: int,
        token_budget: int,
        group_deadline_s: float,
        flush_after_s: float = 60.0,
        every_s: float = 30.0,
        window: int = 4,
        say: Callable[[str], None] = print,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.num_generations, self.token_budget = num_generations, token_budget
        self.group_deadline_s, self.every_s, self.window = group_deadline_s, every_s, window
        self.flush_after_s = flush_after_s
        self.say, self.clock = say, clock
        self._last_cause_line: dict[str, float] = {}
        self._held: Counter = Counter()  # groups per cause not yet said
        self._recent: deque[tuple[int, Counter]] = deque(maxlen=window)
        self._warned_at = -float("inf")
        self._since = clock()  # the last step, or the start
        self._waiting_said_at = self._since

    def group_released(self, group: str, rollouts: int, trained: int,
                       excluded: Mapping[str, int]) -> None:
        """A group was released (or dropped): `trained` tokens go to the loss, `excluded` by
        cause do not."""
        self._recent.append((trained, Counter(excluded)))
        if trained:
            return
        cause = _lead(excluded) or "empty"
        now = self.clock()
        self._held[cause] += 1
        if now - self._last_cause_line.get(cause, -float("inf")) < self.every_s:
            return
        count, self._held[cause] = self._held[cause], 0
        self._last_cause_line[cause] = now
        more = f" (and {count - 1} more such groups since the last line)" if count > 1 else ""
        what = FLAGS.get(cause, "rollouts whose calls sample tokens")
        self.say(
            f"rolltap bridge: group {group} ({rollouts} rollouts) gives the trainer no trainable "
            f"token{more}: excluded {_causes(excluded)}. What changes it: {what}"
        )

    def stepped(self) -> None:
        self._since = self._waiting_said_at = self.clock()

    def tick(self, waiting: Waiting) -> None:
        """Called often while the bridge runs; speaks only when something is due."""
        now = self.clock()
        if (
            len(self._recent) == self.window
            and not any(trained for trained, _ in self._recent)
            and now - self._warned_at >= self.every_s
        ):
            self._warned_at = now
            excluded = sum((c for _, c in self._recent), Counter())
            cause = _lead(excluded)
            self.say(
                f"rolltap bridge: warning: the last {self.window} groups this bridge consumed "
                f"trained nothing (excluded {_causes(excluded)}). What changes it: "
                f"{FLAGS.get(cause or '', 'rollouts whose calls sample tokens')}"
            )
        if waiting.trainer_waiting and now - self._waiting_said_at >= self.every_s:
            self._waiting_said_at = now
            self.say(self.waiting_line(waiting, now - self._since))

    def waiting_line(self, w: Waiting, waited_s: float) -> str:
        line = f"rolltap bridge: no optimizer step for {waited_s:.0f} s. " + self._holding(w)
        if w.queued:
            line += f" {w.queued} more samples are queued for it."
        if w.gathering:
            deadline = (
                f", the first released at --group-deadline in {w.deadline_in_s:.0f} s"
                if w.deadline_in_s is not None and w.deadline_in_s > 0 else ""
            )
            line += (
                f" {w.gathering} groups wait for their members ({w.gathered} rollouts finished, "
                f"--num-generations {self.num_generations}{deadline})."
            )
        elif not w.held.samples and not w.queued:
            line += " No finished rollout waits: is the runner producing any?"
        return line

    def _holding(self, w: Waiting) -> str:
        held = w.held
        if not held.samples:
            return "The trainer holds no sample."
        what = (
            f"The trainer holds a partial micro-batch: {held.samples} samples, "
            f"{held.unique_tokens} unique tokens and {held.loss_terms} loss terms as TRL's "
            f"packer counts them (a row closes when the next sample would take either past "
            f"--token-budget {self.token_budget})"
        )
        if w.taken > held.samples:
            # Accelerate's dispatcher holds the micro-batch before the open one.
            what += (f", after a full one of {w.taken - held.samples} samples that trains "
                     "first")
        if w.flush_in_s is None:
            return (f"{what}; it trains once each of the {held.rows} ranks' rows holds a "
                    f"sample ({held.rows_filled} do).")
        return (f"{what}; it trains as it is in {w.flush_in_s:.0f} s unless a sample arrives "
                f"first (--flush-after {self.flush_after_s:g}).")


def group_account(
    members: Sequence[Member],
    advantages: Mapping,
    dropped: Collection,
    entries: Iterable[tuple],
) -> tuple[int, Counter]:
    """Trainable tokens of a group at its release, and the tokens excluded by cause (pure):
    `members` the claimed rollouts (`id`, `merge_stats`), `entries` (rollout id, outcome, tokens
    trained, tokens left out) of every trace handed to the trainer or put aside."""
    logged: dict = {}
    for rollout_id, *entry in entries:
        logged.setdefault(rollout_id, []).append(tuple(entry))
    trained, excluded = 0, Counter()
    for member in members:
        ledger = account(member.merge_stats or {}, advantages.get(member.id),
                         logged.get(member.id, ()), dropped=member.id in dropped)
        trained += ledger.trained_tokens
        excluded.update(ledger.excluded_tokens)
    return trained, excluded
