"""Other rollouts' latency while one rollout of 40,000 calls merges (issue 39).

A rollout's merge runs when it finishes, in the gateway; one of 40,000 small calls (well inside
the merge's cap) holds a CPU for seconds. The merge runs in a worker process of its own, so the
gateway's event loop keeps serving the other rollouts meanwhile. Measured here: CLIENTS other
rollouts calling through the gateway one call after another (STAND-IN upstream, bench/standin.py,
replies with no delay; real Postgres in a fresh database), first for the merge's length without a
merge, then while the 40,000-call rollout (independent one-token calls, written straight into
the calls table) finishes and merges. The ratio of the two p99s is the target (at most 2x).

    python -m bench.bench_merge_load       # this section alone; `python -m bench` runs all
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from bench import standin
from bench.bench_gateway import ADMIN_KEY, POSTGRES_URL, Gateway, admin_sql, free_port
from core.store import calls as calls_store

CALLS = 40_000
CLIENTS = 8
TARGET_P99_RATIO = 2.0


def independent_call(rollout_id: uuid.UUID, rng: np.random.Generator) -> calls_store.CallRecord:
    """One call sharing no token with another: 20 prompt tokens, one sampled."""
    return calls_store.CallRecord(
        id=uuid.uuid4(), rollout_id=rollout_id, protocol="chat", status="ok",
        started_at=datetime.now(UTC), base_id=None, prefix_len=0, prompt_len=20,
        prompt_delta=rng.integers(1, 150_000, 20, dtype=np.int32).tobytes(),
        completion_ids=np.array([7], dtype=np.int32).tobytes(),
        logprobs=np.array([-0.5], dtype=np.float32).tobytes(),
        versions=np.zeros(1, dtype=np.int32).tobytes(), finish_reason="length",
        offered_tools=False, model="bench", requested={}, applied={}, request_body=None,
        response_body=None, upstream=None, latency_ms=1.0, ttft_ms=None, error=None,
        user_agent=None,
    )  # fmt: skip


async def write_calls(dsn: str, rollout_id: str, n: int) -> None:
    import asyncpg

    from core.store.db import init_connection

    rng = np.random.default_rng(0)
    conn = await asyncpg.connect(dsn)
    await init_connection(conn)
    try:
        for start in range(0, n, 5_000):
            rows = [independent_call(uuid.UUID(rollout_id), rng)
                    for _ in range(min(5_000, n - start))]
            await conn.executemany(calls_store.INSERT, [calls_store.insert_args(r) for r in rows])
    finally:
        await conn.close()


async def load(url: str, keys: list[str], body: bytes, stop: asyncio.Event
               ) -> list[tuple[float, float]]:
    """Each key's rollout calls one call after another until `stop`; (start, end) of each."""
    import aiohttp

    done: list[tuple[float, float]] = []

    async def client(session: aiohttp.ClientSession, key: str) -> None:
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        while not stop.is_set():
            t0 = time.perf_counter()
            async with session.post(url + "/v1/chat/completions", data=body,
                                    headers=headers) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}")
            done.append((t0, time.perf_counter()))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(client(session, k) for k in keys))
    return done


async def admin(url: str, path: str, spec: dict) -> dict:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async with session.post(url + path, json=spec,
                                headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as resp:
            if resp.status >= 300:
                raise RuntimeError(f"{path}: HTTP {resp.status}: {await resp.text()}")
            return await resp.json()


def p99_ms(spans: list[tuple[float, float]], since: float, until: float) -> tuple[float, int]:
    latencies = [end - start for start, end in spans if since <= start < until]
    return float(np.percentile(latencies, 99)) * 1000 if latencies else float("nan"), len(
        latencies)


async def measure(gw: Gateway, dsn: str, print_fn) -> dict:
    body = json.dumps(json.loads(standin.REQUEST.read_text())).encode()
    keys = [(await admin(gw.url, "/admin/rollouts", {"task_id": f"other-{i}"}))["api_key"]
            for i in range(CLIENTS)]
    big = []
    for name in ("alone", "under-load"):
        rollout = await admin(gw.url, "/admin/rollouts", {"task_id": f"big-{name}",
                                                          "timeout_s": 3600})
        started = time.perf_counter()
        await write_calls(dsn, rollout["rollout_id"], CALLS)
        seconds = time.perf_counter() - started
        print_fn(f"  wrote {CALLS} calls of rollout {name} in {seconds:.1f} s")
        big.append(rollout["rollout_id"])
    finish = "/admin/rollouts/{}/finish"
    started = time.perf_counter()
    await admin(gw.url, finish.format(big[0]), {"reward": 0.0})
    merge_s = time.perf_counter() - started  # the finish, its merge and its traces' writes
    print_fn(f"  finish of {CALLS} independent calls (merge + traces stored), no other load: "
             f"{merge_s:.2f} s")
    window = max(merge_s, 5.0)

    stop = asyncio.Event()
    running = asyncio.create_task(load(gw.url, keys, body, stop))
    await asyncio.sleep(3)  # warm: connections open, rollouts' keys known
    base_from = time.perf_counter()
    await asyncio.sleep(window)
    merge_from = time.perf_counter()
    await admin(gw.url, finish.format(big[1]), {"reward": 0.0})
    merge_until = time.perf_counter()
    stop.set()
    spans = await running
    without, n_without = p99_ms(spans, base_from, merge_from)
    during, n_during = p99_ms(spans, merge_from, merge_until)
    return {"calls": CALLS, "clients": CLIENTS, "merge_alone_s": merge_s,
            "merge_under_load_s": merge_until - merge_from,
            "p99_without_ms": without, "calls_without": n_without,
            "p99_during_ms": during, "calls_during": n_during,
            "ratio": during / without}


def run(print_fn=print) -> dict:
    datname = f"rolltap_bench_merge_{uuid.uuid4().hex[:10]}"
    dsn = f"{POSTGRES_URL.rpartition('/')[0]}/{datname}"
    admin_sql(f'CREATE DATABASE "{datname}"')
    port = free_port()
    upstream = standin.start(port)
    print_fn(f"other rollouts' latency during a {CALLS}-call merge: {CLIENTS} clients, STAND-IN "
             f"upstream, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    with tempfile.TemporaryDirectory(prefix="rolltap-bench-merge-") as tmp:
        gw = Gateway(f"http://127.0.0.1:{port}", dsn, Path(tmp) / "gateway.log").start()
        try:
            result = asyncio.run(measure(gw, dsn, print_fn))
        finally:
            gw.stop()
            upstream.terminate()
            upstream.wait()
            admin_sql(f'DROP DATABASE IF EXISTS "{datname}" WITH (FORCE)')
    print_fn(f"  merge under load {result['merge_under_load_s']:.2f} s; other rollouts' p99 "
             f"{result['p99_without_ms']:.1f} ms without ({result['calls_without']} calls), "
             f"{result['p99_during_ms']:.1f} ms during ({result['calls_during']} calls): "
             f"{result['ratio']:.2f}x (target <= {TARGET_P99_RATIO:g}x); load average "
             f"{os.getloadavg()[0]:.1f} at the end")
    result["target"] = result["ratio"] <= TARGET_P99_RATIO
    return result


if __name__ == "__main__":
    run()
