"""rolltap beside its floors, in one run: what a call costs rolltap above a bare durable
recording proxy, as ratios.

Side by side against one stand-in upstream per context (`bench/standin.py`, synthetic replies:
512 or 32k prompt tokens, 32 sampled, no delay), each a process of its own:

- direct: the stand-in reached straight (the latency baseline);
- pass-through: a bare aiohttp proxy that parses and records nothing (`bench/passthrough.py`);
- recorder floor: a bare durable recorder written for the bench (`bench/recorder_floor.py`:
  msgspec decode, one row a call with ids and logprobs, grouped commits through one writer
  task, the answer after the commit);
- rolltap: `rolltap gateway` as deployed (INFO log level, bodies recorded), each simulated
  harness its own rollout, the CPU account on (`--cpu-account`);
- OpenEnv 0.10.0's capture proxy (`bench/peer_openenv.py`; memory only, 512 tokens only).

Loads: c=1 and c=64 simulated harnesses, non-streamed (json) and streamed (sse), each sending
the same request one call after another. Each load runs every side back to back, in the
opposite order every other round; numbers are medians of the rounds. CPU is a process's
user + system time from /proc over the measured phase, per call; Postgres is the backends of
the recorder's own database. A stream's per-chunk cost is its CPU per call less the same
side's json call, over the chunks. `ROLLTAP_BENCH_QUICK=1` (or `python -m bench --quick`):
one round of shorter runs. `ROLLTAP_BENCH_FOCUS=1` with `ROLLTAP_BENCH_BEFORE=DIR` (another
checkout, e.g. `git archive BASE | tar -x -C DIR`): a change before and after, json at 512 tokens
only, rolltap from both checkouts beside the recorder floor, in 4 rounds.

    python -m bench floors          # this section; `python -m bench --quick floors`: shorter
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import msgspec
import numpy as np

from bench import cpu_account, peer_openenv, postgres_split, standin
from bench.bench_gateway import (
    ADMIN_KEY,
    POSTGRES_URL,
    Gateway,
    LoadResult,
    LoadSpec,
    admin_sql,
    free_port,
    run_loadgen,
)

QUICK = os.environ.get("ROLLTAP_BENCH_QUICK", "") not in ("", "0")
# A change's before and after: only rolltap (this checkout and ROLLTAP_BENCH_BEFORE's) and the
# recorder floor, json at 512 tokens, in more rounds.
FOCUS = os.environ.get("ROLLTAP_BENCH_FOCUS", "") not in ("", "0")
CONTEXTS = (512,) if FOCUS else (512, 32768)
COMPLETION_TOKENS = 32
ROUNDS = 4 if FOCUS else 1 if QUICK else 2
SECONDS = 1.5 if QUICK else 2.5
LOADS = (("json", 1), ("json", 64)) + (() if FOCUS else (("sse", 1), ("sse", 64)))
SIDES = ("direct", "pass-through", "recorder floor", "rolltap", "rolltap before",
         "rolltap +account", "OpenEnv")
FLOORS = ("recorder floor", "pass-through")
# Issue #41's goals: rolltap's CPU and Postgres CPU per call over the recorder floor's.
GOAL_CPU_RATIO = 1.5
GOAL_PG_RATIO = 1.5


class Numbers(msgspec.Struct):
    cpu_us: float
    pg_us: float
    p50_ms: float
    p99_ms: float
    chunks: float
    errors: int
    stages_us: dict[str, float] = {}


def numbers(r: LoadResult) -> Numbers:
    n = len(r.latency_s)

    def per_call(seconds: float | None) -> float:
        return seconds * 1e6 / n if n and seconds is not None else float("nan")

    lat = np.asarray(r.latency_s) if n else np.asarray([float("nan")])
    return Numbers(
        cpu_us=per_call(r.cpu_s.get("proxy")),
        pg_us=per_call(r.cpu_s.get("postgres")),
        p50_ms=float(np.percentile(lat, 50)) * 1e3,
        p99_ms=float(np.percentile(lat, 99)) * 1e3,
        chunks=float(np.median(r.chunks)) if r.chunks else 0.0,
        errors=r.errors,
        stages_us=r.stage_cpu_us,
    )


ACCOUNTED = "rolltap +account"  # rolltap with --cpu-account: its account table's source
BEFORE = "rolltap before"  # rolltap from the checkout ROLLTAP_BENCH_BEFORE names, if any


class Context:
    """One context's processes: the stand-in and every proxy in front of it."""

    def __init__(self, tokens: int, dsns: dict[str, str], log_dir: Path, openenv) -> None:
        self.tokens = tokens
        self.dsns = dsns
        port = free_port()
        self.upstream = f"http://127.0.0.1:{port}"
        self.procs: list[subprocess.Popen] = []
        self.gateways: dict[str, Gateway] = {}
        for side in dsns:
            if side.startswith("rolltap") and (side != ACCOUNTED or tokens == min(CONTEXTS)):
                log = log_dir / f"{side.replace(' ', '-')}-{tokens}.log"
                self.gateways[side] = Gateway(self.upstream, dsns[side], log)
        if ACCOUNTED in self.gateways:
            self.gateways[ACCOUNTED].args.append("--cpu-account")
        if BEFORE in self.gateways:
            before = self.gateways[BEFORE]
            before.cwd = Path(os.environ["ROLLTAP_BENCH_BEFORE"])
            if not (before.cwd / "core" / "cli.py").exists():  # from before issue #40's layout
                before.args[before.args.index("core.cli")] = "gateway.cli"
        self.openenv = None
        if openenv is not None:
            model = json.loads(standin.META.read_text())["model"]
            self.openenv = peer_openenv.CaptureProxy(
                openenv, self.upstream, model, log_dir / "openenv.log"
            )
        self.urls: dict[str, tuple[str, int | None]] = {}
        try:
            self.procs.append(standin.start(port, context=(tokens, COMPLETION_TOKENS)))
            self.urls["direct"] = (self.upstream, None)
            for side, argv in (
                ("pass-through", ["-m", "bench.passthrough"]),
                ("recorder floor", ["-m", "bench.recorder_floor", "--database-url",
                                    dsns["recorder floor"]]),
            ):  # fmt: skip
                p = free_port()
                argv = [*argv, "--port", str(p), "--upstream", self.upstream]
                self.procs.append(standin.start(p, argv=argv))
                self.urls[side] = (f"http://127.0.0.1:{p}", self.procs[-1].pid)
            for side, gateway in self.gateways.items():
                gateway.start()
                self.urls[side] = (gateway.url, gateway.pid)
            if self.openenv is not None:
                self.openenv.start(timeout=180)
                self.urls["OpenEnv"] = (self.openenv.url, self.openenv.pid)
        except BaseException:
            self.stop()
            raise

    def sides(self, load: str) -> list[str]:
        """The sides measured under `load`: the account only for json calls."""
        sides = [s for s in SIDES if s in self.urls]
        if FOCUS:
            return [s for s in sides if s in ("direct", "recorder floor", "rolltap", BEFORE)]
        return [s for s in sides if s != ACCOUNTED or load.startswith("json")]

    def keys(self, side: str, n: int) -> list[str | None]:
        if side in self.gateways:
            return [self.gateways[side].new_rollout()["api_key"] for _ in range(n)]
        if side == "OpenEnv" and self.openenv is not None:
            return [self.openenv.new_session() for _ in range(n)]
        return [None] * n

    def run(self, side: str, stream: bool, concurrency: int, print_fn) -> Numbers:
        url, pid = self.urls[side]
        keys = self.keys(side, concurrency)
        datname = self.dsns.get(side, "").rpartition("/")[2]
        metrics = None
        if side == ACCOUNTED:
            metrics = (self.gateways[side].url + "/metrics", ADMIN_KEY)
        r = run_loadgen(
            LoadSpec(
                url=url,
                keys=keys,
                stream=stream,
                unknown_turn=False,
                requests=1_000_000,
                seconds=SECONDS,
                warmup=20 if concurrency == 1 else 2,
                pids={"standin": [self.procs[0].pid], **({"proxy": [pid]} if pid else {})},
                postgres=(POSTGRES_URL, datname) if datname else None,
                context_tokens=self.tokens,
                metrics=metrics,
            )
        )
        if side == "OpenEnv" and self.openenv is not None:
            self.openenv.collect([k for k in keys if k], (self.tokens, COMPLETION_TOKENS))
        if r.first_error:
            print_fn(f"  {self.tokens} {side}: {r.errors} errors, first: {r.first_error}")
        return numbers(r)

    def stop(self) -> None:
        for gateway in self.gateways.values():
            gateway.stop()
        if self.openenv is not None:
            self.openenv.stop()
        for proc in self.procs:
            proc.terminate()
            proc.wait(10)


def measure(contexts: list[Context], print_fn) -> dict:
    """{(context, load, side): [Numbers of each round]}."""
    out: dict[tuple[int, str, str], list[Numbers]] = {}
    for i in range(ROUNDS):
        for mode, c in LOADS:
            load = f"{mode} c={c}"
            for ctx in contexts:
                sides = ctx.sides(load)
                for side in sides if i % 2 == 0 else sides[::-1]:
                    out.setdefault((ctx.tokens, load, side), []).append(
                        ctx.run(side, mode == "sse", c, print_fn)
                    )
            print_fn(f"  round {i + 1} of {ROUNDS}: {load} measured")
    return out


def median(rounds: list[Numbers]) -> Numbers:
    fields = ("cpu_us", "pg_us", "p50_ms", "p99_ms", "chunks")
    values = {f: float(np.median([getattr(r, f) for r in rounds])) for f in fields}
    stages = {k: float(np.median([r.stages_us.get(k, 0.0) for r in rounds]))
              for k in rounds[0].stages_us}  # fmt: skip
    return Numbers(**values, errors=sum(r.errors for r in rounds), stages_us=stages)


def _f(x: float, digits: int = 0, sign: str = "") -> str:
    return "-" if x != x else f"{x:{sign},.{digits}f}"


def _ratio(a: float, b: float) -> str:
    return "-" if not (a == a and b == b) or b <= 0 else f"{a / b:.2f}×"


def table(results: dict) -> tuple[str, dict]:
    """The side-by-side table and the ratios it shows, {(context, load): {measure: ratio}}."""
    head = (f"{'context':<8}{'load':<10}{'side':<16}{'CPU µs/call':>12}{'PG µs/call':>11}"
            f"{'+p50 ms':>9}{'+p99 ms':>9}{'µs/chunk':>10}")  # fmt: skip
    lines, ratios = [head, "-" * len(head)], {}
    for (tokens, load, side), n in results.items():
        if side == "direct":
            continue
        direct = results[(tokens, load, "direct")]
        chunk = float("nan")
        if load.startswith("sse"):
            whole = results.get((tokens, load.replace("sse", "json"), side))
            if whole is not None and n.chunks > 1:
                chunk = (n.cpu_us - whole.cpu_us) / n.chunks
        lines.append(
            f"{tokens:<8}{load:<10}{side:<16}{_f(n.cpu_us):>12}{_f(n.pg_us):>11}"
            f"{_f(n.p50_ms - direct.p50_ms, 2, '+'):>9}{_f(n.p99_ms - direct.p99_ms, 2, '+'):>9}"
            f"{_f(chunk, 1):>10}" + (f"   {n.errors} ERRORS" if n.errors else "")
        )
        if side not in ("rolltap", BEFORE):
            continue
        for floor in FLOORS:
            f = results.get((tokens, load, floor))
            if f is None:
                continue  # not measured (ROLLTAP_BENCH_FOCUS)
            fchunk = float("nan")
            if load.startswith("sse"):
                fw = results[(tokens, load.replace("sse", "json"), floor)]
                fchunk = (f.cpu_us - fw.cpu_us) / f.chunks if f.chunks > 1 else float("nan")
            r = {
                "cpu": _ratio(n.cpu_us, f.cpu_us),
                "pg": _ratio(n.pg_us, f.pg_us),
                "p50": _ratio(n.p50_ms - direct.p50_ms, f.p50_ms - direct.p50_ms),
                "p99": _ratio(n.p99_ms - direct.p99_ms, f.p99_ms - direct.p99_ms),
                "chunk": _ratio(chunk, fchunk),
            }
            ratios[(tokens, load, side, floor)] = r
            lines.append(f"{'':<18}{'  ÷ ' + floor:<16}{r['cpu']:>12}{r['pg']:>11}"
                         f"{r['p50']:>9}{r['p99']:>9}{r['chunk']:>10}")  # fmt: skip
    return "\n".join(lines), ratios


def growth(results: dict) -> dict[str, float]:
    """rolltap's json CPU per call at the longest context over the shortest, by load."""
    lo, hi = min(CONTEXTS), max(CONTEXTS)
    return {
        load: results[(hi, load, "rolltap")].cpu_us / results[(lo, load, "rolltap")].cpu_us
        for load in ("json c=1", "json c=64")
    }


def goals(results: dict) -> list[str]:
    lo = min(CONTEXTS)
    lines = []
    for load in ("json c=1", "json c=64"):
        ours, floor = results[(lo, load, "rolltap")], results[(lo, load, "recorder floor")]
        cpu, pg = ours.cpu_us / floor.cpu_us, ours.pg_us / floor.pg_us
        lines.append(
            f"  {lo} tokens {load}: CPU {cpu:.2f}× the floor "
            f"(goal ≤ {GOAL_CPU_RATIO:g}×: {'met' if cpu <= GOAL_CPU_RATIO else 'MISSED'}), "
            f"Postgres {pg:.2f}× (goal ≤ {GOAL_PG_RATIO:g}×: "
            f"{'met' if pg <= GOAL_PG_RATIO else 'MISSED'})"
        )
    if len(CONTEXTS) < 2:
        return lines
    g = growth(results)
    each = ", ".join(f"{k} {v:.2f}×" for k, v in g.items())
    lines.append(f"  growth 512 → 32k tokens, rolltap json CPU/call: {each}\n"
                 "  (one request repeated; a growing conversation's later calls: the gateway\n"
                 "  section's contexts table, goal ≤ 1.25×)")
    return lines


def _measure_all(dsns: dict[str, str], openenv, print_fn) -> dict:
    """Every context's processes started, `measure`d and stopped."""
    log_dir = Path(tempfile.mkdtemp(prefix="rolltap-bench-floors-"))
    contexts: list[Context] = []
    try:
        for tokens in CONTEXTS:
            peer = openenv if tokens == 512 and not FOCUS else None
            contexts.append(Context(tokens, dsns, log_dir, peer))
        return measure(contexts, print_fn)
    except Exception:
        for ctx in contexts:
            for side, gateway in ctx.gateways.items():
                print_fn(f"{side} log ({ctx.tokens}), last lines:\n{gateway.log_tail()}")
        raise
    finally:
        for ctx in contexts:
            ctx.stop()
        shutil.rmtree(log_dir, ignore_errors=True)


def run(print_fn=print) -> dict:
    try:
        openenv = peer_openenv.ensure_venv(print_fn)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        print_fn(f"OpenEnv's capture proxy NOT MEASURED here: {exc}")
        openenv = None
    dsns = {}
    recorders = ["rolltap", "recorder floor"] + ([] if FOCUS else [ACCOUNTED])
    if os.environ.get("ROLLTAP_BENCH_BEFORE"):
        recorders.append(BEFORE)
    for side in recorders:
        datname = f"rolltap_bench_{uuid.uuid4().hex[:10]}"
        admin_sql(f'CREATE DATABASE "{datname}"')
        dsns[side] = f"{POSTGRES_URL.rpartition('/')[0]}/{datname}"
    load0 = os.getloadavg()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        cwd=Path(__file__).resolve().parents[1],
    ).stdout.strip()  # fmt: skip
    print_fn(
        f"rolltap and its floors: stand-in upstream ({', '.join(map(str, CONTEXTS))} prompt "
        f"tokens, {COMPLETION_TOKENS} sampled, no delay); {ROUNDS} round(s) of {SECONDS:g} s "
        f"runs{' (quick)' if QUICK else ''}; commit {commit or '?'}; {os.cpu_count()} CPUs, "
        f"load average {load0[0]:.1f} / {load0[1]:.1f} at start"
    )
    try:
        rounds = _measure_all(dsns, openenv, print_fn)
        split = {} if FOCUS else postgres_split.run(dsns["recorder floor"], print_fn)
    finally:
        for dsn in dsns.values():
            admin_sql(f'DROP DATABASE IF EXISTS "{dsn.rpartition("/")[2]}" WITH (FORCE)')
    results = {k: median(v) for k, v in rounds.items()}
    for (tokens, load, side), n in results.items():  # the numbers, whatever the table makes of them
        print_fn(f"  {tokens} {load} {side}: {msgspec.json.encode(n).decode()}")
    text, ratios = table(results)
    print_fn(text)
    print_fn("\n".join([
        "÷ rows: rolltap's figure over the floor's (CPU and Postgres per call, added p50/p99",
        "over direct, per-chunk CPU). Medians of the rounds. Goals (issue #41):",
        *goals(results),
    ]))  # fmt: skip
    for load in () if FOCUS else ("json c=1", "json c=64"):
        n = results[(min(CONTEXTS), load, ACCOUNTED)]
        print_fn(cpu_account.table(n.stages_us, n.cpu_us, f"{min(CONTEXTS)} tokens {load}"))
    print_fn(f"load average at the end: {os.getloadavg()[0]:.1f}")
    return {
        "commit": commit,
        "load_average": load0,
        "rows": {f"{t} {load} {s}": msgspec.to_builtins(n) for (t, load, s), n in results.items()},
        "ratios": {f"{t} {load} {s} ÷ {f}": r for (t, load, s, f), r in ratios.items()},
        "growth": growth(results) if len(CONTEXTS) > 1 else {},
        "postgres_split": split,
    }


if __name__ == "__main__":
    run()
