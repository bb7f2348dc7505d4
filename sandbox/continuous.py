"""A continuous run: groups sampled from a task pool, one after another, until the trainer has
taken the steps it asked for or a deadline passes (`rolltap rollouts --continuous`).

Tasks are drawn with a seeded random generator, so a run's order can be had again. The runner's
`--max-backlog` keeps the samples fresh: a group starts only while the trainer keeps up.

Online difficulty filtering (`--filter-flat`): a task whose last `window` groups all came out
flat (every member passed, or every member failed: equal rewards, so no gradient) is drawn
less: a draw of it is skipped with probability `skip_p`, and the run counts the skips by why.
Its next group, when one is drawn, tells whether it is still flat.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterator, Sequence

from sandbox.gateway_client import GatewayError
from sandbox.tasks import Task

POLL_S = 2.0


def flatness(rewards: Sequence[float | None]) -> str | None:
    """Why a group gives no gradient ("all passed", "all failed", "all equal"), or None."""
    scored = [r for r in rewards if r is not None]
    if len(scored) < 2 or len(set(scored)) > 1:
        return None
    if scored[0] >= 1.0:
        return "all passed"
    return "all failed" if scored[0] <= 0.0 else "all equal"


class TaskSampler:
    """Draws (task, group number) pairs until stopped; learns each group's rewards."""

    def __init__(self, tasks: Sequence[Task], group_size: int, *, seed: int,
                 filter_flat: bool = False, window: int = 2, skip_p: float = 0.75,
                 first_group: int = 0) -> None:
        if not tasks:
            raise ValueError("a continuous run needs at least one task")
        if not 0.0 <= skip_p < 1.0 or window < 1:
            raise ValueError("skip_p must be in [0, 1) and window at least 1")
        self.tasks = list(tasks)
        self.group_size = group_size
        self.random = random.Random(seed)
        self.filter_flat, self.window, self.skip_p = filter_flat, window, skip_p
        self.next_group = first_group
        self.groups = 0  # drawn by this sampler
        self.stopped: str | None = None  # why no group is drawn any more
        self.skipped: Counter[str] = Counter()  # draws skipped, by why
        self._rewards: dict[str, list[float | None]] = {}  # by group id, until it is whole
        self._recent: dict[str, deque[str | None]] = {}  # per task: its last groups' flatness

    def __iter__(self) -> Iterator[tuple[Task, int]]:
        while self.stopped is None:
            task = self.random.choice(self.tasks)
            if (why := self.flat(task.id)) and self.random.random() < self.skip_p:
                self.skipped[why] += 1
                continue
            group, self.next_group = self.next_group, self.next_group + 1
            self.groups += 1
            yield task, group

    def flat(self, task_id: str) -> str | None:
        """Why `task_id` is drawn less: its last `window` groups were all flat the same way."""
        recent = self._recent.get(task_id)
        if not self.filter_flat or recent is None or len(recent) < self.window:
            return None
        return recent[0] if len(set(recent)) == 1 else None

    def ended(self, task_id: str, group_id: str, reward: float | None) -> None:
        """A kept member of `group_id` ended with `reward`."""
        rewards = self._rewards.setdefault(group_id, [])
        rewards.append(reward)
        if len(rewards) == self.group_size:
            del self._rewards[group_id]
            recent = self._recent.setdefault(task_id, deque(maxlen=self.window))
            recent.append(flatness(rewards))

    def stop(self, why: str) -> None:
        self.stopped = self.stopped or why

    def summary(self) -> str:
        skipped = ", ".join(f"{n} {why}" for why, n in self.skipped.most_common()) or "none"
        return (f"continuous: {self.groups} groups drawn from {len(self.tasks)} tasks, stopped: "
                f"{self.stopped or 'interrupted'}; draws skipped as flat: {skipped}")


async def watch(sampler: TaskSampler, policy_version: Callable[[], Awaitable[int]], *,
                until_steps: int | None, deadline_s: float | None) -> None:
    """Stops `sampler` once the gateway's policy version is `until_steps` past the one it had
    when this started (the trainer pushes one version a step), or `deadline_s` passed."""
    start = await policy_version() if until_steps is not None else 0
    ends = None if deadline_s is None else time.monotonic() + deadline_s
    while sampler.stopped is None:
        if ends is not None and time.monotonic() >= ends:
            sampler.stop(f"the deadline ({deadline_s:g} s) passed")
            return
        if until_steps is not None:
            with contextlib.suppress(GatewayError):  # a hiccup: look again next time
                version = await policy_version()
                if version - start >= until_steps:
                    sampler.stop(f"the trainer took {until_steps} steps (policy version "
                                  f"{start} -> {version})")
                    return
        await asyncio.sleep(POLL_S)
