"""Three ways to commit a batch of call records, side by side: part of the gateway section.

- `executemany`: one INSERT per row in asyncpg's implicit transaction (the recorder's way
  before: no BEGIN/COMMIT round trips);
- `unnest`: one multi-row INSERT of column arrays (`INSERT_MANY`);
- `copy`: `copy_records_to_table` into a temporary table, then one INSERT ... SELECT from it,
  in an explicit transaction.

All three commit before they return, number a rollout's calls in batch order and refuse calls
of an ended rollout. Each is timed on one connection on the same
rows (a 512-token call: 64 new prompt ids, 32 sampled, compressed bodies, reply keys):
client wall time and the Postgres backend's CPU (/proc) per row, at the batch sizes group
commit produces at concurrency 1 and under load.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from datetime import UTC, datetime

import msgspec
import numpy as np
import zstandard

from bench.bench_gateway import cpu_times
from core.store import calls as calls_store
from core.store import rollouts as rollouts_store
from core.store.db import init_connection
from core.store.migrations import migrate

# The same rows as INSERT, many in one statement: each column an array, unnested in row order.
# Reply keys are fixed-size digests of varying count per row, and Postgres arrays are
# rectangular: they travel flat, each row naming its slice. A rollout's rows of one batch are
# numbered in batch order after its call count, as row-by-row inserts would number them.
_COLUMNS = (
    ("id", "uuid"), ("rollout_id", "uuid"), ("protocol", "text"), ("status", "text"),
    ("base_id", "uuid"), ("prefix_len", "int4"), ("prompt_len", "int4"),
    ("prompt_delta", "bytea"), ("completion_ids", "bytea"), ("logprobs", "bytea"),
    ("versions", "bytea"), ("finish_reason", "text"), ("offered_tools", "bool"),
    ("model", "text"), ("requested", "jsonb"), ("applied", "jsonb"),
    ("request_body", "bytea"), ("response_body", "bytea"), ("upstream", "text"),
    ("latency_ms", "float4"), ("ttft_ms", "float4"), ("error", "text"),
    ("user_agent", "text"), ("response_id", "text"), ("continuation", "jsonb"),
    ("key_from", "int4"), ("key_count", "int4"), ("rerouted", "text"),
    ("constrained", "bool"), ("body_digest", "bytea"), ("retry_count", "int4"),
    ("started_at", "timestamptz"),
)  # fmt: skip
_TARGET = [c for c, _ in _COLUMNS if c not in ("key_from", "key_count")]
# A row's seq, or the refusal of a call of an ended rollout, as the recorder's INSERT does.
_SEQ = (
    "CASE WHEN bump.status = 'running'"
    " THEN bump.before + row_number() OVER (PARTITION BY r.rollout_id ORDER BY r.ord)"
    " ELSE rolltap_refuse_call(r.rollout_id) END"
)
INSERT_MANY = f"""
WITH r AS (
    SELECT * FROM unnest({", ".join(f"${i + 1}::{t}[]" for i, (_, t) in enumerate(_COLUMNS))})
        WITH ORDINALITY AS r({", ".join(c for c, _ in _COLUMNS)}, ord)
), n AS (
    SELECT rollout_id, count(*)::int AS k FROM r GROUP BY rollout_id
), bump AS (
    UPDATE rollouts SET call_count = call_count + n.k FROM n WHERE rollouts.id = n.rollout_id
    RETURNING rollouts.id, rollouts.call_count - n.k AS before, rollouts.status
)
INSERT INTO calls ({", ".join(_TARGET)}, reply_keys, seq)
SELECT {", ".join("r." + c for c in _TARGET)},
       CASE WHEN r.key_count IS NULL THEN NULL
            ELSE (${len(_COLUMNS) + 1}::bytea[])[r.key_from : r.key_from + r.key_count - 1] END,
       {_SEQ}
FROM r JOIN bump ON bump.id = r.rollout_id
ORDER BY r.ord
"""


def insert_many_args(records: list[calls_store.CallRecord]) -> list[list]:
    """The column arrays of INSERT_MANY, then the flat reply keys."""
    columns: list[list] = [[] for _ in _COLUMNS]
    keys: list[bytes] = []
    for r in records:
        row = calls_store.insert_args(r)
        reply = row[25]
        shaped = (
            *row[:25],
            None if reply is None else len(keys) + 1,  # Postgres arrays count from 1
            None if reply is None else len(reply),
            *row[26:],
        )
        if reply:
            keys.extend(reply)
        for column, value in zip(columns, shaped):
            column.append(value)
    return [*columns, keys]


BATCHES = (1, 8, 64)
ROWS = 1536  # per variant and batch size
ROLLOUTS = 64

_STAGE = "calls_stage"
_STAGE_COLUMNS = [c for c, _ in _COLUMNS if c not in ("key_from", "key_count")]
_JSON = {c for c, t in _COLUMNS if t == "jsonb"}
_JSON_AT = [i for i, c in enumerate(_STAGE_COLUMNS) if c in _JSON]
_STAGE_DDL = (
    f"CREATE TEMP TABLE IF NOT EXISTS {_STAGE} (ord int, "
    # jsonb as text: the pool's jsonb codec is text-only, and COPY is binary
    + ", ".join(
        f"{c} {'text' if t == 'jsonb' else t}"
        for c, t in _COLUMNS
        if c not in ("key_from", "key_count")
    )
    + ", reply_keys bytea[]) ON COMMIT DELETE ROWS"
)
_INSERT_STAGED = f"""
WITH n AS (
    SELECT rollout_id, count(*)::int AS k FROM {_STAGE} GROUP BY rollout_id
), bump AS (
    UPDATE rollouts SET call_count = call_count + n.k FROM n WHERE rollouts.id = n.rollout_id
    RETURNING rollouts.id, rollouts.call_count - n.k AS before, rollouts.status
)
INSERT INTO calls ({", ".join(_STAGE_COLUMNS)}, reply_keys, seq)
SELECT {", ".join("r." + c + ("::jsonb" if c in _JSON else "") for c in _STAGE_COLUMNS)},
       r.reply_keys,
       {_SEQ}
FROM {_STAGE} r JOIN bump ON bump.id = r.rollout_id
ORDER BY r.ord
"""


async def write_executemany(conn, batch) -> None:
    await conn.executemany(calls_store.INSERT, [calls_store.insert_args(r) for r in batch])


async def write_unnest(conn, batch) -> None:
    await conn.execute(INSERT_MANY, *insert_many_args(batch))


async def write_copy(conn, batch) -> None:
    records = []
    for i, r in enumerate(batch):
        row = calls_store.insert_args(r)
        staged = [*row[:25], *row[26:]]
        for at in _JSON_AT:
            if staged[at] is not None:
                staged[at] = msgspec.json.encode(staged[at]).decode()
        records.append((i, *staged, row[25]))
    async with conn.transaction():
        await conn.copy_records_to_table(
            _STAGE, records=records, columns=["ord", *_STAGE_COLUMNS, "reply_keys"]
        )
        await conn.execute(_INSERT_STAGED)


VARIANTS = {"executemany": write_executemany, "unnest": write_unnest, "copy": write_copy}


def _records(rollouts: list[uuid.UUID], n: int) -> list[calls_store.CallRecord]:
    rng = np.random.default_rng(0)
    cctx = zstandard.ZstdCompressor(level=3)
    body = cctx.compress(b'{"messages":[' + b'{"role":"user","content":"x"},' * 200 + b"{}]}")
    out = []
    for i in range(n):
        out.append(
            calls_store.CallRecord(
                id=uuid.uuid4(),
                rollout_id=rollouts[i % len(rollouts)],
                protocol="chat",
                status="ok",
                started_at=datetime.now(UTC),
                base_id=None,
                prefix_len=448,
                prompt_len=512,
                prompt_delta=rng.integers(0, 2048, 64, dtype=np.int32).tobytes(),
                completion_ids=rng.integers(0, 2048, 32, dtype=np.int32).tobytes(),
                logprobs=rng.random(32, dtype=np.float32).tobytes(),
                versions=np.zeros(32, dtype=np.int32).tobytes(),
                finish_reason="length",
                offered_tools=True,
                model="tiny",
                requested={"temperature": 0.7},
                applied={"temperature": 1.0, "top_p": 1.0},
                request_body=body,
                response_body=body[:400],
                upstream="http://127.0.0.1:8000",
                latency_ms=12.5,
                ttft_ms=3.25,
                error=None,
                user_agent="bench",
                continuation={"path": "render", "reason": "first_turn"},
                reply_keys=[os.urandom(16) for _ in range(1 + i % 2)],
                body_digest=os.urandom(16),
            )
        )
    return out


async def migrated(dsn: str):
    """A connection to `dsn` as the gateway's pool makes them, on the newest schema."""
    import asyncpg

    conn = await asyncpg.connect(dsn)
    await init_connection(conn)
    await migrate(conn)
    return conn


async def _compare(dsn: str) -> dict:
    conn = await migrated(dsn)
    try:
        await conn.execute(_STAGE_DDL)
        pid = conn.get_server_pid()
        out: dict[str, dict[int, dict]] = {v: {} for v in VARIANTS}
        for size in BATCHES:
            for name, write in VARIANTS.items():
                rollouts = [uuid.uuid4() for _ in range(ROLLOUTS)]
                for rid in rollouts:
                    await rollouts_store.create(conn, rid, os.urandom(16), "bench", None, {}, None)
                records = _records(rollouts, ROWS)
                cpu0, t0 = sum(cpu_times(pid)), time.perf_counter()
                for at in range(0, ROWS, size):
                    await write(conn, records[at : at + size])
                wall, cpu = time.perf_counter() - t0, sum(cpu_times(pid)) - cpu0
                seqs = await conn.fetch(
                    "SELECT rollout_id, array_agg(seq ORDER BY seq) AS s, count(*) AS n FROM calls"
                    " WHERE rollout_id = ANY($1::uuid[]) GROUP BY rollout_id",
                    rollouts,
                )
                numbered = all(list(r["s"]) == list(range(1, r["n"] + 1)) for r in seqs)
                out[name][size] = {
                    "wall_us": wall * 1e6 / ROWS,
                    "postgres_us": cpu * 1e6 / ROWS,
                    "rows_ok": sum(r["n"] for r in seqs) == ROWS and numbered,
                }
        return out
    finally:
        await conn.close()


def run(dsn: str, print_fn) -> dict:
    results = asyncio.run(_compare(dsn))
    head = f"{'batch rows':<12}" + "".join(f"{v:>26}" for v in VARIANTS)
    lines = [
        "recorder: one batch commit, per row: client wall µs / Postgres backend CPU µs",
        head,
        "-" * len(head),
    ]
    for size in BATCHES:
        cells = []
        for v in VARIANTS:
            r = results[v][size]
            cell = f"{r['wall_us']:.0f} / {r['postgres_us']:.0f}" + ("" if r["rows_ok"] else " BAD")
            cells.append(f"{cell:>26}")
        lines.append(f"{size:<12}" + "".join(cells))
    print_fn("\n".join(lines))
    return results
