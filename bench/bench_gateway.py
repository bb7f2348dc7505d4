"""The gateway's own cost: the same load straight to an upstream and through the gateway with
recording on, side by side in one run.

The upstream is the STAND-IN (`bench/standin.py`): real recorded vLLM responses replayed with no
delay, so whatever the gateway adds is not hidden behind a real engine's token time. Every process
is separate, as in a deployment: the stand-in, the gateway (`python -m core.cli gateway`, real
Postgres in a fresh database dropped afterwards) and the load generator (this module with
`--loadgen`, an aiohttp client with keep-alive, one rollout per simulated harness).

The gateway's CPU time comes from /proc/PID/stat (user + system) over the measured phase only. It
depends far less than latency on what else the machine runs, but not at all is too much to say:
a busy machine makes every wake-up dearer (cold caches), so compare runs made side by side.
On these shared 2-core machines the same gateway measured 820 µs per non-streamed call at c=1
in one run and 1,400 µs in another: that, more than anything the bench did differently, is why
an outside measurement (1,201 µs) disagreed with it. The same run therefore also measures a bare
aiohttp pass-through (`bench/gateway_contexts.py`) as the reference the gateway is judged by.

The gateway runs as deployed: at the default log level (INFO: one access-log line per call;
a line takes 20-40 µs on its own, yet INFO measured 200-240 µs a call dearer than WARNING at
c=64 on a busy machine), bodies recorded. After the scenarios below come
the costs by context length (512, 8k and 32k prompt tokens), the recorder's batch-commit
variants and Postgres CPU per recorded call measured on the recorder's INSERT alone, next to
the commit floor (`bench/postgres_cost.py`).

    python -m bench.bench_gateway          # this section alone; `python -m bench` runs all
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import msgspec
import numpy as np

from bench import standin

REPO = Path(__file__).resolve().parents[1]
POSTGRES_URL = os.environ.get(
    "ROLLTAP_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
ADMIN_KEY = "bench-admin-" + uuid.uuid4().hex
TOOL_ROUND = standin.DATA / "tool_round.json"

TARGET_ADDED_P50_MS = 1.0  # at concurrency 1
TARGET_CPU_PER_REQUEST_US = 400.0  # non-streamed
TARGET_CPU_PER_CHUNK_US = 20.0
TARGET_POSTGRES_CPU_US = 150.0  # per recorded call
# Measured elsewhere on the same kind of stand-in; printed for scale only, not measured here.
# OpenEnv's capture proxy is measured in this run instead (bench/peer_openenv.py).
PEERS = (("LiteLLM proxy", 34_000, 33, ""),)


class Scenario(msgspec.Struct, frozen=True, kw_only=True):
    stream: bool
    concurrency: int
    requests: int  # measured requests, at most
    seconds: float  # measured wall time, at most
    warmup: int  # requests per harness before measuring
    # The request also carries a tool round (an assistant turn + its result) that no call of
    # the rollout returned: what a harness that rewrites its history sends on every call.
    unknown_turn: bool = False

    @property
    def name(self) -> str:
        kind = "streamed" if self.stream else "non-streamed"
        return f"{kind} c={self.concurrency}" + (" +unknown turn" if self.unknown_turn else "")


SCENARIOS = (
    Scenario(stream=False, concurrency=1, requests=1500, seconds=8, warmup=50),
    Scenario(stream=True, concurrency=1, requests=800, seconds=8, warmup=30),
    Scenario(stream=False, concurrency=64, requests=4000, seconds=10, warmup=4),
    Scenario(stream=True, concurrency=64, requests=2000, seconds=10, warmup=2),
    Scenario(stream=False, concurrency=64, requests=3000, seconds=8, warmup=2, unknown_turn=True),
)


# -- load generator (its own process) ----------------------------------------------------------


def context_request(request: dict, tokens: int) -> dict:
    """`request` with its user turn grown to about `tokens` tokens (4 characters each, as code
    and English run): a source file pasted into the task, as a long agent context carries."""
    lines, size, i = [], 0, 0
    while size < tokens * 4:
        line = f"    total_{i} = compute(values[{i}], weight={i % 7}) + offset  # step {i}\n"
        lines.append(line)
        size += len(line)
        i += 1
    messages = [dict(m) for m in request["messages"]]
    user = next(m for m in messages if m["role"] == "user")
    user["content"] += "\n" + "".join(lines)
    return dict(request, messages=messages)


def cpu_times(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of process `pid` (all its threads) so far."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rpartition(b")")[2].split()
    # utime and stime are fields 14 and 15 of proc(5), counting `pid` and `(comm)` as 1 and 2.
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def _cpu(pids: dict[str, list[int]]) -> dict[str, list[float]]:
    out = {}
    for name, group in pids.items():
        total = [0.0, 0.0]
        for pid in group:
            try:
                user, system = cpu_times(pid)
            except (FileNotFoundError, ProcessLookupError):
                continue  # a backend that ended counts what it used up to the last snapshot only
            total[0] += user
            total[1] += system
        out[name] = total
    return out


async def _postgres_backends(dsn: str, datname: str) -> list[int]:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
            datname,
        )
    finally:
        await conn.close()
    return [r["pid"] for r in rows]


class LoadSpec(msgspec.Struct, frozen=True, kw_only=True):
    url: str
    keys: list[str | None]  # one simulated harness per key; None: no Authorization header
    stream: bool
    unknown_turn: bool
    requests: int
    seconds: float
    warmup: int
    pids: dict[str, list[int]]  # processes whose CPU time is measured, by role
    postgres: tuple[str, str] | None = None  # (server DSN, database): also time its backends
    context_tokens: int = 0  # > 0: the user turn carries about this many tokens of text
    max_tokens: int | None = None  # replaces the recorded request's
    # (the gateway's /metrics, its admin key): read its CPU per stage over the measured phase
    metrics: tuple[str, str] | None = None


class LoadResult(msgspec.Struct, kw_only=True):
    sent: int  # warm-up included
    ok: int  # warm-up included
    errors: int
    first_error: str | None
    wall_s: float
    latency_s: list[float]  # measured requests only, from here on
    ttfc_s: list[float]
    gap_s: list[float]  # mean gap between a stream's chunks
    chunks: list[int]
    cpu_s: dict[str, float]  # user + system, by role; `loadgen` is this process
    system_cpu_s: dict[str, float]
    stage_cpu_us: dict[str, float] = {}  # the gateway's CPU per measured call, by stage


def request_body(spec: LoadSpec) -> bytes:
    """The recorded harness request, shaped as `spec` asks."""
    request = json.loads(standin.REQUEST.read_text())
    if spec.context_tokens:
        request = context_request(request, spec.context_tokens)
    if spec.max_tokens:
        request["max_tokens"] = spec.max_tokens
    if spec.unknown_turn:
        request["messages"] += json.loads(TOOL_ROUND.read_text())
    if spec.stream:
        request.update(stream=True, stream_options={"include_usage": True})
    return json.dumps(request).encode()


async def read_stream(resp) -> tuple[float, float, int]:
    """A streamed response read to its end: the times of its first and last chunk, and how
    many there were."""
    first = last = 0.0
    n = 0
    final = b""
    async for line in resp.content:
        if line.startswith(b"data:"):
            last = time.perf_counter()
            if not n:
                first = last
            n += 1
            final = line
    if final.strip() != b"data: [DONE]":
        raise RuntimeError(f"stream did not end with [DONE]: {final[:300]!r}")
    return first, last, n


async def loadgen(spec: LoadSpec) -> LoadResult:
    """Drives one simulated harness per key against `spec.url`, each sending the recorded
    request one call after another over a keep-alive connection."""
    import aiohttp

    body = request_body(spec)
    url = spec.url + "/v1/chat/completions"
    res = LoadResult(
        sent=0, ok=0, errors=0, first_error=None, wall_s=0.0, latency_s=[], ttfc_s=[],
        gap_s=[], chunks=[], cpu_s={}, system_cpu_s={},
    )  # fmt: skip

    async def call(session, headers, keep: bool) -> None:
        res.sent += 1
        t0 = time.perf_counter()
        try:
            async with session.post(url, data=body, headers=headers) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:300]!r}")
                if spec.stream:
                    first, last, n = await read_stream(resp)
                else:
                    await resp.read()
        except (aiohttp.ClientError, RuntimeError, TimeoutError) as exc:
            res.errors += 1
            res.first_error = res.first_error or f"{type(exc).__name__}: {exc}"
            return
        done = time.perf_counter()
        res.ok += 1
        if keep:
            res.latency_s.append(done - t0)
            if spec.stream:
                res.ttfc_s.append(first - t0)
                res.gap_s.append((last - first) / max(n - 1, 1))
                res.chunks.append(n)

    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        harnesses = [
            {"Content-Type": "application/json", **({"Authorization": f"Bearer {k}"} if k else {})}
            for k in spec.keys
        ]

        async def warm(headers) -> None:
            for _ in range(spec.warmup):
                await call(session, headers, keep=False)

        await asyncio.gather(*(warm(h) for h in harnesses))
        pids = dict(spec.pids)
        if spec.postgres:
            # After the warm-up: the gateway's pool has opened the connections it needs.
            pids["postgres"] = await _postgres_backends(*spec.postgres)
        left = [spec.requests]
        stages0 = await stage_cpu(session, spec.metrics)
        cpu0, own0 = _cpu(pids), time.process_time()
        t_start = time.perf_counter()
        deadline = t_start + spec.seconds

        async def measured(headers) -> None:
            while left[0] > 0 and time.perf_counter() < deadline:
                left[0] -= 1
                await call(session, headers, keep=True)

        await asyncio.gather(*(measured(h) for h in harnesses))
        res.wall_s = time.perf_counter() - t_start
        own = time.process_time() - own0
        cpu1 = _cpu(pids)
        stages1 = await stage_cpu(session, spec.metrics)
    res.stage_cpu_us = stage_cpu_per_call(stages0, stages1)
    res.cpu_s = {"loadgen": own, **{k: sum(cpu1[k]) - sum(cpu0[k]) for k in cpu1}}
    res.system_cpu_s = {k: cpu1[k][1] - cpu0[k][1] for k in cpu1}
    return res


def stage_cpu_per_call(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """µs per call in each stage between two `stage_cpu` readings; {} if none were measured."""
    calls = after.get("calls", 0.0) - before.get("calls", 0.0)
    if calls <= 0:
        return {}
    return {k: (v - before[k]) * 1e6 / calls for k, v in after.items() if k != "calls"}


_STAGE_LINE = re.compile(
    rb'^rolltap_stage_cpu_(?:seconds_total\{stage="(\w+)"\}|(calls)_total) ([0-9.e+-]+)$', re.M
)


async def stage_cpu(session, metrics: tuple[str, str] | None) -> dict[str, float]:
    """The gateway's CPU per stage so far (s), and `calls`: the calls it measured."""
    if metrics is None:
        return {}
    url, key = metrics
    async with session.get(url, headers={"Authorization": f"Bearer {key}"}) as resp:
        text = await resp.read()
    return {(m[1] or m[2]).decode(): float(m[3]) for m in _STAGE_LINE.finditer(text)}


def _loadgen_main(spec_path: str, result_path: str) -> int:
    import uvloop

    spec = msgspec.json.decode(Path(spec_path).read_bytes(), type=LoadSpec)
    # A file, not stdout: the result runs to hundreds of KiB, and nothing else can interleave.
    Path(result_path).write_bytes(msgspec.json.encode(uvloop.run(loadgen(spec))))
    return 0


def run_loadgen(spec: LoadSpec) -> LoadResult:
    """`loadgen(spec)` in a process of its own."""
    with tempfile.TemporaryDirectory(prefix="rolltap-loadgen-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_bytes(msgspec.json.encode(spec))
        proc = subprocess.run(
            [sys.executable, "-m", "bench.bench_gateway", "--loadgen", spec_path, result_path],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=spec.seconds + 180,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"load generator failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return msgspec.json.decode(result_path.read_bytes(), type=LoadResult)


# -- processes and database --------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def admin_sql(sql: str) -> None:
    import asyncpg

    async def go() -> None:
        conn = await asyncpg.connect(POSTGRES_URL)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(go())


def _fetchval(dsn: str, sql: str, *args):
    import asyncpg

    async def go():
        conn = await asyncpg.connect(dsn)
        try:
            return await conn.fetchval(sql, *args)
        finally:
            await conn.close()

    return asyncio.run(go())


class Gateway:
    """One `rolltap gateway` process in front of `upstream`, recording into `dsn`."""

    health_path = "/"  # answers once the process serves

    def __init__(self, upstream: str, dsn: str, log_path: Path, log_level: str = "INFO") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.args = [
            sys.executable, "-m", "core.cli", "gateway", "--upstream", upstream,
            "--port", str(self.port), "--database-url", dsn, "--admin-key", ADMIN_KEY,
            "--log-level", log_level,
            # The bench drives each rollout far faster than an agent: its CPU is measured here,
            # not the per-rollout limits, which would refuse most of its calls.
            "--rollout-max-rps", "1000000", "--rollout-max-inflight", "100000",
        ]  # fmt: skip
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> Gateway:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + self.health_path, timeout=1):
                    return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"gateway not up in {timeout} s:\n{self.log_tail()}")

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def new_rollout(self) -> dict:
        req = urllib.request.Request(
            self.url + "/admin/rollouts",
            data=json.dumps({"task_id": "bench"}).encode(),
            headers={"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())

    def batch_rows(self) -> tuple[float, int]:
        """(call records, group commits) so far, from the gateway's own metrics."""
        req = urllib.request.Request(
            self.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            text = resp.read().decode()
        values = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in ("rolltap_recorder_batch_size_sum", "rolltap_recorder_batch_size_count"):
                values[name] = float(value)
        return (
            values.get("rolltap_recorder_batch_size_sum", 0.0),
            int(values.get("rolltap_recorder_batch_size_count", 0)),
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# -- numbers and table (pure) ------------------------------------------------------------------


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def summarize(scenario: Scenario, direct: LoadResult, via: LoadResult, stream_events: int) -> dict:
    """The numbers of one scenario, in ms, µs and requests/s."""

    def per_request(seconds: float, r: LoadResult) -> float:
        return seconds * 1e6 / len(r.latency_s) if r.latency_s else float("nan")

    def side(r: LoadResult) -> dict:
        out = {
            "requests": len(r.latency_s),
            "p50_ms": _p(r.latency_s, 50) * 1e3,
            "p99_ms": _p(r.latency_s, 99) * 1e3,
            "rps": len(r.latency_s) / r.wall_s if r.wall_s else float("nan"),
            "standin_cpu_us": per_request(r.cpu_s["standin"], r),
            "client_cpu_us": per_request(r.cpu_s["loadgen"], r),
            "errors": r.errors,
        }
        if scenario.stream:
            out["ttfc_p50_ms"] = _p(r.ttfc_s, 50) * 1e3
            out["gap_p50_us"] = _p(r.gap_s, 50) * 1e6
            out["chunks"] = int(np.median(r.chunks)) if r.chunks else 0
        return out

    d, g = side(direct), side(via)
    cpu_us = per_request(via.cpu_s["gateway"], via)
    row = {
        "direct": d,
        "gateway": g,
        "added_p50_ms": g["p50_ms"] - d["p50_ms"],
        "added_p99_ms": g["p99_ms"] - d["p99_ms"],
        "gateway_cpu_us_per_request": cpu_us,
        "gateway_system_cpu_us_per_request": per_request(via.system_cpu_s["gateway"], via),
        "postgres_cpu_us_per_request": per_request(via.cpu_s.get("postgres", 0.0), via),
        "gateway_stage_cpu_us": via.stage_cpu_us,
    }
    if scenario.stream:
        row["added_ttfc_ms"] = g["ttfc_p50_ms"] - d["ttfc_p50_ms"]
        row["added_gap_us"] = g["gap_p50_us"] - d["gap_p50_us"]
        row["gateway_cpu_us_per_chunk"] = cpu_us / stream_events
    return row


def _num(x: float, digits: int = 2, sign: str = "") -> str:
    return "-" if x != x else f"{x:{sign}.{digits}f}"


def _target(value: float, limit: float, unit: str, sign: str = "") -> str:
    return f"≤ {sign}{limit:g} {unit}: " + ("met" if value <= limit else "MISSED")


def table_rows(sc: Scenario, r: dict, stream_events: int) -> list[tuple[str, ...]]:
    """(measure, direct, gateway, added, target) lines of one scenario."""
    d, g = r["direct"], r["gateway"]
    end = "time to last chunk" if sc.stream else "latency"
    p50_target = ""
    if sc.concurrency == 1 and not sc.stream and not sc.unknown_turn:
        p50_target = _target(r["added_p50_ms"], TARGET_ADDED_P50_MS, "ms", "+")
    rows = [
        (f"{end} p50 (ms)", _num(d["p50_ms"]), _num(g["p50_ms"]),
         _num(r["added_p50_ms"], sign="+"), p50_target),
        (f"{end} p99 (ms)", _num(d["p99_ms"]), _num(g["p99_ms"]),
         _num(r["added_p99_ms"], sign="+"), ""),
    ]  # fmt: skip
    if sc.stream:
        rows += [
            ("time to first chunk p50 (ms)", _num(d["ttfc_p50_ms"]), _num(g["ttfc_p50_ms"]),
             _num(r["added_ttfc_ms"], sign="+"), ""),
            ("gap between chunks p50 (µs)", _num(d["gap_p50_us"], 1), _num(g["gap_p50_us"], 1),
             _num(r["added_gap_us"], 1, "+"), ""),
        ]  # fmt: skip
    cpu = r["gateway_cpu_us_per_request"]
    rows += [
        ("requests/s", _num(d["rps"], 0), _num(g["rps"], 0), "", ""),
        ("gateway CPU per request (µs)", "", _num(cpu, 0), "",
         "" if sc.stream or sc.unknown_turn else _target(cpu, TARGET_CPU_PER_REQUEST_US, "µs")),
        ("  of which in the kernel (µs)", "", _num(r["gateway_system_cpu_us_per_request"], 0),
         "", ""),
    ]  # fmt: skip
    stages = r.get("gateway_stage_cpu_us") or {}
    if stages:
        # The pipeline's own measure (gateway/stage_cpu.py): its synchronous sections only, so
        # the event loop, the HTTP server and the recorder's commits are outside these rows.
        rows.append(("  in the call's stages (µs)", "", _num(sum(stages.values()), 0), "", ""))
        rows += [(f"    {stage}", "", _num(us, 0), "", "") for stage, us in stages.items() if us]
    if sc.stream:
        chunk = r["gateway_cpu_us_per_chunk"]
        rows.append((f"gateway CPU per chunk (µs, /{stream_events})", "", _num(chunk, 1), "",
                     _target(chunk, TARGET_CPU_PER_CHUNK_US, "µs")))  # fmt: skip
        if "marginal_cpu_us_per_chunk" in r:
            rows.append(("  marginal: (stream-whole)/chunks", "",
                         _num(r["marginal_cpu_us_per_chunk"], 1), "", ""))  # fmt: skip
    rows += [
        ("Postgres CPU per request (µs)", "", _num(r["postgres_cpu_us_per_request"], 0), "",
         _target(r["postgres_cpu_us_per_request"], TARGET_POSTGRES_CPU_US, "µs")),
        ("stand-in CPU per request (µs)", _num(d["standin_cpu_us"], 0),
         _num(g["standin_cpu_us"], 0), "", ""),
        ("load generator CPU per request (µs)", _num(d["client_cpu_us"], 0),
         _num(g["client_cpu_us"], 0), "", ""),
    ]  # fmt: skip
    if d["errors"] or g["errors"]:
        rows.append(("ERRORS (failed requests)", str(d["errors"]), str(g["errors"]), "", ""))
    return rows


def format_table(scenarios, rows: dict, lost: dict, stream_events: int) -> str:
    widths = (33, 36, 9, 9, 9)
    lines = []

    def line(cells) -> None:
        text = "".join(
            c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )
        lines.append((text + "   " + cells[5]).rstrip())

    line(("scenario", "measure", "direct", "gateway", "added", "target"))
    lines.append("-" * (sum(widths) + 24))
    for sc in scenarios:
        for i, cells in enumerate(table_rows(sc, rows[sc.name], stream_events)):
            line((sc.name if i == 0 else "", *cells))
        lines.append("")
    verdict = "met" if lost["lost"] == 0 else "MISSED"
    lines.append(
        f"lost records: {lost['lost']} (calls rows {lost['rows']} for {lost['acknowledged']} "
        f"acknowledged of {lost['sent']} sent requests)   target 0: {verdict}"
    )
    lines.append(
        "CPU is user+system time from /proc/PID/stat over the measured phase. A process that\n"
        "sleeps between requests (c=1) pays for every wake-up, so its CPU per request is higher\n"
        "than when busy (c=64): compare the load generator's own row, same work on both sides."
    )
    lines.append("for scale, peers measured elsewhere on the same kind of stand-in (not this run):")
    for name, cpu, p50, note in PEERS:
        extra = f"   ({note})" if note else ""
        lines.append(f"  {name:<24}~{cpu:>7,} µs CPU/request   +{p50} ms p50{extra}")
    return "\n".join(lines)


# -- the run -----------------------------------------------------------------------------------


def commit_latency_ms(dsn: str, n: int = 50) -> float:
    """p50 of a one-row INSERT and its commit on this Postgres: the floor under any recording
    gateway's added latency at concurrency 1, since a call is answered only once committed."""
    import asyncpg

    async def go() -> float:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("CREATE TABLE bench_commit_probe (x int)")
            times = []
            for i in range(n):
                t0 = time.perf_counter()
                await conn.execute("INSERT INTO bench_commit_probe VALUES ($1)", i)
                times.append(time.perf_counter() - t0)
            await conn.execute("DROP TABLE bench_commit_probe")
        finally:
            await conn.close()
        return _p(times, 50) * 1e3

    return asyncio.run(go())


def _measure(dsn: str, datname: str, stream_events: int, print_fn) -> tuple[dict, dict]:
    """Every scenario direct and through one gateway; returns (rows, lost-record counts)."""
    standin_port = free_port()
    upstream = standin.start(standin_port)
    log_dir = Path(tempfile.mkdtemp(prefix="rolltap-bench-"))
    gateway = Gateway(f"http://127.0.0.1:{standin_port}", dsn, log_dir / "gateway.log")
    rows: dict[str, dict] = {}
    sent = acknowledged = 0
    rollout_ids: list[str] = []
    try:
        gateway.start()
        for sc in SCENARIOS:
            common = {
                "stream": sc.stream,
                "unknown_turn": sc.unknown_turn,
                "requests": sc.requests,
                "seconds": sc.seconds,
                "warmup": sc.warmup,
            }
            direct = run_loadgen(
                LoadSpec(
                    **common,
                    url=f"http://127.0.0.1:{standin_port}",
                    keys=[None] * sc.concurrency,
                    pids={"standin": [upstream.pid]},
                )
            )
            rollouts = [gateway.new_rollout() for _ in range(sc.concurrency)]
            rollout_ids += [r["rollout_id"] for r in rollouts]
            via = run_loadgen(
                LoadSpec(
                    **common,
                    url=gateway.url,
                    keys=[r["api_key"] for r in rollouts],
                    pids={"gateway": [gateway.proc.pid], "standin": [upstream.pid]},
                    postgres=(POSTGRES_URL, datname),
                    metrics=(gateway.url + "/metrics", ADMIN_KEY),
                )
            )
            for side, r in (("direct", direct), ("gateway", via)):
                if r.first_error:
                    print_fn(f"  {sc.name} {side}: {r.errors} errors, first: {r.first_error}")
            sent += via.sent
            acknowledged += via.ok
            rows[sc.name] = summarize(sc, direct, via, stream_events)
            print_fn(
                f"  {sc.name}: {rows[sc.name]['gateway']['requests']} requests through the "
                f"gateway, added p50 {rows[sc.name]['added_p50_ms']:+.2f} ms"
            )
        stored = _fetchval(
            dsn,
            "SELECT count(*) FROM calls WHERE rollout_id = ANY($1::uuid[]) AND status = 'ok'",
            rollout_ids,
        )
    except Exception:
        print_fn(f"gateway log ({gateway.log_path}), last lines:\n{gateway.log_tail()}")
        raise
    finally:
        gateway.stop()
        upstream.terminate()
        upstream.wait(10)
    shutil.rmtree(log_dir, ignore_errors=True)
    lost = {"sent": sent, "acknowledged": acknowledged, "rows": stored}
    return rows, {**lost, "lost": acknowledged - stored}


def add_marginals(rows: dict, stream_events: int) -> None:
    """Per-chunk CPU net of the per-request cost: (streamed - non-streamed) / events, for each
    concurrency measured both ways."""
    plain = [s for s in SCENARIOS if not s.unknown_turn]
    for streamed in (s for s in plain if s.stream):
        for whole in (s for s in plain if not s.stream):
            if whole.concurrency == streamed.concurrency:
                rows[streamed.name]["marginal_cpu_us_per_chunk"] = (
                    rows[streamed.name]["gateway_cpu_us_per_request"]
                    - rows[whole.name]["gateway_cpu_us_per_request"]
                ) / stream_events


def run(print_fn=print) -> dict:
    from bench import gateway_contexts, postgres_cost, recorder_variants  # built on this module

    datname = f"rolltap_bench_{uuid.uuid4().hex[:10]}"
    dsn = f"{POSTGRES_URL.rpartition('/')[0]}/{datname}"
    meta = json.loads(standin.META.read_text())
    stream_events = meta["stream_events"]
    admin_sql(f'CREATE DATABASE "{datname}"')
    try:
        commit_ms = commit_latency_ms(dsn)
        print_fn(
            f"gateway overhead: STAND-IN upstream replaying recorded {meta['engine']} replies "
            f"with no delay ({meta['prompt_tokens']}-token prompt, {meta['completion_tokens']} "
            f"sampled tokens, {stream_events} SSE events); gateway at the default log level "
            f"(INFO, access log on) recording into a fresh "
            f"Postgres database (one-row commit p50 here: {commit_ms:.2f} ms); "
            f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start"
        )
        rows, lost = _measure(dsn, datname, stream_events, print_fn)
        add_marginals(rows, stream_events)
        print_fn(format_table(SCENARIOS, rows, lost, stream_events))
        print_fn("\nby context, as deployed (INFO log level, access log on, bodies recorded):")
        contexts = gateway_contexts.run(dsn, datname, print_fn)
        recorder = recorder_variants.run(dsn, print_fn)
        postgres = postgres_cost.run(dsn, print_fn)
    finally:
        admin_sql(f'DROP DATABASE IF EXISTS "{datname}" WITH (FORCE)')
    print_fn(f"load average at the end: {os.getloadavg()[0]:.1f}")
    plain = [s for s in SCENARIOS if not s.unknown_turn]
    whole_c1 = next(s for s in plain if s.concurrency == 1 and not s.stream)
    return {
        "scenarios": rows,
        "contexts": contexts,
        "recorder": recorder,
        "postgres": postgres,
        "lost_records": lost,
        "stream_events": stream_events,
        "commit_p50_ms": commit_ms,
        "targets": {
            "added_p50_ms_c1": rows[whole_c1.name]["added_p50_ms"] <= TARGET_ADDED_P50_MS,
            "cpu_us_per_request": all(
                rows[s.name]["gateway_cpu_us_per_request"] <= TARGET_CPU_PER_REQUEST_US
                for s in plain
                if not s.stream
            ),
            "cpu_us_per_chunk": all(
                rows[s.name]["gateway_cpu_us_per_chunk"] <= TARGET_CPU_PER_CHUNK_US
                for s in plain
                if s.stream
            ),
            "no_lost_records": lost["lost"] == 0,
            "postgres_cpu_us_per_call": all(
                rows[s.name]["postgres_cpu_us_per_request"] <= TARGET_POSTGRES_CPU_US
                for s in plain
                if not s.stream
            ),
        },
    }


if __name__ == "__main__":
    if sys.argv[1:2] == ["--loadgen"]:
        sys.exit(_loadgen_main(*sys.argv[2:4]))
    run()
