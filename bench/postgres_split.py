"""What each part of rolltap's row costs Postgres, beside the recorder floor's row: part of the
floors section (`bench/bench_floors.py`).

One connection writes rows in group commits of 1 and 64 (c=1 and a loaded gateway's batches),
each variant in turn over interleaved rounds, and the backend's CPU (/proc/PID/schedstat) per
row is taken around the writes:

- the floor's row (`bench/recorder_floor.py`: key, 512 prompt ids, 32 sampled, 32 logprobs);
- rolltap's row as recorded (`calls.INSERT`, a later call: 64 new prompt ids, bodies);
- the same without the rollout UPDATE its statement carries (the guarantee that numbers a
  rollout's calls in commit order, refuses calls of an ended rollout and holds its limits,
  under the rollout's row lock): seq from a sequence instead;
- the same without bodies (`--no-record-bodies`).
"""

from __future__ import annotations

import asyncio
import statistics
import uuid

import msgspec
import numpy as np

from bench import recorder_floor
from bench.postgres_cost import oncpu_s
from bench.recorder_variants import migrated, records
from core.store import calls as calls_store
from core.store import rollouts as rollouts_store

ROUNDS = 5
ROLLOUTS = 64
ROWS = 256  # per variant, batch and round
BATCHES = (1, 64)
# rolltap's statement with the rollout UPDATE replaced by a sequence: same row, same params.
NO_BUMP = calls_store.INSERT.replace(
    calls_store.INSERT[calls_store.INSERT.index("WITH bump AS (") : calls_store.INSERT.index(
        "INSERT INTO calls")],
    "WITH bump AS (SELECT nextval('bench_seq')::int AS call_count, 'running'::text AS status,"
    " 0::bigint AS stored_bytes, $17::bytea AS b17, $18::bytea AS b18)\n",
)  # fmt: skip
VARIANTS = ("floor row", "rolltap row", "  without the rollout UPDATE", "  and without bodies")


def _floor_rows(n: int, rng: np.random.Generator) -> list[tuple]:
    return [
        ("Bearer k", rng.integers(0, 2048, 512, dtype=np.int32).tobytes(),
         rng.integers(0, 2048, 32, dtype=np.int32).tobytes(),
         rng.random(32, dtype=np.float32).tobytes(), "length")
        for _ in range(n)
    ]  # fmt: skip


def _rolltap_rows(rollouts: list[uuid.UUID], n: int, bodies: bool) -> list[tuple]:
    out = []
    for r in records(rollouts, n):
        if not bodies:
            r = msgspec.structs.replace(r, request_body=None, response_body=None)
        out.append(calls_store.insert_args(r))
    return out


async def _measure(dsn: str) -> dict[tuple[str, int], float]:
    conn = await migrated(dsn)
    try:
        await conn.execute(recorder_floor.TABLE)
        await conn.execute("CREATE SEQUENCE bench_seq START 1000000")
        pid = conn.get_server_pid()
        rollouts = [uuid.uuid4() for _ in range(ROLLOUTS)]
        for rid in rollouts:
            await rollouts_store.create(conn, rid, uuid.uuid4().bytes, "bench", None, {}, None)
        rng = np.random.default_rng(0)
        per: dict[tuple[str, int], list[float]] = {}
        for _ in range(ROUNDS):
            for batch in BATCHES:
                work = (
                    (VARIANTS[0], recorder_floor.INSERT, _floor_rows(ROWS, rng)),
                    (VARIANTS[1], calls_store.INSERT, _rolltap_rows(rollouts, ROWS, True)),
                    (VARIANTS[2], NO_BUMP, _rolltap_rows(rollouts, ROWS, True)),
                    (VARIANTS[3], NO_BUMP, _rolltap_rows(rollouts, ROWS, False)),
                )
                for name, sql, rows in work:
                    started = oncpu_s(pid)
                    for at in range(0, len(rows), batch):
                        await conn.executemany(sql, rows[at : at + batch])
                    us = (oncpu_s(pid) - started) * 1e6 / len(rows)
                    per.setdefault((name, batch), []).append(us)
        return {k: statistics.median(v) for k, v in per.items()}
    finally:
        await conn.close()


def run(dsn: str, print_fn) -> dict[str, float]:
    res = asyncio.run(_measure(dsn))
    lines = [
        "Postgres CPU per row by what it carries (one connection, backend CPU, median of "
        f"{ROUNDS} interleaved rounds), µs:",
        f"  {'row':<32}" + "".join(f"{f'{b} row(s)/commit':>20}" for b in BATCHES),
    ]
    for name in VARIANTS:
        lines.append(f"  {name:<32}" + "".join(f"{res[(name, b)]:>20.0f}" for b in BATCHES))
    print_fn("\n".join(lines))
    return {f"{name.strip()} {b}": us for (name, b), us in res.items()}
