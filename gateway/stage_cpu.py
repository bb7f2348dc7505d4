"""The gateway's own CPU per stage of a model call, for `make bench` and `/metrics`.

Only the synchronous sections are charged, as the thread's CPU time between two marks: the
clock is paused over every await that may let other calls run (the database, the engine, the
client), so what one call is charged is its own work, at any concurrency. A mark costs about
0.6 µs (a `clock_gettime` system call); a call takes a few dozen."""

from __future__ import annotations

from collections.abc import Awaitable
from time import thread_time_ns
from typing import TypeVar

T = TypeVar("T")

# parse: the harness body to the engine's request; plan: the continuation step; engine: the
# exchange with the replica (encoding the body, decoding and capturing its answer); stream: a
# streamed answer's chunks, captured and translated for the client together; record: the row
# built and, once committed, remembered; respond: the client's response built.
STAGES = ("parse", "plan", "engine", "stream", "record", "respond")


class StageCpu:
    """Nanoseconds of CPU per stage, summed over every call of the process."""

    __slots__ = ("ns", "calls")

    def __init__(self) -> None:
        self.ns: dict[str, int] = dict.fromkeys(STAGES, 0)
        self.calls = 0

    def clock(self) -> Clock:
        self.calls += 1
        return Clock(self.ns)


class Clock:
    """One call's marks; `lap(stage)` charges the CPU since the last mark to `stage`."""

    __slots__ = ("_ns", "_mark")

    def __init__(self, ns: dict[str, int]) -> None:
        self._ns = ns
        self._mark = thread_time_ns()

    def lap(self, stage: str) -> None:
        now = thread_time_ns()
        self._ns[stage] += now - self._mark
        self._mark = now

    def resume(self) -> None:
        """After an await: what ran meanwhile is not this call's."""
        self._mark = thread_time_ns()

    async def wait(self, stage: str, awaitable: Awaitable[T]) -> T:
        """`await awaitable`, the CPU so far charged to `stage` and the wait to nobody."""
        self.lap(stage)
        try:
            return await awaitable
        finally:
            self.resume()
