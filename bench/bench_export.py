"""Benchmark of `rolltap export`: peak memory (RSS) and time to export synthetic rollouts at
both grains, for 1k and 10k rollouts. Streaming from a server-side cursor in bounded batches,
the peak must not grow with the number of rollouts; the stated bound is MEMORY_BOUND_MIB.

Rollouts are written straight into a fresh database on the local Postgres: each has one merged
sequence of TOKENS tokens and one call with a zstd chat request (tools, a few turns) and reply.

Run: python -m bench.bench_export
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from bench.bench_gateway import POSTGRES_URL, admin_sql

SIZES = (1_000, 10_000)
TOKENS = 800
GROUP = 8
MEMORY_BOUND_MIB = 300  # peak RSS of the whole export process, any number of rollouts
REPO = Path(__file__).resolve().parents[1]


def _request(i: int) -> bytes:
    return json.dumps({
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "You are a coding agent. " * 40},
            {"role": "user", "content": f"Fix issue {i}: the parser drops trailing commas."},
            {"role": "assistant", "content": "Looking at the parser now."},
            {"role": "user", "content": "Tests still fail on `a,b,`; " * 5},
        ],
        "tools": [{"type": "function", "function": {
            "name": "run", "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}],
    }).encode()


async def _fill(dsn: str, n: int) -> None:
    import zstandard

    from core.store.db import open_pool

    pool = await open_pool(dsn, min_size=1, max_size=2)
    rng = np.random.default_rng(0)
    zc = zstandard.ZstdCompressor(level=3)
    reply = zc.compress(json.dumps({"message": {"role": "assistant", "content": "Done: the "
                                    "parser now keeps trailing commas."}, "finish_reason": "stop",
                                    "usage": {}}).encode())
    try:
        async with pool.acquire() as conn:
            for start in range(0, n, 1000):
                ids = [uuid.uuid4() for _ in range(min(1000, n - start))]
                await conn.copy_records_to_table(
                    "rollouts",
                    columns=["id", "key_hash", "task_id", "group_id", "status", "reward",
                             "call_count", "harness"],
                    records=[(rid, rid.bytes, f"task-{(start + i) % 50}",
                              f"g-{(start + i) // GROUP}", "finished", float(rng.random() < 0.5),
                              1, "bench") for i, rid in enumerate(ids)])
                await conn.execute("UPDATE rollouts SET finished_at = now(), merged_at = now(),"
                                   " merge_stats = '{\"sequences\": 1}' WHERE merged_at IS NULL")
                mask = np.zeros(TOKENS, dtype=np.uint8)
                mask[TOKENS // 2:] = 1
                await conn.copy_records_to_table(
                    "traces",
                    columns=["rollout_id", "idx", "input_ids", "loss_mask", "logprobs",
                             "versions", "call_ids", "cause", "auxiliary", "excluded"],
                    records=[(rid, 0, rng.integers(0, 150_000, TOKENS, dtype="<i4").tobytes(),
                              mask.tobytes(), (-rng.random(TOKENS, dtype=np.float32)).tobytes(),
                              np.zeros(TOKENS, dtype="<i4").tobytes(), [rid], "root", False,
                              False) for rid in ids])
                await conn.copy_records_to_table(
                    "calls",
                    columns=["id", "rollout_id", "seq", "protocol", "status", "prompt_len",
                             "prompt_delta", "completion_ids", "logprobs", "versions",
                             "offered_tools", "request_body", "response_body"],
                    records=[(rid, rid, 1, "chat", "ok", TOKENS // 2, b"", b"", b"", b"", True,
                              zc.compress(_request(i)), reply) for i, rid in enumerate(ids)])
    finally:
        await pool.close()


def _export(dsn: str, out: Path) -> tuple[float, float]:
    """(seconds, peak RSS MiB) of one `rolltap export` process."""
    probe = (
        "import resource, subprocess, sys, time\n"
        "t = time.monotonic()\n"
        "subprocess.run(sys.argv[1:], check=True)\n"
        "print(time.monotonic() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe, sys.executable, "-m", "core.cli", "export", str(out),
         "--database-url", dsn, "--quiet"],
        cwd=REPO, capture_output=True, text=True, check=True)
    seconds, kib = result.stdout.split()[-2:]
    return float(seconds), int(kib) / 1024


def run(print_fn=print) -> dict:
    print_fn(f"export: {TOKENS}-token sequences, one chat call each, groups of {GROUP}; "
             f"{os.cpu_count()} CPUs; stated bound: peak RSS <= {MEMORY_BOUND_MIB} MiB")
    results = {}
    for n in SIZES:
        datname = f"rolltap_bench_export_{uuid.uuid4().hex[:10]}"
        dsn = f"{POSTGRES_URL.rpartition('/')[0]}/{datname}"
        admin_sql(f'CREATE DATABASE "{datname}"')
        try:
            t = time.monotonic()
            asyncio.run(_fill(dsn, n))
            fill_s = time.monotonic() - t
            with tempfile.TemporaryDirectory() as tmp:
                seconds, peak = _export(dsn, Path(tmp))
                size = sum(p.stat().st_size for p in Path(tmp).iterdir()) / 2**20
        finally:
            admin_sql(f'DROP DATABASE IF EXISTS "{datname}" WITH (FORCE)')
        results[n] = {"seconds": seconds, "peak_rss_mib": peak, "files_mib": size}
        verdict = "ok" if peak <= MEMORY_BOUND_MIB else "OVER"
        print_fn(f"  {n:>6} rollouts: export {seconds:6.1f} s ({n / seconds:7.0f} rollouts/s), "
                 f"peak RSS {peak:6.1f} MiB (bound {MEMORY_BOUND_MIB} MiB: {verdict}), files "
                 f"{size:6.1f} MiB; filling the database took {fill_s:.1f} s")
    small, big = (results[n]["peak_rss_mib"] for n in SIZES)
    print_fn(f"  peak RSS growth from {SIZES[0]} to {SIZES[1]} rollouts: {big - small:+.1f} MiB")
    return {"sizes": results,
            "targets": {"peak_rss": all(r["peak_rss_mib"] <= MEMORY_BOUND_MIB
                                        for r in results.values())}}
