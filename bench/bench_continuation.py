"""Exact continuation on the tiny model: how many turns continue exactly, and what rendering
the continuation costs per request.

Real parts: vLLM (CPU build) on a freshly built tiny model, gateways (`python -m core.cli
gateway`) recording into a fresh Postgres database. The same tool-using conversations (openai
SDK, forced strict tool calls, as the tests make them) run through three gateways:
`--continuation render` (the engine re-renders every conversation), `exact` with the engine
rendering the continuation (`/v1/chat/completions/render`), and `exact` with `--local-template`.

Measured per mode, from the calls' records: the fraction of turns whose engine prompt starts
with the previous turn's prompt + sampled ids (what the merge needs to extend a sequence), the
merged sequences per conversation, and `render_ms` (the time the gateway spent rendering for the
splice: the added latency of a continued request). Then, in this process, engine against local
rendering of one continuation on conversations of growing length, whole and in the window a
gateway renders (gateway/continuation/window.py), and the cost of computing a request's continuation
keys.

    python -m bench.bench_continuation     # this section alone; `python -m bench` runs all

ROLLTAP_BENCH_UPSTREAM (a running vLLM serving the tiny model as `tiny`, with
ROLLTAP_BENCH_MODEL_DIR its directory) skips starting one.
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

import httpx
import numpy as np
import openai

from bench.bench_gateway import POSTGRES_URL, admin_sql, free_port
from gateway.continuation.checked_render import CheckedRenderer
from gateway.continuation.engine_render import EngineRenderer
from gateway.continuation.keys import RequestKeys
from gateway.continuation.local_template import LocalTemplate
from gateway.continuation.window import WindowedRenderer
from gateway.upstream import Upstreams

REPO = Path(__file__).resolve().parents[1]
ADMIN_KEY = "bench-admin-" + uuid.uuid4().hex
MODEL = "tiny"
CONVERSATIONS = 6
TURNS = 6
TARGET_RENDER_P50_MS = 2.0
MODES = (
    ("render", ("--continuation", "render")),
    ("exact, engine render", ()),
    ("exact, local render", ("--local-template", "{model_dir}")),
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "Run a shell command",
            "parameters": {
                "type": "object",
                "required": ["cmd"],
                "additionalProperties": False,
                "properties": {"cmd": {"type": "string", "enum": ["ls", "pwd", "make"]}},
            },
            "strict": True,
        },
    }
]


class _Gateway:
    """One gateway process with extra flags, and its admin API."""

    def __init__(self, upstream: str, dsn: str, extra: tuple[str, ...], log_path: Path) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self.args = [
            sys.executable, "-m", "core.cli", "gateway", "--upstream", upstream,
            "--port", self.url.rsplit(":", 1)[1], "--database-url", dsn,
            "--admin-key", ADMIN_KEY, "--log-level", "WARNING", *extra,
        ]  # fmt: skip
        self.log_path = log_path
        self.admin = httpx.Client(
            base_url=self.url, timeout=120, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        )
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> _Gateway:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited: {self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError(f"gateway not up: {self.log_path.read_text()[-2000:]}")

    def __exit__(self, *exc) -> None:
        self.admin.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(15)


def _conversation(gw: _Gateway, system: str) -> tuple[list[dict], dict]:
    """One tool-using conversation; returns its calls and the rollout summary after merging."""
    rollout = gw.admin.post("/admin/rollouts", json={"task_id": "bench"}).json()
    client = openai.OpenAI(
        base_url=rollout["openai_base_url"], api_key=rollout["api_key"], max_retries=0, timeout=120
    )
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Build it."}]
    for turn in range(TURNS):
        reply = (
            client.chat.completions.create(
                model=MODEL,
                messages=messages,
                tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "run"}},
                max_tokens=400,
                parallel_tool_calls=False,
            )
            .choices[0]
            .message.model_dump(exclude_none=True)
        )
        messages.append(reply)
        for call in reply.get("tool_calls") or ():
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"ok {turn}"})
        if not reply.get("tool_calls"):
            messages.append({"role": "user", "content": f"go on {turn}"})
    rid = rollout["rollout_id"]
    calls = gw.admin.get(f"/admin/rollouts/{rid}/calls", params={"bodies": "0"}).json()["calls"]
    summary = gw.admin.post(f"/admin/rollouts/{rid}/finish", json={"reward": 1.0}).json()
    return calls, summary


def _mode_numbers(results: list[tuple[list[dict], dict]]) -> dict:
    continued = turns = sequences = drifts = 0
    render_ms: list[float] = []
    by: dict[str, int] = {}
    for calls, summary in results:
        for prev, call in zip(calls, calls[1:]):
            full = prev["prompt_ids"] + prev["completion_ids"]
            turns += 1
            continued += call["prompt_ids"][: len(full)] == full
            rec = call["continuation"] or {}
            if rec.get("render_ms") is not None:
                render_ms.append(rec["render_ms"])
                by[rec["rendered_by"]] = by.get(rec["rendered_by"], 0) + 1
        stats = summary["merge"]["stats"]
        sequences += stats["sequences"]
        drifts += stats["causes"]["drift"]
    ms = np.asarray(render_ms)
    return {
        "continued_turns": continued,
        "turns": turns,
        "continued_fraction": continued / turns if turns else 0.0,
        "sequences_per_conversation": sequences / len(results),
        "drift_forks": drifts,
        "render_ms_p50": float(np.percentile(ms, 50)) if ms.size else None,
        "render_ms_p90": float(np.percentile(ms, 90)) if ms.size else None,
        "rendered_by": by,
    }


async def _render_costs(upstream: str, model_dir: Path) -> list[dict]:
    """One continuation rendered whole and in a window (continuation/window.py), by the engine
    and locally, and the continuation keys, on conversations of growing length (a long system
    prompt, as harnesses send). The windows are timed once trusted, as a gateway uses them."""
    ups = Upstreams([upstream], 60)
    await ups.open()
    engine = EngineRenderer(ups)
    local = LocalTemplate.from_model_dir(model_dir)
    windowed = {
        "engine": WindowedRenderer(engine),
        "local": WindowedRenderer(CheckedRenderer(engine, local)),
    }
    system = {"role": "system", "content": "You are a coding agent. " * 400}
    rows = []
    try:
        for rounds in (2, 20, 100):
            messages = [system, {"role": "user", "content": "Build it."}]
            for k in range(rounds):
                call = {"id": f"c{k}", "type": "function",
                        "function": {"name": "run", "arguments": '{"cmd": "make"}'}}  # fmt: skip
                messages += [
                    {"role": "assistant", "content": f"step {k}", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": f"c{k}", "content": f"output {k}\n" * 20},
                ]
            body = {"model": MODEL, "messages": messages, "tools": TOOLS}
            upto = len(messages) - 1
            for w in windowed.values():  # learns the context: a whole render and the windows
                await w.around(upstream, body, upto)
            ms: dict[str, list[float]] = {k: [] for k in ("engine", "window", "local", "wlocal")}
            ms["keys"] = []
            answers = {}
            for _ in range(15):
                for name, renderer in (
                    ("engine", engine),
                    ("window", windowed["engine"]),
                    ("wlocal", windowed["local"]),
                ):
                    t0 = time.perf_counter()
                    answers[name] = await renderer.around(upstream, body, upto)
                    ms[name].append((time.perf_counter() - t0) * 1e3)
                t0 = time.perf_counter()
                answers["local"] = local.around(body, upto, "openai")
                t1 = time.perf_counter()
                RequestKeys(body)
                ms["local"].append((t1 - t0) * 1e3)
                ms["keys"].append((time.perf_counter() - t1) * 1e3)
            full = await engine.render(upstream, body)
            rows.append(
                {
                    "messages": len(messages),
                    "prompt_tokens": len(full),
                    **{f"{k}_ms_p50": float(np.median(v)) for k, v in ms.items()},
                    "same_ids": all(
                        a is not None and a.same_ids(answers["engine"]) for a in answers.values()
                    ),
                }
            )
    finally:
        await ups.close()
    return rows


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def run(print_fn=print) -> dict:
    upstream = os.environ.get("ROLLTAP_BENCH_UPSTREAM")
    with tempfile.TemporaryDirectory(prefix="rolltap-bench-continuation-") as tmp:
        tmp_dir = Path(tmp)
        vllm = None
        if upstream:
            model_dir = Path(os.environ["ROLLTAP_BENCH_MODEL_DIR"])
        else:
            from stack.serve_model import start_vllm
            from stack.tiny_model import write_tiny_model

            model_dir = write_tiny_model(tmp_dir / "tiny")
            vllm = start_vllm(
                model_dir, free_port(), served_model_name=MODEL, max_model_len=32768,
                kv_cache_gib=1, log_path=tmp_dir / "vllm.log",
            )  # fmt: skip
            print_fn(f"waiting for vLLM ({vllm.log_path}) ...")
            vllm.wait_ready(timeout=900)
            upstream = vllm.url
        datname = f"rolltap_bench_{uuid.uuid4().hex[:10]}"
        dsn = f"{POSTGRES_URL.rpartition('/')[0]}/{datname}"
        admin_sql(f'CREATE DATABASE "{datname}"')
        modes = {}
        try:
            print_fn(
                f"{CONVERSATIONS} conversations x {TURNS} turns per mode (forced strict tool "
                f"calls); {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
            )
            for name, extra in MODES:
                flags = tuple(a.format(model_dir=model_dir) for a in extra)
                log_path = tmp_dir / f"gateway-{len(modes)}.log"
                with _Gateway(upstream, dsn, flags, log_path) as gw:
                    results = [
                        _conversation(gw, f"You are agent {i} of {name}.")
                        for i in range(CONVERSATIONS)
                    ]
                modes[name] = _mode_numbers(results)
            costs = asyncio.run(_render_costs(upstream, model_dir))
        finally:
            admin_sql(f'DROP DATABASE IF EXISTS "{datname}" WITH (FORCE)')
            if vllm is not None:
                vllm.stop()

    lines = [
        f"{'mode':<22}{'continued turns':>18}{'seqs/conv':>11}{'drift forks':>13}"
        f"{'render p50 ms':>15}{'p90 ms':>9}  rendered by"
    ]
    for name, m in modes.items():
        lines.append(
            f"{name:<22}{m['continued_turns']:>8}/{m['turns']:<3} ({m['continued_fraction']:4.0%})"
            f"{m['sequences_per_conversation']:>11.2f}{m['drift_forks']:>13}"
            f"{_fmt(m['render_ms_p50']):>15}{_fmt(m['render_ms_p90']):>9}  "
            f"{json.dumps(m['rendered_by'])}"
        )
    lines.append("")
    lines.append(
        "one continuation rendered in-process, whole and windowed (p50 of 15; keys: the "
        "request's hashes)"
    )
    lines.append(
        f"{'messages':>9}{'tokens':>8}{'engine ms':>11}{'windowed':>10}{'local ms':>10}"
        f"{'windowed':>10}{'keys ms':>9}  same ids"
    )
    for c in costs:
        lines.append(
            f"{c['messages']:>9}{c['prompt_tokens']:>8}{c['engine_ms_p50']:>11.2f}"
            f"{c['window_ms_p50']:>10.2f}{c['local_ms_p50']:>10.2f}{c['wlocal_ms_p50']:>10.2f}"
            f"{c['keys_ms_p50']:>9.3f}  {c['same_ids']}"
        )
    print_fn("\n".join(lines))
    print_fn(f"load average at the end: {os.getloadavg()[0]:.1f}")
    exact_local = modes["exact, local render"]
    return {
        "modes": modes,
        "render_costs": costs,
        "targets": {
            "render_p50_ms_local": (exact_local["render_ms_p50"] or 0) <= TARGET_RENDER_P50_MS,
            "exact_continues_every_turn": all(
                m["continued_fraction"] == 1.0 for n, m in modes.items() if n != "render"
            ),
        },
    }


if __name__ == "__main__":
    run()
