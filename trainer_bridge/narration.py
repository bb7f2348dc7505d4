"""What the bridge says while it trains nothing: a group that gives the trainer no trainable
token, a run of such groups, and a wait for a step that does not come.

A bridge fed useless rollouts (side calls only, everything constrained, equal rewards) or too
few tokens for a step looks exactly like a stuck one unless it says so. The `Narrator` decides
what to say and when (pure, with a clock given); the rollout source feeds it and prints.
- A group that contributes no trainable token: one line naming the cause and what changes it,
  at most one per cause every `every_s`, with the count of such groups since the last line.
- The last `window` released groups all trained nothing: a warning every `every_s`.
- No optimizer step for `every_s` while the trainer waits for samples (not while a long step
  runs): what is buffered (samples, tokens, rollouts, groups), what waits for members, and what a
  step needs, every `every_s`.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from core.store.ledger import FLAGS, account


@dataclass(frozen=True)
class Waiting:
    """What the source holds for the trainer, and what it waits for, at one look."""

    samples: int  # handed to the trainer, not yet in a logged step
    tokens: int  # their total length
    longest: int  # the longest of them
    rollouts: int
    groups: int
    gathering: int = 0  # groups with finished members that wait for the rest
    gathered: int = 0  # finished rollouts in those groups
    deadline_in_s: float | None = None  # until the first of them is released partial
    # The trainer is blocked for its next sample, not busy with a long step.
    trainer_waiting: bool = True


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
        every_s: float = 30.0,
        window: int = 4,
        say: Callable[[str], None] = print,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.num_generations, self.token_budget = num_generations, token_budget
        self.group_deadline_s, self.every_s, self.window = group_deadline_s, every_s, window
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
                f"{FLAGS.get(cause, 'rollouts whose calls sample tokens')}"
            )
        if waiting.trainer_waiting and now - self._waiting_said_at >= self.every_s:
            self._waiting_said_at = now
            self.say(self.waiting_line(waiting, now - self._since))

    def waiting_line(self, w: Waiting, waited_s: float) -> str:
        line = (
            f"rolltap bridge: no optimizer step for {waited_s:.0f} s. Buffered: {w.samples} "
            f"samples, {w.tokens} tokens, of {w.rollouts} rollouts in {w.groups} groups; a step "
            f"needs more than --token-budget {self.token_budget} tokens"
        )
        if w.tokens and w.tokens <= self.token_budget:
            line += f" (short by {self.token_budget - w.tokens + 1}: more rollouts"
            # A micro-batch closes when the next sample does not fit, and a sample longer than
            # the budget is dropped: a budget in [longest, tokens) steps on what is here.
            if w.longest < w.tokens:
                line += (
                    f", or restart with --token-budget {max(w.longest, w.tokens // 2)} to "
                    "train on what is here: nothing a step has not logged is lost"
                )
            line += ")"

        if w.gathering:
            deadline = (
                f", the first released at --group-deadline in {w.deadline_in_s:.0f} s"
                if w.deadline_in_s is not None and w.deadline_in_s > 0 else ""
            )
            line += (
                f". {w.gathering} groups wait for their members ({w.gathered} rollouts finished, "
                f"--num-generations {self.num_generations}{deadline})"
            )
        elif not w.samples:
            line += ". No finished rollout waits: is the runner producing any?"
        return line


def group_account(
    members: Sequence[Mapping],
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
        ledger = account(member["merge_stats"] or {}, advantages.get(member["id"]),
                         logged.get(member["id"], ()), dropped=member["id"] in dropped)
        trained += ledger.trained_tokens
        excluded.update(ledger.excluded_tokens)
    return trained, excluded
