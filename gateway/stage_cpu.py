"""With `--cpu-account`: the gateway's own CPU per stage of a model call and every other part of
the process's CPU, for `make bench` and `/metrics`. Without it nothing is read: a clock read
is a system call on the VMs the bench runs on (1.6 µs), and a call took a dozen.

With the account (`StageCpu.meter_tasks`), every task of the loop runs through `Metered`, which
reads the thread's CPU clock around each step of the task: a task's own CPU, whatever else runs
between its steps. A call's clock then charges the stage its task's own CPU since the last
mark, awaits included. What remains is charged by where it ran: `server` (aiohttp's request
tasks outside the stages), `client` (the engine client's body writers), `commit` (the
recorder's writer task), `tasks` (any other task), `loop` (the main thread outside every task:
the event loop and the protocol callbacks that parse HTTP and Postgres replies) and `threads`
(the process's other threads). `loop` and `threads` are differences of two clocks (the main
thread's and the process's), not counted step by step. A mark costs about 0.6 µs (a
`clock_gettime` system call); a call takes a few dozen."""

from __future__ import annotations

import asyncio
import types
from collections.abc import Awaitable, Coroutine, Generator
from time import process_time_ns, thread_time_ns
from typing import Any, TypeVar

T = TypeVar("T")

# parse: the harness body to the engine's request; plan: the continuation step; engine: the
# exchange with the replica (encoding the body, decoding and capturing its answer); stream: a
# streamed answer's chunks, captured and translated for the client together; record: the row
# built and, once committed, remembered; respond: the client's response built.
STAGES = ("parse", "plan", "engine", "stream", "record", "respond")
ACCOUNT = ("server", "client", "commit", "tasks", "loop", "threads")
# A task's part of the account, by its coroutine's qualified name.
_TASK_PART = {
    "RequestHandler.start": "server",
    "RequestHandler._handle_request": "server",
    "ClientRequest.write_bytes": "client",
    "Recorder._write_forever": "commit",
}


class Metered(Coroutine[Any, Any, Any]):
    """A task's coroutine, its own CPU read around each step (send or throw)."""

    __slots__ = ("_coro", "_into", "ns", "_step")

    def __init__(self, coro: Coroutine[Any, Any, Any], into: dict[str, int], part: str) -> None:
        self._coro = coro
        self._into = (into, part)
        self.ns = 0  # this task's CPU in finished steps
        self._step = 0  # when the running step began

    def own_ns(self) -> int:
        """This task's CPU so far, the running step's included (call it from within)."""
        return self.ns + thread_time_ns() - self._step

    def send(self, value: Any) -> Any:
        self._step = thread_time_ns()
        try:
            return self._coro.send(value)
        finally:
            self._charge()

    def throw(self, *exc: Any) -> Any:
        self._step = thread_time_ns()
        try:
            return self._coro.throw(*exc)
        finally:
            self._charge()

    def _charge(self) -> None:
        spent = thread_time_ns() - self._step
        self.ns += spent
        into, part = self._into
        into[part] += spent

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, None, Any]:
        return self._coro.__await__()


class StageCpu:
    """Nanoseconds of CPU per stage, summed over every call of the process; with the account,
    per part of the process too."""

    __slots__ = ("ns", "calls", "on", "_tasks", "_origin")

    def __init__(self, on: bool = False) -> None:
        self.ns: dict[str, int] = dict.fromkeys(STAGES, 0)
        self.calls = 0
        self.on = on  # off: every call gets a clock that reads nothing
        self._tasks: dict[str, int] | None = None  # CPU of metered tasks, by part
        self._origin = (0, 0)  # (main thread, process) CPU when the account began

    def clock(self) -> Clock:
        self.calls += 1
        if not self.on:
            return NO_CLOCK
        meter = None
        if self._tasks is not None:
            task = asyncio.current_task()
            coro = task.get_coro() if task is not None else None
            meter = coro if isinstance(coro, Metered) else None
        return Clock(self.ns, meter)

    def meter_tasks(self, loop: asyncio.AbstractEventLoop) -> None:
        """Every task the loop starts from now on is metered (call it from the loop's thread)."""
        self.on = True
        tasks = self._tasks = dict.fromkeys(ACCOUNT, 0)
        self._origin = (thread_time_ns(), process_time_ns())

        def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task:
            name = coro.__qualname__ if isinstance(coro, types.CoroutineType) else ""
            part = _TASK_PART.get(name, "tasks")
            return asyncio.Task(Metered(coro, tasks, part), loop=loop, **kwargs)

        loop.set_task_factory(factory)

    def account(self) -> dict[str, int]:
        """CPU so far by stage and, with the account, by part (read from the loop's thread)."""
        if self._tasks is None:
            return dict(self.ns)
        parts = dict(self._tasks)
        stages = sum(self.ns.values())
        thread, process = thread_time_ns(), process_time_ns()
        parts["server"] -= stages  # the stages ran inside the server's request tasks
        parts["loop"] = thread - self._origin[0] - sum(self._tasks.values())
        parts["threads"] = process - self._origin[1] - (thread - self._origin[0])
        return {**self.ns, **parts}


class Clock:
    """One call's marks; `lap(stage)` charges the CPU since the last mark to `stage`: the
    call's task's own CPU where the task is metered, else the thread's."""

    __slots__ = ("_ns", "_mark", "_meter")

    def __init__(self, ns: dict[str, int], meter: Metered | None = None) -> None:
        self._ns = ns
        self._meter = meter
        self._mark = self._now()

    def _now(self) -> int:
        return self._meter.own_ns() if self._meter is not None else thread_time_ns()

    def lap(self, stage: str) -> None:
        now = self._now()
        self._ns[stage] += now - self._mark
        self._mark = now

    def resume(self) -> None:
        """After an await: what ran meanwhile is not this call's (unmetered: the thread's
        clock counts every task)."""
        self._mark = self._now()

    def wait(self, stage: str, awaitable: Awaitable[T]) -> Awaitable[T]:
        """`awaitable`, to be awaited, the CPU so far charged to `stage`; metered, the task's
        own CPU inside the await too, else the wait to nobody."""
        return self._wait(stage, awaitable)

    async def _wait(self, stage: str, awaitable: Awaitable[T]) -> T:
        self.lap(stage)
        try:
            return await awaitable
        finally:
            if self._meter is not None:
                self.lap(stage)
            else:
                self.resume()


class NoClock(Clock):
    """The clock of a gateway without the account: no reads, no frames."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__({})

    def _now(self) -> int:
        return 0

    def lap(self, stage: str) -> None:
        pass

    def resume(self) -> None:
        pass

    def wait(self, stage: str, awaitable: Awaitable[T]) -> Awaitable[T]:
        return awaitable


NO_CLOCK = NoClock()
