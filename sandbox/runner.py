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
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec

from sandbox.backends.base import Backend, CrashReward, SandboxRequest, SandboxResult
from sandbox.continuous import TaskSampler, watch
from sandbox.gateway_client import AdminClient, GatewayError, RolloutInfo
from sandbox.oversample import GroupQuota, Oversampling
from sandbox.presets import Harness, side_calls_for
from sandbox.state import FinishedRollout, Key, RunHeader, StateFile
from sandbox.tasks import Task
from sandbox.work import WorkItem, failed_record, plan, record_for, sampled_plan

# Time the gateway gives a rollout beyond the task's own timeouts before it calls it timed out.
GATEWAY_MARGIN_S = 120.0
BACKLOG_POLL_S = 1.0  # how often a full backlog is looked at again
INTERRUPT_FINISH_TIMEOUT_S = 10.0


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
    aborted: int = 0  # stragglers stopped once their group had enough (oversampling)
    unneeded: int = 0  # extra members never started: their group was full first


class Progress(msgspec.Struct, frozen=True):
    done: int
    total: int
    running: int  # sandboxes running now


def gateway_timeout(task: Task) -> float:
    t = task.timeouts
    return t.setup_s + t.agent_s + t.verifier_s + GATEWAY_MARGIN_S


UNANSWERED = ("unscorable: unanswered: the agent failed before the gateway answered any of "
              "its calls")


def answered_or_unscorable(result: SandboxResult, info: RolloutInfo) -> SandboxResult:
    """A failed agent's judged result stands once the gateway answered one of its calls (the
    model's replies made it fail); without one, the failure is outside the policy's reach (the
    harness never started, the gateway refused): unscorable. Pure."""
    if any(call.status == "ok" for call in info.calls):
        return result
    return msgspec.structs.replace(result, status="setup_failed", reward=None,
                                   reward_detail=f"{UNANSWERED} ({result.reward_detail})")


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
        total: Callable[[], int],
        max_backlog: int | None,
        on_finished: Callable[[FinishedRollout, Progress], None] | None,
        on_error: Callable[[ItemError, Progress], None] | None,
        oversampling: Oversampling | None = None,
        kept: Sequence[str] = (),
        drawing_stopped: Callable[[], bool] = lambda: False,
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
        self.oversampling = oversampling
        self.quota = GroupQuota(oversampling.keep, kept) if oversampling else None
        self.running: dict[Key, asyncio.Task] = {}  # rollouts with a task of their own
        self.stragglers: set[Key] = set()  # being stopped: their group is full
        self.sandboxed: set[Key] = set()  # rollouts whose sandbox is running
        self.aborted = self.unneeded = 0
        # A continuous run stopped drawing: a rollout waiting for the trainer is not started
        # (the trainer that would make room may have finished).
        self.drawing_stopped = drawing_stopped

    def progress(self) -> Progress:
        return Progress(self.done, self.total(), self.sandboxes)

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

    async def execute(self, items: Iterable[WorkItem], concurrency: int) -> None:
        queue = iter(items)
        workers = [asyncio.ensure_future(self.worker(queue)) for _ in range(concurrency)]
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
                if self.drawing_stopped():
                    return False
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
            if self.quota is not None and self.quota.full(item.group_id):
                self.unneeded += 1  # an extra member its group no longer needs
                self.done += 1
                continue
            if not await self.admit():
                return
            # A task of its own, so a straggler can be stopped without stopping this worker.
            task = asyncio.ensure_future(self.one(item))
            self.running[item.key] = task
            try:
                await task
            finally:
                self.running.pop(item.key, None)
                self.in_flight -= 1

    def kept(self, item: WorkItem) -> bool:
        """A member whose sandbox ended on its own: kept, or a straggler of a full group. The
        member that fills its group stops the others still running."""
        self.running.pop(item.key, None)  # ended: no longer one to stop
        if self.quota is None:
            return True
        if not self.quota.take(item.group_id):
            return False
        if self.quota.full(item.group_id):
            for key, task in list(self.running.items()):
                other = (key[0], key[1])
                if other == (item.task.id, item.repeat) and key != item.key:
                    self.stragglers.add(key)
                    if key in self.sandboxed:  # else it stops once its rollout is created
                        task.cancel()  # kills its sandbox (the backend's cancel path)
        return True

    async def abort(self, item: WorkItem, rid: str, started: float) -> None:
        """Finishes a straggler `aborted`: the gateway ends its calls in flight; never trained."""
        assert self.oversampling is not None
        why = (f"a straggler: {self.oversampling.keep} members of its group ended first "
               f"(--oversample {self.oversampling.extra}; they train, it does not)")
        try:
            await self.admin.abort_rollout(rid, why)
        except GatewayError as exc:
            self.fail(item, f"abort: {exc}", rid)
            return
        self.aborted += 1
        self.add(failed_record(item, rid, why, time.monotonic() - started, status="aborted"))

    async def one(self, item: WorkItem) -> None:
        started = time.monotonic()
        try:
            access = await self.admin.create_rollout(
                task_id=item.task.id,
                group_id=item.group_id,
                metadata=_metadata(item, self.harness, self.run_id, self.oversampling),
                timeout_s=gateway_timeout(item.task),
                side_calls=side_calls_for(self.harness),
            )
        except GatewayError as exc:
            self.fail(item, f"create: {exc}")
            return
        rid = access.rollout_id
        if item.key in self.stragglers:  # its group filled while it was being created
            await self.abort(item, rid, started)
            return
        request = SandboxRequest(item.task, self.harness, access, self.crash_reward,
                                 self.private_paths)
        self.sandboxes += 1
        self.sandboxed.add(item.key)
        try:
            result = await self.backend.run(request)
        except asyncio.CancelledError:
            if item.key not in self.stragglers or self.stop.is_set():
                await _finish_interrupted(self.admin, rid)
                raise
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()  # stopped on purpose: it ends as aborted, not interrupted
            await self.abort(item, rid, started)
            return
        except Exception as exc:  # a backend failure is this rollout's, not the run's
            await _finish_quietly(self.admin, rid, {"sandbox_error": repr(exc),
                                                   "unscorable_cause": "sandbox_error"})
            if self.state:  # ended: a resumed run must not put a second rollout in its group
                self.state.append(failed_record(item, rid, f"sandbox: {exc!r}",
                                                time.monotonic() - started))
            self.fail(item, f"sandbox: {exc!r}", rid)
            return
        finally:
            self.sandboxes -= 1
            self.sandboxed.discard(item.key)
        if not self.kept(item):  # ended on its own, but after its group was full
            await self.abort(item, rid, started)
            return
        # A sandbox that ran to the end is reported and recorded even if a stop arrives now:
        # redoing it on resume would put a second rollout into its group.
        completing = asyncio.ensure_future(self.complete(item, rid, result, started))
        self.completing.add(completing)
        completing.add_done_callback(self.completing.discard)
        await asyncio.shield(completing)

    async def complete(
        self, item: WorkItem, rid: str, result: SandboxResult, started: float
    ) -> None:
        if result.agent_failed:
            try:
                result = answered_or_unscorable(result, await self.admin.get_rollout(rid))
            except GatewayError:
                pass  # judged by its work, as the backend said
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
    oversample: int = 0,
    sampler: TaskSampler | None = None,
    until_steps: int | None = None,
    deadline_s: float | None = None,
) -> RunReport:
    """Run every (task, repeat, member) rollout not already in the state file. `run_id` names
    a new run (a trainer selects its rollouts by it; default: a random one); a resumed state
    file keeps the run id it was started with. `oversample`: members started per group beyond
    `group_size`; once `group_size` of them ended, the rest are aborted (sandbox/oversample.py).
    `sampler`: a continuous run (sandbox/continuous.py): groups drawn from it instead of
    `tasks` x `repeat`, until `until_steps` trainer steps or `deadline_s`."""
    if group_size < 1 or repeat < 1 or concurrency < 1 or oversample < 0:
        raise ValueError("group_size, repeat and concurrency must be at least 1, oversample "
                         "at least 0")
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
    oversampling = Oversampling(group_size, oversample) if oversample else None
    members = group_size + oversample
    items: Iterable[WorkItem]
    if sampler is None:
        listed = plan(tasks, members, repeat, header.run_id, set(done))
        items, total = listed, len(listed)
    else:
        sampler.next_group = max((r.repeat + 1 for r in done.values()), default=0)
        items = sampled_plan(sampler, members, header.run_id)
        on_finished = _learning(sampler, on_finished)
    stop = stop or asyncio.Event()
    async with AdminClient(gateway, admin_key) as admin:
        run = _Run(admin, harness, backend, run_id=header.run_id, state=state,
                   crash_reward=crash_reward, stop=stop,
                   total=(lambda: total) if sampler is None else (lambda: sampler.groups * members),
                   max_backlog=max_backlog, on_finished=on_finished, on_error=on_error,
                   oversampling=oversampling,
                   kept=[r.group_id for r in done.values() if r.status != "aborted"],
                   drawing_stopped=lambda: sampler is not None and sampler.stopped is not None)
        watcher = None
        if sampler is not None:
            watcher = asyncio.ensure_future(watch(sampler, admin.policy_version,
                                                  until_steps=until_steps, deadline_s=deadline_s))
        try:
            await run.execute(items, concurrency)
        finally:
            if watcher is not None:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
    return RunReport(
        run_id=header.run_id,
        total=run.total() + len(done),
        skipped=len(done),
        finished=run.finished,
        errors=run.errors,
        interrupted=stop.is_set(),
        max_in_flight=run.max_in_flight,
        waited_for_trainer_s=run.waited_s,
        aborted=run.aborted,
        unneeded=run.unneeded,
    )


def _learning(sampler: TaskSampler, then: Callable[[FinishedRollout, Progress], None] | None
              ) -> Callable[[FinishedRollout, Progress], None]:
    """An on_finished that first tells `sampler` each kept member's reward."""
    def finished(record: FinishedRollout, progress: Progress) -> None:
        if record.status != "aborted":
            sampler.ended(record.task_id, record.group_id, record.reward)
        if then is not None:
            then(record, progress)
    return finished


def _metadata(item: WorkItem, harness: Harness, run_id: str,
              oversampling: Oversampling | None) -> dict[str, Any]:
    group = {"group": oversampling.note()} if oversampling else {}
    return group | {
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
