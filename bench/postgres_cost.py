"""Postgres CPU per recorded call, straight from the recorder's INSERT: part of the gateway section.

The gateway's scenarios measure Postgres as deployed (every backend of the gateway's pool), which
mixes in the wake-ups of a busy machine. Here one connection writes `calls` rows exactly as the
recorder does (`executemany` of the recorder's INSERT, its implicit transaction committed before
it returns, `synchronous_commit` as the server has it), and the backend's CPU time comes from
/proc/PID/schedstat (nanoseconds) around the writes:

- the floor: a one-column row committed on its own. At concurrency 1 every call pays one commit
  (a WAL write and flush), so no recorded call costs less than this;
- a later call of a rollout (64 new prompt ids, 32 sampled, its body a delta against its base),
  committed alone (concurrency 1) and in the group commits of a loaded gateway (8 and 64 rows);
- a rollout's first call of an 8k- and a 32k-token context (the whole prompt is new), alone.

Each case runs in interleaved rounds on fresh rows; the table shows the median round.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import uuid

import msgspec
import numpy as np

from bench.bench_gateway import TARGET_POSTGRES_CPU_US
from bench.recorder_variants import _records, migrated
from core.store import calls as calls_store
from core.store import rollouts as rollouts_store

ROUNDS = 7
ROLLOUTS = 64


class Case(msgspec.Struct, frozen=True):
    name: str
    batch: int  # rows per commit
    rows: int  # per round
    prompt_tokens: int = 0  # > 0: a first call with this many new prompt ids


CASES = (
    Case("later call, 1 row/commit (c=1)", 1, 150),
    Case("later call, 8 rows/commit", 8, 480),
    Case("later call, 64 rows/commit", 64, 1280),
    Case("first call, 8k context, 1 row/commit", 1, 40, 8192),
    Case("first call, 32k context, 1 row/commit", 1, 16, 32768),
)


def oncpu_s(pid: int) -> float:
    """CPU seconds process `pid` has run so far (the scheduler's count, in nanoseconds)."""
    with open(f"/proc/{pid}/schedstat", "rb") as f:
        return int(f.read().split()[0]) / 1e9


def _prompt(rng: np.random.Generator, tokens: int) -> bytes:
    # Compressible as real ids are: a vocabulary of 150k, a few hundred ids in use.
    vocab = rng.integers(0, 150_000, 400)
    return vocab[rng.integers(0, vocab.size, tokens)].astype("<i4").tobytes()


class _Rows:
    """Fresh call records, each based on its rollout's previous one, as a conversation's are."""

    def __init__(self, rollouts: list[uuid.UUID]) -> None:
        self._rollouts = rollouts
        self._last: dict[uuid.UUID, uuid.UUID] = {}
        self._rng = np.random.default_rng(0)

    def take(self, case: Case) -> list[tuple]:
        out = []
        for r in _records(self._rollouts, case.rows):
            if case.prompt_tokens:
                r = msgspec.structs.replace(
                    r,
                    prefix_len=0,
                    prompt_len=case.prompt_tokens,
                    prompt_delta=_prompt(self._rng, case.prompt_tokens),
                    request_body=os.urandom(case.prompt_tokens),  # zstd: incompressible
                )
            else:
                base = self._last.get(r.rollout_id)
                r = msgspec.structs.replace(r, base_id=base, request_base=base)
            self._last[r.rollout_id] = r.id
            out.append(calls_store.insert_args(r))
        return out


async def _measure(dsn: str) -> dict:
    conn = await migrated(dsn)
    try:
        # An ordinary table: a temporary one writes no WAL, so its commit would flush nothing.
        await conn.execute("CREATE TABLE bench_commit_floor (x int)")
        pid = conn.get_server_pid()
        rollouts = [uuid.uuid4() for _ in range(ROLLOUTS)]
        for rid in rollouts:
            await rollouts_store.create(conn, rid, os.urandom(16), "bench", None, {}, None)
        rows = _Rows(rollouts)
        await conn.executemany(calls_store.INSERT, rows.take(CASES[0]))  # warm plans and caches
        floor: list[float] = []
        per_case: dict[str, list[float]] = {c.name: [] for c in CASES}
        for _ in range(ROUNDS):
            started = oncpu_s(pid)
            for i in range(CASES[0].rows):
                await conn.execute("INSERT INTO bench_commit_floor VALUES ($1)", i)
            floor.append((oncpu_s(pid) - started) * 1e6 / CASES[0].rows)
            for case in CASES:
                args = rows.take(case)
                started = oncpu_s(pid)
                for at in range(0, len(args), case.batch):
                    await conn.executemany(calls_store.INSERT, args[at : at + case.batch])
                per_case[case.name].append((oncpu_s(pid) - started) * 1e6 / len(args))
        await conn.execute("DROP TABLE bench_commit_floor")
        return {
            "floor_us": statistics.median(floor),
            "cases": {name: statistics.median(v) for name, v in per_case.items()},
        }
    finally:
        await conn.close()


def run(dsn: str, print_fn) -> dict:
    res = asyncio.run(_measure(dsn))
    floor = res["floor_us"]
    lines = [
        f"Postgres CPU per recorded call (the recorder's INSERT on one connection, backend CPU, "
        f"median of {ROUNDS} interleaved rounds; target ≤ {TARGET_POSTGRES_CPU_US:g} µs)",
        f"{'case':<42}{'µs/call':>9}   target",
        f"{'floor: a one-int row, its own commit':<42}{floor:>9.0f}",
    ]
    for case in CASES:
        us = res["cases"][case.name]
        mark = "met" if us <= TARGET_POSTGRES_CPU_US else "MISSED"
        if case.batch == 1 and floor > TARGET_POSTGRES_CPU_US:
            mark += f" (the floor is above {TARGET_POSTGRES_CPU_US:g} µs here)"
        lines.append(f"{case.name:<42}{us:>9.0f}   {mark}")
    print_fn("\n".join(lines))
    return res
