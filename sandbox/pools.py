"""Separate concurrency limits for a sandbox's phases: setup (image unpack, the task's setup
command), agent (the harness) and verification (the hidden tests).

With one limit for whole sandboxes, a slow verifier holds a slot an agent could use, and a
queue of image unpacks holds agent slots while no model call is made. Each phase here takes a
slot of its own pool only while it runs, so `--agent-slots` bounds the harnesses talking to the
engines and nothing else. Each pool measures how long phases waited for a slot (`queue wait`),
what the summary and `/metrics` report.

A pool with no limit still measures (its waits are 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Literal

import msgspec

PhaseName = Literal["setup", "agent", "verify"]
PHASES: tuple[PhaseName, ...] = ("setup", "agent", "verify")


class PoolStats(msgspec.Struct, frozen=True):
    limit: int | None
    busy: int  # phases holding a slot now
    waiting: int  # phases queued for one now
    taken: int  # slots taken so far
    wait_s: float  # total time phases queued
    max_wait_s: float

    @property
    def mean_wait_s(self) -> float:
        return self.wait_s / self.taken if self.taken else 0.0


class Pool:
    def __init__(self, limit: int | None) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"a pool's limit is at least 1, not {limit}")
        self.limit = limit
        self._slots = asyncio.Semaphore(limit) if limit is not None else None
        self.busy = self.waiting = self.taken = 0
        self.wait_s = self.max_wait_s = 0.0

    async def acquire(self) -> float:
        """Takes a slot, waiting for one; returns the seconds waited."""
        started = time.monotonic()
        self.waiting += 1
        try:
            if self._slots is not None:
                await self._slots.acquire()
        finally:
            self.waiting -= 1
        waited = time.monotonic() - started
        self.note(waited)
        self.busy += 1
        return waited

    def release(self) -> None:
        self.busy -= 1
        if self._slots is not None:
            self._slots.release()

    def note(self, waited_s: float) -> None:
        """Counts a slot taken after `waited_s` (here, or in a worker that reports it)."""
        self.wait_s += waited_s
        self.max_wait_s = max(self.max_wait_s, waited_s)
        self.taken += 1

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        await self.acquire()
        try:
            yield
        finally:
            self.release()

    def stats(self) -> PoolStats:
        return PoolStats(self.limit, self.busy, self.waiting, self.taken, self.wait_s,
                         self.max_wait_s)


class PhasePools:
    """One pool per phase; limits None: that phase is bounded only by the run's concurrency."""

    def __init__(self, setup: int | None = None, agent: int | None = None,
                 verify: int | None = None) -> None:
        self.pools: dict[PhaseName, Pool] = {
            "setup": Pool(setup), "agent": Pool(agent), "verify": Pool(verify)}

    def slot(self, phase: PhaseName) -> contextlib.AbstractAsyncContextManager[None]:
        return self.pools[phase].slot()

    def limits(self) -> dict[str, int]:
        return {name: p.limit for name, p in self.pools.items() if p.limit is not None}

    def note(self, phase: str, waited_s: float) -> None:
        """A slot taken elsewhere (a worker's) after `waited_s`; unknown phases are ignored."""
        for name, pool in self.pools.items():
            if name == phase:
                pool.note(waited_s)

    def stats(self) -> dict[PhaseName, PoolStats]:
        return {name: pool.stats() for name, pool in self.pools.items()}


class Holder:
    """One sandbox moving through the pools, for code told of phase changes by events (Harbor's
    trial hooks) rather than running the phases itself: entering a phase leaves the one held."""

    def __init__(self, pools: PhasePools) -> None:
        self.pools = pools
        self.held: Pool | None = None
        self.waited_s: dict[PhaseName, float] = {}

    async def enter(self, phase: PhaseName) -> None:
        self.leave()
        pool = self.pools.pools[phase]
        waited = await pool.acquire()
        self.held = pool
        self.waited_s[phase] = self.waited_s.get(phase, 0.0) + waited

    def leave(self) -> None:
        if self.held is not None:
            held, self.held = self.held, None
            held.release()


def stats_line(stats: dict[PhaseName, PoolStats]) -> str:
    """`setup 8 slots, waited 0.1 s mean (max 2.0 s); agent ...`: the summary's line."""
    parts = []
    for name, s in stats.items():
        limit = "no limit" if s.limit is None else f"{s.limit} slots"
        parts.append(f"{name} {limit}, {s.taken} taken, queue wait {s.mean_wait_s:.1f} s mean "
                     f"(max {s.max_wait_s:.1f} s)")
    return "pools: " + "; ".join(parts)
