"""The runner's units of work: one rollout per (task, repeat, member), the members of one
(task, repeat) sharing a group id, and the state line each one ends with."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import msgspec

from sandbox.state import FinishedRollout, Key
from sandbox.summary import trained_tokens
from sandbox.tasks import Task

if TYPE_CHECKING:
    from sandbox.backends.base import SandboxResult
    from sandbox.continuous import TaskSampler
    from sandbox.gateway_client import RolloutInfo


class WorkItem(msgspec.Struct, frozen=True):
    task: Task
    repeat: int
    member: int
    group_id: str

    @property
    def key(self) -> Key:
        return (self.task.id, self.repeat, self.member)


def group_id(run_id: str, task_id: str, repeat: int) -> str:
    return f"{run_id}-{task_id}-r{repeat}"


def plan(
    tasks: Sequence[Task], group_size: int, repeat: int, run_id: str, done: set[Key]
) -> list[WorkItem]:
    """The rollouts still to do, group by group, so that groups complete together."""
    return [
        WorkItem(task, r, m, group_id(run_id, task.id, r))
        for r in range(repeat)
        for task in tasks
        for m in range(group_size)
        if (task.id, r, m) not in done
    ]


def sampled_plan(sampler: TaskSampler, members: int, run_id: str) -> Iterator[WorkItem]:
    """A continuous run's rollouts: each drawn group's members, until the sampler stops."""
    for task, group in sampler:
        for m in range(members):
            yield WorkItem(task, group, m, group_id(run_id, task.id, group))


def record_for(
    item: WorkItem,
    rollout_id: str,
    result: SandboxResult,
    info: RolloutInfo | None,
    duration_s: float,
) -> FinishedRollout:
    calls = prompt = completion = trained = None
    if info is not None:
        calls = len(info.calls)
        prompt = sum(c.prompt_tokens or 0 for c in info.calls)
        completion = sum(c.completion_tokens or 0 for c in info.calls)
        trained = trained_tokens(info.merge_stats, completion)
    return FinishedRollout(
        task_id=item.task.id,
        repeat=item.repeat,
        member=item.member,
        rollout_id=rollout_id,
        group_id=item.group_id,
        status=result.gateway_status,
        sandbox_status=result.status,
        reward=result.reward,
        reward_detail=result.reward_detail,
        duration_s=duration_s,
        calls=calls,
        prompt_tokens=prompt,
        completion_tokens=completion,
        trained_tokens=trained,
        host=result.host,
        isolation=result.isolation,
    )


def failed_record(item: WorkItem, rollout_id: str, detail: str, duration_s: float,
                  status: str = "failed") -> FinishedRollout:
    """The state line of a rollout whose sandbox failed (the runner's or the machine's fault:
    unscorable), or (status `aborted`) that the runner stopped."""
    return FinishedRollout(task_id=item.task.id, repeat=item.repeat, member=item.member,
                           rollout_id=rollout_id, group_id=item.group_id, status=status,
                           sandbox_status="error" if status == "failed" else status,
                           reward=None, reward_detail=detail, duration_s=duration_s)
