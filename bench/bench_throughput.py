"""Throughput under a long tail (issue #42): a real `rolltap bridge` training the tiny model on
rollouts of a scripted two-call agent whose engine answers each call after a lognormal delay
(median LATENCY_MEDIAN_S, sigma 1: the 99th percentile about 10x the median), with slow
verifiers too, G = 8 and at least 64 rollouts at once. Two runs side by side, the same seed:

- plain: every phase in one concurrency limit, each group waits for its slowest member;
- oversample + pools: G + OVERSAMPLE members per group, the fastest G train, stragglers aborted;
  setup, agent and verifier phases in pools of their own (the same agent slots as plain's
  concurrency, more sandboxes in all so verifiers never hold an agent's place).

Both keep a tight --max-backlog, in the members each starts per group: plain the agent slots
plus one group, oversampling one group fewer than the agent slots. Oversampling keeps its
trainer busier, so its samples wait longer for the trainer, counted in versions; at the same
backlog as plain (9 groups) its staleness was 1.83 against plain's 1.40 (measured).

The trainer is sized to the fleet, as a real one is: TRAINER_LAYERS deepens the tiny model and
COMPLETION_TOKENS lengthens each sample so that training a sample costs about what the plain
setup's rollouts leave the trainer time for: 44 layers and 128-token replies took 0.35-0.46 s a
sample on one core (a step of 44 samples in 15-20 s), the plain setup's trainer about half busy
once its first groups are in. At 80 layers the plain setup's trainer was the bottleneck. The
2-layer tiny model on 16-token replies trains a sample in milliseconds: with it the trainer
idled whatever the runner did (95 % in both setups, measured), and a fleet whose trainer never
waits for it has no throughput to gain. The engine's latency is long enough that
the runner's own CPU (an agent and a verifier process per rollout on two cores) is not what
bounds a setup: at a 2 s median it was, and oversampling gained nothing.

For each: samples trained per minute (the bridge's trained samples over its wall time), the
trainer's idle fraction (blocked waiting for samples), staleness (policy versions between
sampling and training, per sample, TRL's metric), the engine's busy fraction is not measured
(the stand-in has no /metrics) but the pools' queue waits are. The machine's load is printed:
the numbers move with it.

The engine is bench/standin.py's (recorded tiny-model replies, prompts rendered by its
template with ids inside the tiny vocabulary), so the tokens are real enough to train on and
cost no engine CPU; the sandboxes are unconfined (--isolation none) to spend the 2 cores on
the bridge and the runner rather than on namespaces.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import msgspec

from bench import standin
from bench.bench_gateway import ADMIN_KEY, POSTGRES_URL, Gateway, admin_sql, free_port
from sandbox.backends.local import LocalBackend
from sandbox.continuous import TaskSampler
from sandbox.pools import PhasePools, stats_line
from sandbox.presets import Harness
from sandbox.runner import run_rollouts
from sandbox.tasks import Task, Timeouts, Verifier
from stack.tiny_model import write_tiny_model
from trainer_bridge.config import match_arg

REPO = Path(__file__).resolve().parents[1]
GROUP = 8
AGENT_SLOTS = 64  # rollouts talking to the engine at once, in both runs
OVERSAMPLE = 3
STEPS = int(os.environ.get("ROLLTAP_BENCH_THROUGHPUT_STEPS", "8"))
GROUPS_PER_STEP = 4
LATENCY_MEDIAN_S = float(os.environ.get("ROLLTAP_BENCH_THROUGHPUT_LATENCY", "8.0"))
TRAINER_LAYERS = int(os.environ.get("ROLLTAP_BENCH_THROUGHPUT_LAYERS", "44"))
LATENCY_SIGMA = 1.0
# Tokens each call samples: the trainer's work per sample (the stand-in's cost is the same).
COMPLETION_TOKENS = int(os.environ.get("ROLLTAP_BENCH_THROUGHPUT_COMPLETION", "128"))
TASKS = 16
VOCAB = 2048  # the tiny model's

# Two calls, the second carrying the first; passes (writes out.txt) half the time.
AGENT = f'''COMPLETION_TOKENS = {COMPLETION_TOKENS}
''' + '''
import json, pathlib, random, urllib.request

def agent(*, prompt, base_url, api_key, model, workdir):
    messages = [{"role": "user", "content": prompt}]
    for turn in range(2):
        body = json.dumps({"model": model, "messages": messages,
                           "max_tokens": COMPLETION_TOKENS}).encode()
        req = urllib.request.Request(base_url + "/chat/completions", data=body, headers={
            "Authorization": "Bearer " + api_key, "Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(req, timeout=600).read())
        messages.append({"role": "assistant",
                         "content": reply["choices"][0]["message"]["content"]})
        messages.append({"role": "user", "content": f"step {turn}: go on"})
    if random.random() < 0.5:
        pathlib.Path(workdir, "out.txt").write_text("ok")
'''
# The verifier's own long tail: a lognormal pause (median 0.5 s), then the check.
VERIFY = b'''
import os, random, sys, time
time.sleep(min(30.0, random.lognormvariate(-0.7, 1.0)))
sys.exit(0 if os.path.exists("out.txt") else 1)
'''


class Setup(msgspec.Struct, frozen=True):
    name: str
    concurrency: int
    oversample: int
    pools: tuple[int, int, int] | None  # setup, agent, verify slots
    # --max-backlog: rollouts in flight plus those waiting for the trainer; tight, to keep the
    # samples fresh.
    backlog: int


SETUPS = (
    Setup("plain", AGENT_SLOTS, 0, None, AGENT_SLOTS + GROUP),
    Setup("oversample+pools", AGENT_SLOTS + 32, OVERSAMPLE, (16, AGENT_SLOTS, 32),
          (AGENT_SLOTS - GROUP) * (GROUP + OVERSAMPLE) // GROUP),
)


def _tasks() -> list[Task]:
    verifier = Verifier("python3 verify.py", "binary", {"verify.py": VERIFY})
    return [Task(id=f"t{i:02d}", prompt=f"Task {i}: make the tests pass.", files={},
                 verifier=verifier, timeouts=Timeouts(agent_s=300, verifier_s=60))
            for i in range(TASKS)]


def _version(gateway: str) -> int:
    req = urllib.request.Request(gateway + "/admin/policy",
                                 headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["version"]


def _bridge(model: Path, engine: str, gateway: str, dsn: str, run_id: str,
            out: Path) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "trainer_bridge.cli", "bridge", "--model", str(model),
        "--vllm", engine, "--gateway", gateway, "--admin-key", ADMIN_KEY, "--database-url", dsn,
        "--num-generations", str(GROUP), "--max-steps", str(STEPS), "--threads", "1",
        # A micro-batch of about a group's own tokens (its prompt packed once), a step of
        # GROUPS_PER_STEP of them: a step trains about that many groups, as a real run's does.
        "--token-budget", str(GROUP * (2 * COMPLETION_TOKENS + 64) + 512),
        "--set", f"gradient_accumulation_steps={GROUPS_PER_STEP}",
        "--queue-size", str(2 * GROUP * GROUPS_PER_STEP), "--group-deadline", "120",
        "--match", match_arg("run_id", run_id), "--output-dir", str(out),
        "--keep-checkpoints", "1",
    ]
    log = open(out.parent / f"{out.name}.log", "wb")  # noqa: SIM115 - the process holds it
    return subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


async def _rollouts(setup: Setup, gateway: str, run_id: str, harness: Harness, root: Path):
    pools = PhasePools(*setup.pools) if setup.pools else PhasePools()
    backend = LocalBackend(root=str(root), isolation="none", use_cgroup=False, pools=pools)
    sampler = TaskSampler(_tasks(), GROUP, seed=0)
    report = await run_rollouts(
        [], harness, gateway=gateway, admin_key=ADMIN_KEY, group_size=GROUP, backend=backend,
        concurrency=setup.concurrency, run_id=run_id, oversample=setup.oversample,
        max_backlog=setup.backlog, sampler=sampler, until_steps=STEPS,
        deadline_s=1800)
    return report, pools


def _measure(setup: Setup, model: Path, engine: str, gateway: str, dsn: str, harness: Harness,
             work: Path, print_fn) -> dict:
    run_id = f"bench-{setup.name}-{uuid.uuid4().hex[:6]}"
    out = work / setup.name.replace("+", "_")
    base = _version(gateway)
    bridge = _bridge(model, engine, gateway, dsn, run_id, out)
    try:
        deadline = time.monotonic() + 600
        while _version(gateway) <= base:  # the bridge's first push: it is ready to train
            if bridge.poll() is not None or time.monotonic() > deadline:
                tail = (out.parent / f"{out.name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the bridge did not start:\n{tail}")
            time.sleep(0.5)
        load = os.getloadavg()[0]
        report, pools = asyncio.run(_rollouts(setup, gateway, run_id, harness, work / "sb"))
        bridge.wait(timeout=600)
    finally:
        if bridge.poll() is None:
            bridge.kill()
            bridge.wait()
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(x) for x in (out / "progress.jsonl").read_text().splitlines()]
    staleness = [s["metrics"].get("sample/staleness_mean") for s in steps]
    staleness = [x for x in staleness if x is not None]
    trained = summary["source"].get("trained_samples", 0)
    wall_s = steps[-1]["elapsed_s"] if steps else summary["elapsed_s"]
    print_fn(f"  {setup.name}: {stats_line(pools.stats())}")
    print_fn(f"  {setup.name}: {len(report.finished)} rollouts ended ({report.aborted} "
             f"aborted, {report.unneeded} extra never started), load {load:.1f} at start, "
             f"{os.getloadavg()[0]:.1f} at end")
    return {
        "setup": setup.name,
        "steps": summary["steps"],
        "samples_per_min": 60.0 * trained / wall_s if wall_s else 0.0,
        "idle": summary.get("trainer_idle_fraction"),
        "staleness": sum(staleness) / len(staleness) if staleness else None,
        "wall_s": wall_s,
    }


def _table(rows: list[dict]) -> list[str]:
    lines = [f"{'setup':<18}{'steps':>6}{'samples/min':>13}{'trainer idle':>14}"
             f"{'staleness':>11}{'wall s':>8}"]
    for r in rows:
        idle = "-" if r["idle"] is None else f"{r['idle']:.0%}"
        stale = "-" if r["staleness"] is None else f"{r['staleness']:.2f}"
        lines.append(f"{r['setup']:<18}{r['steps']:>6}{r['samples_per_min']:>13.1f}{idle:>14}"
                     f"{stale:>11}{r['wall_s']:>8.0f}")
    return lines


def run(print_fn=print) -> list[dict]:
    datname = f"rolltap_bench_tp_{uuid.uuid4().hex[:8]}"
    admin_sql(f"CREATE DATABASE {datname}")
    dsn = f"{POSTGRES_URL.rpartition('/')[0]}/{datname}"
    port = free_port()
    engine_url = f"http://127.0.0.1:{port}"
    engine = standin.start(port, argv=[
        "-m", "bench.standin", "--port", str(port), "--prompt-tokens", "64",
        "--completion-tokens", str(COMPLETION_TOKENS), "--template", "--vocab", str(VOCAB),
        "--latency-median", str(LATENCY_MEDIAN_S), "--latency-sigma", str(LATENCY_SIGMA),
        "--vary"])
    gateway = None
    rows: list[dict] = []
    try:
        with tempfile.TemporaryDirectory(prefix="rolltap-bench-throughput-") as tmp:
            work = Path(tmp)
            gateway = Gateway(engine_url, dsn, work / "gateway.log").start()
            model = write_tiny_model(work / "tiny", seed=0, tied=False, layers=TRAINER_LAYERS)
            agents = work / "agents"
            agents.mkdir()
            (agents / "bench_agent.py").write_text(AGENT)
            harness = Harness(preset="python", model="tiny", agent="bench_agent:agent",
                              pythonpath=(str(agents),))
            print_fn(f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; G={GROUP}, "
                     f"{AGENT_SLOTS} agent slots, {STEPS} steps per setup, engine latency "
                     f"lognormal (median {LATENCY_MEDIAN_S} s, sigma {LATENCY_SIGMA}), "
                     f"{COMPLETION_TOKENS} tokens a call, a {TRAINER_LAYERS}-layer trainer")
            for setup in SETUPS:
                rows.append(_measure(setup, model, engine_url, gateway.url, dsn, harness, work,
                                     print_fn))
    finally:
        if gateway is not None:
            gateway.stop()
        engine.terminate()
        engine.wait()
        admin_sql(f"DROP DATABASE IF EXISTS {datname} WITH (FORCE)")
    for line in _table(rows):
        print_fn(line)
    if len(rows) == 2 and rows[0]["idle"] and rows[1]["idle"] is not None:
        plain, fast = rows
        print_fn(f"oversample+pools vs plain: samples/min x"
                 f"{fast['samples_per_min'] / max(plain['samples_per_min'], 1e-9):.2f}, trainer "
                 f"idle /{plain['idle'] / max(fast['idle'], 1e-9):.2f} (goal: x1.5 and /2)")
    return rows


if __name__ == "__main__":
    run()
