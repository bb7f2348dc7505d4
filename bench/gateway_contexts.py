"""The gateway's cost per call as a deployment pays it, by context length: part of the gateway
section (`bench/bench_gateway.py`).

Each context (512, 8k and 32k prompt tokens, 32 sampled) gets a synthetic stand-in (recorded
vLLM replies cut to 32 tokens; prompts rendered from the request's messages by a stand-in chat
template, or the ids the request fixed, and echoed as vLLM's `return_token_ids` does; vLLM's
render endpoint served from the same template), a bare aiohttp pass-through in front of it as
the reference, and a gateway run as an operator runs it: the default log level (INFO, one
access-log line per call), bodies recorded, every call committed.

Non-streamed calls come as agent rollouts (`bench/conversation_load.py`): a rollout's first call
carries the whole context as text; each later one resends the conversation with the reply and
a new turn of about 64 tokens appended, so the gateway continues it exactly (rolling keys,
renders, the parent's ids), stores its body as a delta, and is not sent back the prompt it
sent (the sampled ids come as logprob tokens).
First and later calls are measured apart, in ROUNDS rounds; within a round each load runs at
every context back to back, in the opposite order every other round, and each number is the
median of its rounds. How a later call's CPU grows with the context is a ratio of two
contexts' CPU measured seconds apart in one round, the median over the rounds: these shared
machines change speed by half between minutes, which a ratio of two medians taken minutes
apart would measure instead. Streams repeat one request
(their per-chunk cost does not depend on the conversation).

Postgres CPU is its backends' user + system time from /proc over the measured phase (the
gateway's pool connections), divided by the calls recorded in it.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np

from bench import conversation_load, request_parse, standin
from bench.bench_gateway import (
    ADMIN_KEY,
    POSTGRES_URL,
    TARGET_POSTGRES_CPU_US,
    Gateway,
    LoadResult,
    LoadSpec,
    _num,
    _p,
    free_port,
    run_loadgen,
)

CONTEXTS = (512, 8192, 32768)
COMPLETION_TOKENS = 32
# The goals of issue #14, per non-streamed call unless named otherwise.
GOAL_CPU_US = 400.0
GOAL_ADDED_P50_MS = 1.0
GOAL_CHUNK_US = 15.0
GOAL_POSTGRES_US = TARGET_POSTGRES_CPU_US


LONG_STREAM_TOKENS = 256  # a stream this long tells one chunk's cost from a call's


class Run(msgspec.Struct, frozen=True):
    stream: bool
    concurrency: int
    seconds: float
    warmup: int
    tokens: int = COMPLETION_TOKENS

    @property
    def name(self) -> str:
        name = f"{'sse' if self.stream else 'json'} c={self.concurrency}"
        return name if self.tokens == COMPLETION_TOKENS else f"{name} {self.tokens}"


RUNS = (
    Run(stream=True, concurrency=1, seconds=3, warmup=20),
    Run(stream=True, concurrency=1, seconds=3, warmup=5, tokens=LONG_STREAM_TOKENS),
)
# Rollout loads: (harnesses, measured rollouts each); every rollout has TURNS calls. At c=64,
# 4 rollouts a harness (1,024 later calls): with 2, the 32k row moved by a third between runs.
ROLLOUTS = ((1, 60), (64, 4))
TURNS = 5
# Rounds of the rollout loads, each context in turn: a context's numbers are their medians.
# Per-call CPU at c=64 moved by a third between single runs on this 2-core machine. An even
# number, so that each context runs as often early in a round as late.
ROUNDS = 4


def _per_call(seconds: float, r: LoadResult) -> float:
    return seconds * 1e6 / len(r.latency_s) if r.latency_s else float("nan")


def _numbers(r: LoadResult, rows: float, commits: int) -> dict:
    return {
        "batch_rows": rows / commits if commits else float("nan"),
        "p50_ms": _p(r.latency_s, 50) * 1e3,
        "rps": len(r.latency_s) / r.wall_s if r.wall_s else float("nan"),
        "cpu_us": _per_call(r.cpu_s.get("proxy", float("nan")), r),
        "kernel_us": _per_call(r.system_cpu_s.get("proxy", float("nan")), r),
        "postgres_us": _per_call(r.cpu_s.get("postgres", float("nan")), r),
        "chunks": _p(r.chunks, 50) if r.chunks else 0,
        "errors": r.errors,
        **{f"stage {k}": v for k, v in r.stage_cpu_us.items()},
    }


class _Context:
    """One context's processes: its stand-in, the pass-through and the gateway in front of it."""

    def __init__(self, tokens: int, dsn: str, log_dir: Path) -> None:
        self.tokens = tokens
        port, pass_port = free_port(), free_port()
        upstream_url = f"http://127.0.0.1:{port}"
        self.procs: list[subprocess.Popen] = []
        self.gateway = Gateway(upstream_url, dsn, log_dir / f"gateway-{tokens}.log")
        try:
            self.procs.append(
                standin.start(port, context=(tokens, COMPLETION_TOKENS), template=True)
            )
            self.procs.append(
                standin.start(
                    pass_port,
                    argv=["-m", "bench.passthrough", "--port", str(pass_port), "--upstream",
                          upstream_url],
                )  # fmt: skip
            )
            self.gateway.start()
        except BaseException:
            self.stop()
            raise
        self.sides = {
            "direct": (upstream_url, None),
            "aiohttp pass-through": (f"http://127.0.0.1:{pass_port}", self.procs[1].pid),
            "gateway": (self.gateway.url, self.gateway.proc.pid),
        }

    def pids(self, pid: int | None) -> dict[str, list[int]]:
        return {"standin": [self.procs[0].pid], **({"proxy": [pid]} if pid else {})}

    def stop(self) -> None:
        self.gateway.stop()
        for proc in self.procs:
            proc.terminate()
            proc.wait(10)


def _rollout_load(
    ctx: _Context, side: str, concurrency: int, rollouts: int, datname: str, print_fn
) -> dict[str, dict]:
    """{run name: numbers} of one rollout load (its first and its later calls) through `side`
    of `ctx`."""
    url, pid = ctx.sides[side]
    gateway = ctx.gateway
    keys = [[None] * (rollouts + 1) for _ in range(concurrency)]
    if side == "gateway":
        keys = [[gateway.new_rollout()["api_key"] for _ in h] for h in keys]
    batches0 = gateway.batch_rows()
    r = conversation_load.run(
        conversation_load.ConversationSpec(
            url=url,
            rollouts=keys,
            turns=TURNS,
            context_tokens=ctx.tokens,
            pids=ctx.pids(pid),
            postgres=(POSTGRES_URL, datname) if side == "gateway" else None,
            metrics=(gateway.url + "/metrics", ADMIN_KEY) if side == "gateway" else None,
        )
    )
    rows, commits = (a - b for a, b in zip(gateway.batch_rows(), batches0))
    out = {}
    for phase, res in (("first", r.first), ("later", r.later)):
        if res.first_error:
            print_fn(
                f"  {ctx.tokens} {side} c={concurrency} {phase}: {res.errors} "
                f"errors: {res.first_error}"
            )
        commits_here = commits if side == "gateway" else 0
        out[f"json c={concurrency} {phase}"] = _numbers(res, rows, commits_here)
    return out


def _round(contexts: list[_Context], datname: str, print_fn) -> dict[int, dict[str, dict]]:
    """{context: {side: {run name: numbers}}} of one round of rollout loads. Each load and side
    runs at every context back to back, so that a ratio of two contexts' numbers compares runs
    seconds apart, not minutes."""
    out: dict[int, dict] = {ctx.tokens: {side: {} for side in ctx.sides} for ctx in contexts}
    for concurrency, rollouts in ROLLOUTS:
        for side in contexts[0].sides:
            if side == "direct" and concurrency != 1:
                continue  # only the latency baseline is needed
            for ctx in contexts:
                out[ctx.tokens][side].update(
                    _rollout_load(ctx, side, concurrency, rollouts, datname, print_fn)
                )
    return out


def _streams(ctx: _Context, datname: str, print_fn) -> dict[str, dict[str, dict]]:
    """{side: {run name: numbers}} of the streamed runs against `ctx`."""
    out: dict[str, dict] = {side: {} for side in ctx.sides}
    gateway = ctx.gateway
    for run in RUNS:
        for side, (url, pid) in ctx.sides.items():
            if side == "direct" and run.tokens != COMPLETION_TOKENS:
                continue  # only the latency baselines are needed
            keys: list[str | None] = [None] * run.concurrency
            if side == "gateway":
                keys = [gateway.new_rollout()["api_key"] for _ in keys]
            batches0 = gateway.batch_rows() if side == "gateway" else (0.0, 0)
            r = run_loadgen(
                LoadSpec(
                    url=url,
                    keys=keys,
                    stream=run.stream,
                    unknown_turn=False,
                    requests=100_000,
                    seconds=run.seconds,
                    warmup=run.warmup,
                    pids=ctx.pids(pid),
                    postgres=(POSTGRES_URL, datname) if side == "gateway" else None,
                    context_tokens=ctx.tokens,
                    max_tokens=run.tokens,
                )
            )
            if r.first_error:
                print_fn(f"  {ctx.tokens} {side} {run.name}: {r.errors} errors: {r.first_error}")
            rows, commits = (
                (a - b for a, b in zip(gateway.batch_rows(), batches0))
                if side == "gateway"
                else (0.0, 0)
            )
            out[side][run.name] = _numbers(r, rows, commits)
    return out


def _median(rounds: list[dict]) -> dict:
    """Each number of the runs of one side and context, the median over the rounds."""
    return {
        name: {k: float(np.median([r[name][k] for r in rounds])) for k in rounds[0][name]}
        for name in rounds[0]
    }


class Measured(msgspec.Struct):
    results: dict  # {context: {side: {run name: numbers}}}, each number its rounds' median
    rounds: dict  # {context: [{side: {run name: numbers}} of each round]}


def measure(dsn: str, datname: str, print_fn) -> Measured:
    """Every context, side and run: the rollout loads in ROUNDS rounds, each load and side run
    at the contexts in turn (reversed every other round), and the median of each number."""
    log_dir = Path(tempfile.mkdtemp(prefix="rolltap-bench-ctx-"))
    contexts: list[_Context] = []
    try:
        for tokens in CONTEXTS:
            contexts.append(_Context(tokens, dsn, log_dir))
        out = {ctx.tokens: _streams(ctx, datname, print_fn) for ctx in contexts}
        rounds: dict[int, list[dict]] = {ctx.tokens: [] for ctx in contexts}
        # The growth ratio's two contexts (the shortest and the longest) run next to each other.
        in_turn = [contexts[0], contexts[-1], *contexts[1:-1]]
        for i in range(ROUNDS):
            measured = _round(in_turn if i % 2 == 0 else in_turn[::-1], datname, print_fn)
            for tokens, sides in measured.items():
                rounds[tokens].append(sides)
            print_fn(f"  round {i + 1} of {ROUNDS}: measured")
        for tokens, measured in rounds.items():
            for side in measured[0]:
                out[tokens][side].update(_median([m[side] for m in measured]))
        return Measured(out, rounds)
    except Exception:
        for ctx in contexts:
            print_fn(f"gateway log ({ctx.tokens}), last lines:\n{ctx.gateway.log_tail()}")
        raise
    finally:
        for ctx in contexts:
            ctx.stop()


def row(side: dict, direct: dict) -> dict:
    """One table row (a context through one proxy) from its runs."""
    j1, j64, s1 = side["json c=1 later"], side["json c=64 later"], side["sse c=1"]
    long = side[f"sse c=1 {LONG_STREAM_TOKENS}"]
    return {
        "cpu_c1_first": side["json c=1 first"]["cpu_us"],
        "cpu_c1": j1["cpu_us"],
        "cpu_c64_first": side["json c=64 first"]["cpu_us"],
        "cpu_c64": j64["cpu_us"],
        "added_json": j1["p50_ms"] - direct["json c=1 later"]["p50_ms"],
        "added_sse": s1["p50_ms"] - direct["sse c=1"]["p50_ms"],
        # Two streams that differ only in their length: the difference, per extra chunk.
        "chunk_us": (long["cpu_us"] - s1["cpu_us"]) / (long["chunks"] - s1["chunks"])
        if long["chunks"] > s1["chunks"]
        else float("nan"),
        "pg_c1": j1["postgres_us"],
        "pg_c64": j64["postgres_us"],
        "rps_c64": j64["rps"],
        "batch_c64": j64["batch_rows"],
    }


COLUMNS = (  # key, header, digits, goal
    ("cpu_c1_first", "CPU µs 1st c=1", 0, None),
    ("cpu_c1", "CPU µs/call c=1", 0, GOAL_CPU_US),
    ("cpu_c64_first", "CPU µs 1st c=64", 0, None),
    ("cpu_c64", "CPU µs/call c=64", 0, GOAL_CPU_US),
    ("added_json", "+p50 ms json", 2, GOAL_ADDED_P50_MS),
    ("added_sse", "+p50 ms sse", 2, GOAL_ADDED_P50_MS),
    ("chunk_us", "CPU µs/chunk", 1, GOAL_CHUNK_US),
    ("pg_c1", "PG µs/call c=1", 0, GOAL_POSTGRES_US),
    ("pg_c64", "PG µs/call c=64", 0, GOAL_POSTGRES_US),
    ("rps_c64", "req/s c=64", 0, None),
    ("batch_c64", "rows/commit c=64", 1, None),
)


def format_table(measured: Measured) -> str:
    results = measured.results
    head = f"{'context':<9}{'proxy':<22}" + "".join(f"{h:>17}" for _, h, _, _ in COLUMNS)
    lines = [head, "-" * len(head)]
    for tokens, sides in results.items():
        for side in ("gateway", "aiohttp pass-through"):
            r = row(sides[side], sides["direct"])
            cells = []
            for key, _, digits, goal in COLUMNS:
                mark = "" if goal is None or side != "gateway" or r[key] <= goal else " !"
                sign = "+" if key.startswith("added") else ""
                cells.append(f"{_num(r[key], digits, sign) + mark:>17}")
            lines.append(f"{tokens:<9}{side:<22}" + "".join(cells))
    goals = "".join(
        f"{'' if goal is None else ('≤ +' if key.startswith('added') else '≤ ') + f'{goal:g}':>17}"
        for key, _, _, goal in COLUMNS
    )
    lines.append(f"{'goal':<9}{'(issue #14)':<22}" + goals)
    lines.append(growth_line(measured.rounds))
    lines.append(
        f"prompt tokens as shown, {COMPLETION_TOKENS} sampled; `!` marks a missed goal; the\n"
        f"non-streamed columns are medians of {ROUNDS} rounds. CPU is\n"
        "the proxy process's per call: a rollout's first call (1st: the whole context is new)\n"
        f"and its later ones (/call: {TURNS - 1} per rollout, each adding a reply and a turn);\n"
        "the other non-streamed columns are the later calls'. PG is Postgres's backends' per\n"
        "recorded call (the pass-through records nothing).\n"
        f"µs/chunk: a {LONG_STREAM_TOKENS}-token stream's CPU less a "
        f"{COMPLETION_TOKENS}-token\none's, over the chunks between them. +p50: over the stand-in "
        "reached directly."
    )
    return "\n".join(lines)


GOAL_GROWTH = 1.5  # a later call's CPU at the longest context over the shortest's


def stage_table(measured: Measured) -> str:
    """A later call's gateway CPU split by the pipeline's stages (gateway/stage_cpu.py), beside
    the whole process's CPU per call: what the stages do not hold is the event loop, the HTTP
    server, the access log and the recorder's commits."""
    lines = []
    for tokens, sides in measured.results.items():
        for load in ("json c=1 later", "json c=64 later"):
            numbers = sides["gateway"][load]
            stages = {k.removeprefix("stage "): v for k, v in numbers.items()
                      if k.startswith("stage ")}  # fmt: skip
            if not stages:
                return ""  # a gateway without the stage clock (before issue #29)
            if not lines:
                head = f"{'context':<9}{'load':<10}" + "".join(f"{s:>9}" for s in stages)
                lines += [head + f"{'stages':>9}{'process':>9}", "-" * (len(head) + 18)]
            cells = "".join(f"{_num(v, 0):>9}" for v in stages.values())
            lines.append(f"{tokens:<9}{load.split()[1]:<10}{cells}"
                         f"{_num(sum(stages.values()), 0):>9}{_num(numbers['cpu_us'], 0):>9}")
    lines.append(
        "a later call's gateway CPU by stage, µs (medians of the rounds): only the stages'\n"
        "synchronous sections are counted; `process` is the gateway's whole CPU per call"
    )
    return "\n".join(lines)


def growth(rounds: dict) -> dict[str, list[float]]:
    """{load: each round's later-call gateway CPU at the longest context over the shortest's}."""
    def cpu(measured: dict, load: str) -> float:
        return measured["gateway"][f"json {load} later"]["cpu_us"]

    short, long = rounds[min(rounds)], rounds[max(rounds)]
    return {
        load: [cpu(a, load) / cpu(b, load) for a, b in zip(long, short)]
        for load in ("c=1", "c=64")
    }


def growth_line(rounds: dict) -> str:
    """How a later call's gateway CPU grows with the context, against the goal, and the part
    of it spent in the kernel (page faults and copies show there)."""
    cells = []
    for load, ratios in growth(rounds).items():
        ratio = float(np.median(ratios))
        each = "/".join(f"{r:.2f}" for r in ratios)
        cells.append(f"{load} {ratio:.2f}×{'' if ratio <= GOAL_GROWTH else ' !'} ({each})")
    kernel = [
        f"{tokens}: {np.median([r['gateway']['json c=64 later']['kernel_us'] for r in each]):.0f}"
        for tokens, each in rounds.items()
    ]
    return (
        f"later-call CPU at {max(rounds)} tokens over {min(rounds)}, the median of the rounds' "
        f"ratios (each round's):\n  {'   '.join(cells)}   (goal ≤ {GOAL_GROWTH:g}×)\n"
        f"  of a later call's CPU at c=64, in the kernel (µs, median): {', '.join(kernel)}"
    )


def best_us(calls: list, rounds: int = 15, inner: int = 10) -> list[float]:
    """For each (fn, *args) of `calls`: the best mean of `inner` calls over `rounds`, the rounds
    interleaved so that a busy machine weighs on every variant alike."""
    best = [float("inf")] * len(calls)
    for _ in range(rounds):
        for i, (fn, *args) in enumerate(calls):
            t0 = time.perf_counter()
            for _ in range(inner):
                fn(*args)
            best[i] = min(best[i], (time.perf_counter() - t0) / inner)
    return [b * 1e6 for b in best]


def _ids_before(raw: bytes) -> np.ndarray:
    return np.asarray(msgspec.json.decode(raw)["prompt_token_ids"], dtype=np.int32)


def _ids_cut(raw: bytes, sent: bytes | None):
    from gateway import engine_ids

    rest, span = engine_ids.split(raw)
    engine_ids.holder(msgspec.json.decode(rest))
    return span == sent if sent is not None else engine_ids.parse(span)


def prompt_ids_table() -> str:
    """The capture's cost for the echoed prompt ids of one whole response, by context: decoded
    with the response and converted (before), cut out and parsed in bulk, and compared with the
    ids the gateway sent (an exact continuation)."""
    whole = msgspec.json.decode(standin.WHOLE.read_bytes())
    rng = np.random.default_rng(0)
    lines = [f"{'prompt ids':<12}{'list (before)':>16}{'bulk parse':>14}{'sent = echoed':>16}"]
    for tokens in CONTEXTS:
        ids = rng.integers(0, 150_000, tokens).tolist()
        raw = msgspec.json.encode({**whole, "prompt_token_ids": ids})
        sent = msgspec.json.encode(ids)

        times = best_us([(_ids_before, raw), (_ids_cut, raw, None), (_ids_cut, raw, sent)])
        lines.append(f"{tokens:<12}" + "".join(f"{t:>13.0f} µs" for t in times))
    lines.append("(one whole response: decode + ids to int32; best of 15 interleaved rounds)")
    return "\n".join(lines)


def body_decode_table() -> str:
    """The cost of decoding a later call's request body, by context: whole (before), whole with
    its layout kept (a rollout's first call), and resumed from the previous request's layout
    (gateway/protocols/resumable.py)."""
    from bench.bench_gateway import context_request
    from gateway.protocols.resumable import Decoder

    decoder = Decoder("messages")
    base = msgspec.json.decode(standin.REQUEST.read_bytes())
    lines = [f"{'request body':<14}{'whole (before)':>16}{'whole + layout':>16}{'resumed':>12}"]
    for tokens in CONTEXTS:
        request = context_request(base, tokens)
        messages = request["messages"]
        earlier = msgspec.json.encode(request)
        reply = {"role": "assistant", "content": "Done: the tests pass."}
        later = msgspec.json.encode(
            {**request, "messages": [*messages, reply, conversation_load.new_turn(0, 1)]}
        )
        _, layout = decoder.decode(earlier)
        times = best_us(
            [
                (msgspec.json.decode, later),
                (decoder.decode, later),
                (decoder.decode, later, [layout] if layout else []),
            ]
        )
        lines.append(
            f"{tokens:<14}{times[0]:>13.0f} µs{times[1]:>13.0f} µs{times[2]:>9.0f} µs"
        )
    lines.append("(a later call's body; best of 15 interleaved rounds)")
    return "\n".join(lines)


def run(dsn: str, datname: str, print_fn) -> dict:
    started = time.monotonic()
    print_fn(prompt_ids_table())
    print_fn(body_decode_table())
    print_fn(request_parse.table())
    measured = measure(dsn, datname, print_fn)
    print_fn(format_table(measured))
    stages = stage_table(measured)
    if stages:
        print_fn(stages)
    print_fn(f"(contexts table: {time.monotonic() - started:.0f} s)")
    return {
        "rows": {
            str(k): {s: row(v[s], v["direct"]) for s in v if s != "direct"}
            for k, v in measured.results.items()
        },
        "growth": {load: float(np.median(r)) for load, r in growth(measured.rounds).items()},
    }
