"""A load of agent rollouts: each simulated harness runs rollouts of several calls, and every
call after a rollout's first resends the whole conversation with the model's reply and a new
turn (a tool result) appended, as a coding agent does. A rollout's first call carries its whole
context; a later one adds a reply and a turn to it.

The first calls and the later calls are measured apart (CPU of the named processes over each
phase): all harnesses open their rollouts first, then take them turn by turn, round robin, so
that one phase holds only first calls and the other only later ones. Each harness's first
rollout runs whole before that, unmeasured (connections, the gateway's template probe).

    python -m bench.conversation_load SPEC RESULT   # one load, in a process of its own
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from bench import standin
from bench.bench_gateway import (
    REPO,
    LoadResult,
    _cpu,
    _postgres_backends,
    context_request,
    stage_cpu,
    stage_cpu_per_call,
)

TURN_CHARS = 256  # a new turn of about 64 tokens


class ConversationSpec(msgspec.Struct, frozen=True, kw_only=True):
    url: str
    # Per harness, its rollouts' keys (None: no Authorization header); the first is the warm-up.
    rollouts: list[list[str | None]]
    turns: int  # calls per rollout
    context_tokens: int  # the first call's context, about
    pids: dict[str, list[int]]  # processes whose CPU time is measured, by role
    postgres: tuple[str, str] | None = None  # (server DSN, database): also time its backends
    # (the gateway's /metrics, its admin key): read its CPU per stage over each measured phase
    metrics: tuple[str, str] | None = None


class ConversationResult(msgspec.Struct):
    first: LoadResult
    later: LoadResult


def new_turn(rollout: int, turn: int) -> dict:
    """A tool result of about TURN_CHARS characters, different in every rollout and turn."""
    text = f"tool output of step {turn} in rollout {rollout}:\n"
    i = 0
    while len(text) < TURN_CHARS:
        text += f"  line {i}: value={rollout * 31 + turn * 7 + i}\n"
        i += 1
    return {"role": "user", "content": text}


def _empty() -> LoadResult:
    return LoadResult(
        sent=0, ok=0, errors=0, first_error=None, wall_s=0.0, latency_s=[], ttfc_s=[],
        gap_s=[], chunks=[], cpu_s={}, system_cpu_s={},
    )  # fmt: skip


async def conversations(spec: ConversationSpec) -> ConversationResult:
    import aiohttp

    base = json.loads(standin.REQUEST.read_text())
    base = context_request(base, spec.context_tokens)
    base.pop("max_tokens", None)  # the stand-in's replies have their own length
    url = spec.url + "/v1/chat/completions"
    # (harness, rollout) -> the conversation so far
    history: dict[tuple[int, int], list[dict]] = {}

    async def call(session, h: int, r: int, res: LoadResult) -> None:
        key = spec.rollouts[h][r]
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        messages = history.setdefault((h, r), list(base["messages"]))
        body = msgspec.json.encode({**base, "messages": messages})
        res.sent += 1
        t0 = time.perf_counter()
        try:
            async with session.post(url, data=body, headers=headers) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {raw[:300]!r}")
        except (aiohttp.ClientError, RuntimeError, TimeoutError) as exc:
            res.errors += 1
            res.first_error = res.first_error or f"{type(exc).__name__}: {exc}"
            return
        res.latency_s.append(time.perf_counter() - t0)
        res.ok += 1
        reply = msgspec.json.decode(raw)["choices"][0]["message"]
        turn = len([m for m in messages if m["role"] == "assistant"]) + 1
        messages += [
            {"role": "assistant", "content": reply.get("content")},
            new_turn(h * 1000 + r, turn),
        ]

    async def phase(session, plan, pids) -> LoadResult:
        """Each harness's calls of `plan(h)`, in order; the harnesses side by side."""
        res = _empty()
        stages0 = await stage_cpu(session, spec.metrics) if pids else {}
        cpu0 = _cpu(pids)
        t0 = time.perf_counter()

        async def harness(h: int) -> None:
            for r in plan(h):
                await call(session, h, r, res)

        await asyncio.gather(*(harness(h) for h in range(len(spec.rollouts))))
        res.wall_s = time.perf_counter() - t0
        cpu1 = _cpu(pids)
        res.cpu_s = {k: sum(cpu1[k]) - sum(cpu0[k]) for k in cpu1}
        res.system_cpu_s = {k: cpu1[k][1] - cpu0[k][1] for k in cpu1}
        if pids:  # not the warm-up
            res.stage_cpu_us = stage_cpu_per_call(stages0, await stage_cpu(session, spec.metrics))
        return res

    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        warm = await phase(session, lambda h: [0] * spec.turns, {})
        if not warm.ok:  # a few refusals (a busy database's 503) are counted when measured
            raise RuntimeError(f"warm-up failed: {warm.first_error}")
        pids = dict(spec.pids)
        if spec.postgres:
            pids["postgres"] = await _postgres_backends(*spec.postgres)
        measured = lambda h: range(1, len(spec.rollouts[h]))  # noqa: E731
        first = await phase(session, measured, pids)
        later = await phase(
            session, lambda h: [r for _ in range(spec.turns - 1) for r in measured(h)], pids
        )
    return ConversationResult(first=first, later=later)


def run(spec: ConversationSpec) -> ConversationResult:
    """`conversations(spec)` in a process of its own."""
    with tempfile.TemporaryDirectory(prefix="rolltap-conversations-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_bytes(msgspec.json.encode(spec))
        proc = subprocess.run(
            [sys.executable, "-m", "bench.conversation_load", spec_path, result_path],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=900,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"load generator failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return msgspec.json.decode(result_path.read_bytes(), type=ConversationResult)


def main(argv: list[str]) -> int:
    import uvloop

    spec = msgspec.json.decode(Path(argv[0]).read_bytes(), type=ConversationSpec)
    Path(argv[1]).write_bytes(msgspec.json.encode(uvloop.run(conversations(spec))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
