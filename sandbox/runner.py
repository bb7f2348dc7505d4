"""Drive groups of rollouts through the gateway.

One rollout per (task, repeat, member); the members of one (task, repeat) share a group id,
derived from the run id so that a resumed run adds its remaining members to the same groups.
At most `concurrency` rollouts are in flight; a rollout is created at the gateway only when its
sandbox is about to start, so the gateway's timeout clock does not run while it waits.

A crashed or timed-out harness is an ordinary result (status and reward per `crash_reward`); a
failing gateway call or backend is reported as an error for that rollout and the run goes on (a
rollout whose backend failed is in the state file, unscorable, as every one it ended).
Setting `stop` (the CLI does on SIGINT/SIGTERM) starts nothing new, kills the sandboxes in
flight and finishes their rollouts as failed with `metrics.interrupted`; they are not in the
state file, so a resumed run does them again. The admin key stays in this process; the state
file is among the paths a sandbox hides from its agent.

With `max_backlog`, the runner stays at most that many rollouts ahead of training: a rollout
starts only while the run's rollouts in flight plus those ended that no trainer bridge has taken
yet (GET /admin/backlog) are fewer. A bridge takes groups into its own bounded queue as its
trainer needs them (however many samples one optimizer step packs), so samples then wait for
at most that queue plus max_backlog rollouts, instead of growing stale while the runner races
ahead.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from sandbox.backends.base import Backend, CrashReward, SandboxRequest, SandboxResult
from sandbox.gateway_client import AdminClient, GatewayError, RolloutInfo
from sandbox.presets import Harness, side_calls_for
from sandbox.state import FinishedRollout, Key, RunHeader, StateFile
from sandbox.summary import trained_tokens
from sandbox.tasks import Task

# Time the gateway gives a rollout beyond the task's own timeouts before it calls it timed out.
GATEWAY_MARGIN_S = 120.0
BACKLOG_POLL_S = 1.0  # how often a full backlog is looked at again
INTERRUPT_FINISH_TIMEOUT_S = 10.0


class WorkItem(msgspec.Struct, frozen=True):
    task: Task
    repeat: int
    member: int
    group_id: str

    @property
    def key(self) -> Key:
        return (self.task.id, self.repeat, self.member)


class ItemError(msgspec.Struct, frozen=True):
    task_id: str
    repeat: int
    member: int
    message: str
    rollout_id: str | None = None


class RunReport(msgspec.Struct):
    run_id: str
    total: int
    skipped: int  # finished in an earlier run (state file)
    finished: list[FinishedRollout]
    errors: list[ItemError]
    interrupted: bool = False
    max_in_flight: int = 0
    waited_for_trainer_s: float = 0.0  # with max_backlog


class Progress(msgspec.Struct, frozen=True):
    done: int
    total: int
    running: int  # sandboxes running now


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


def gateway_timeout(task: Task) -> float:
    t = task.timeouts
    return t.setup_s + t.agent_s + t.verifier_s + GATEWAY_MARGIN_S


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


def failed_record(item: WorkItem, rollout_id: str, detail: str,
                  duration_s: float) -> FinishedRollout:
    """The state line of a rollout whose sandbox failed (the runner's or the machine's fault:
    unscorable)."""
    return FinishedRollout(task_id=item.task.id, repeat=item.repeat, member=item.member,
                           rollout_id=rollout_id, group_id=item.group_id, status="failed",
                           sandbox_status="error", reward=None, reward_detail=detail,
                           duration_s=duration_s)


class _Run:
    """One run_rollouts call: workers pulling rollouts from a shared plan."""

    def __init__(
        self,
        admin: AdminClient,
        harness: Harness,
        backend: Backend,
        *,
        run_id: str,
        state: StateFile | None,
        crash_reward: CrashReward,
        stop: asyncio.Event,
        total: int,
        max_backlog: int | None,
        on_finished: Callable[[FinishedRollout, Progress], None] | None,
        on_error: Callable[[ItemError, Progress], None] | None,
    ) -> None:
        self.admin, self.harness, self.backend = admin, harness, backend
        self.run_id, self.state, self.stop = run_id, state, stop
        self.crash_reward: CrashReward = crash_reward
        self.private_paths = (os.path.abspath(state.path),) if state else ()
        self.on_finished, self.on_error = on_finished, on_error
        self.total = total
        self.done = 0
        self.in_flight = 0  # rollouts being worked on
        self.max_in_flight = 0
        self.sandboxes = 0  # sandboxes running now
        self.finished: list[FinishedRollout] = []
        self.errors: list[ItemError] = []
        self.completing: set[asyncio.Future] = set()
        self.max_backlog = max_backlog
        self.admitting = asyncio.Lock()  # one worker at a time counts and takes a place
        self.waited_s = 0.0  # time spent waiting for the trainer (max_backlog)

    def progress(self) -> Progress:
        return Progress(self.done, self.total, self.sandboxes)

    def add(self, record: FinishedRollout) -> None:
        if self.state:
            self.state.append(record)
        self.done += 1
        self.finished.append(record)
        if self.on_finished:
            self.on_finished(record, self.progress())

    def fail(self, item: WorkItem, message: str, rollout_id: str | None = None) -> None:
        error = ItemError(item.task.id, item.repeat, item.member, message, rollout_id)
        self.done += 1
        self.errors.append(error)
        if self.on_error:
            self.on_error(error, self.progress())

    async def execute(self, items: list[WorkItem], concurrency: int) -> None:
        queue = iter(items)
        workers = [asyncio.ensure_future(self.worker(queue))
                   for _ in range(min(concurrency, len(items)))]
        stopper = asyncio.ensure_future(self.stop.wait())
        try:
            pending = set(workers)
            while pending:
                finished, pending = await asyncio.wait(
                    pending | {stopper}, return_when=asyncio.FIRST_COMPLETED
                )
                pending.discard(stopper)
                if stopper in finished:
                    break
                for w in finished:
                    w.result()  # a bug in the runner itself must not pass silently
        finally:
            stopper.cancel()
            for w in workers:
                w.cancel()  # kills their sandboxes, finishes their rollouts as interrupted
            await asyncio.gather(*workers, return_exceptions=True)
            await asyncio.gather(*self.completing, return_exceptions=True)

    async def admit(self) -> bool:
        """Takes a place for one more rollout, first waiting for the trainer while the backlog
        is full (with max_backlog); False once the run is stopped."""
        async with self.admitting:
            started = time.monotonic()
            while self.max_backlog is not None and not self.stop.is_set():
                backlog = await self.admin.backlog(self.run_id)
                if self.in_flight + backlog.waiting < self.max_backlog:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), BACKLOG_POLL_S)
            self.waited_s += time.monotonic() - started
            if self.stop.is_set():
                return False
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            return True

    async def worker(self, queue) -> None:
        for item in queue:
            if not await self.admit():
                return
            try:
                await self.one(item)
            finally:
                self.in_flight -= 1

    async def one(self, item: WorkItem) -> None:
        started = time.monotonic()
        try:
            access = await self.admin.create_rollout(
                task_id=item.task.id,
                group_id=item.group_id,
                metadata=_metadata(item, self.harness, self.run_id),
                timeout_s=gateway_timeout(item.task),
                side_calls=side_calls_for(self.harness),
            )
        except GatewayError as exc:
            self.fail(item, f"create: {exc}")
            return
        rid = access.rollout_id
        request = SandboxRequest(item.task, self.harness, access, self.crash_reward,
                                 self.private_paths)
        self.sandboxes += 1
        try:
            result = await self.backend.run(request)
        except asyncio.CancelledError:
            await _finish_interrupted(self.admin, rid)
            raise
        except Exception as exc:  # a backend failure is this rollout's, not the run's
            await _finish_quietly(self.admin, rid, {"sandbox_error": repr(exc)})
            if self.state:  # ended: a resumed run must not put a second rollout in its group
                self.state.append(failed_record(item, rid, f"sandbox: {exc!r}",
                                                time.monotonic() - started))
            self.fail(item, f"sandbox: {exc!r}", rid)
            return
        finally:
            self.sandboxes -= 1
        # A sandbox that ran to the end is reported and recorded even if a stop arrives now:
        # redoing it on resume would put a second rollout into its group.
        completing = asyncio.ensure_future(self.complete(item, rid, result, started))
        self.completing.add(completing)
        completing.add_done_callback(self.completing.discard)
        await asyncio.shield(completing)

    async def complete(
        self, item: WorkItem, rid: str, result: SandboxResult, started: float
    ) -> None:
        try:
            await self.admin.finish_rollout(
                rid, reward=result.reward, status=result.gateway_status,
                metrics=result.metrics(),
            )
        except GatewayError as exc:
            self.fail(item, f"finish: {exc}", rid)
            return
        try:
            info: RolloutInfo | None = await self.admin.get_rollout(rid)
        except GatewayError:
            info = None  # counts unknown; the rollout itself is finished
        self.add(record_for(item, rid, result, info, time.monotonic() - started))


async def run_rollouts(
    tasks: Sequence[Task],
    harness: Harness,
    *,
    gateway: str,
    admin_key: str,
    group_size: int,
    backend: Backend,
    concurrency: int = 4,
    repeat: int = 1,
    state_path: str | None = None,
    crash_reward: CrashReward = "zero",
    stop: asyncio.Event | None = None,
    on_finished: Callable[[FinishedRollout, Progress], None] | None = None,
    on_error: Callable[[ItemError, Progress], None] | None = None,
    max_backlog: int | None = None,
    run_id: str | None = None,
) -> RunReport:
    """Run every (task, repeat, member) rollout not already in the state file. `run_id` names
    a new run (a trainer selects its rollouts by it; default: a random one); a resumed state
    file keeps the run id it was started with."""
    if group_size < 1 or repeat < 1 or concurrency < 1:
        raise ValueError("group_size, repeat and concurrency must be at least 1")
    if max_backlog is not None and max_backlog < group_size:
        # A bridge trains whole groups: a smaller backlog could never complete one.
        raise ValueError(f"max_backlog ({max_backlog}) must be at least the group size "
                         f"({group_size})")
    state = StateFile(state_path) if state_path else None
    header, done = state.load() if state else (None, {})
    if header is not None and run_id is not None and run_id != header.run_id:
        raise ValueError(f"{state_path} belongs to run {header.run_id}, not {run_id}")
    if header is None:
        header = RunHeader(run_id=run_id or uuid.uuid4().hex[:12], created=time.time())
        if state:
            state.append(header)
    items = plan(tasks, group_size, repeat, header.run_id, set(done))
    stop = stop or asyncio.Event()
    async with AdminClient(gateway, admin_key) as admin:
        run = _Run(admin, harness, backend, run_id=header.run_id, state=state,
                   crash_reward=crash_reward, stop=stop, total=len(items),
                   max_backlog=max_backlog, on_finished=on_finished, on_error=on_error)
        await run.execute(items, concurrency)
    return RunReport(
        run_id=header.run_id,
        total=len(items) + len(done),
        skipped=len(done),
        finished=run.finished,
        errors=run.errors,
        interrupted=stop.is_set(),
        max_in_flight=run.max_in_flight,
        waited_for_trainer_s=run.waited_s,
    )


def _metadata(item: WorkItem, harness: Harness, run_id: str) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "repeat": item.repeat,
        "member": item.member,
        "harness": harness.preset,
        "model": harness.model,
        "task": item.task.metadata,
    }


async def _finish_quietly(admin: AdminClient, rollout_id: str, metrics: dict[str, Any]) -> None:
    try:
        await admin.finish_rollout(rollout_id, reward=None, status="failed", metrics=metrics)
    except GatewayError:
        pass  # the gateway's own timeout will close the rollout


async def _finish_interrupted(admin: AdminClient, rollout_id: str) -> None:
    finish = _finish_quietly(admin, rollout_id, {"interrupted": True})
    try:
        await asyncio.wait_for(asyncio.shield(finish), INTERRUPT_FINISH_TIMEOUT_S)
    except (TimeoutError, asyncio.CancelledError):
        pass
