"""`rolltap demo --model smol` (`make demo-real`): a real model learns real coding tasks on the CPU.

SmolLM2-135M-Instruct (built by `rolltap smol-model`) is served by vLLM's CPU build behind the
gateway. The sandbox runner plays the training tasks of examples/smol-tasks with the `python`
preset (sandbox.agents.code_writer: chat, take the code block, write the file); the hidden tests
score every rollout; `rolltap bridge` trains on the recorded tokens with AsyncGRPO and pushes the
weights back to vLLM after every step. Held-out pass@1 (a rollout passes when all its hidden tests
pass) is measured before, during and after training, with a bootstrap interval, and a real
harness CLI (Pi) plays a few tasks through the same gateway to show multi-turn recording.
Writes RUN_DIR/summary.json and RUN_DIR/curve.png (reward per step, held-out pass@1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from sandbox.demo import (
    _free_port,
    _Processes,
    _step,
    _wait_http,
    die_with_parent,
    stop_embedded_postgres,
)

SMOL_TASKS = Path(__file__).resolve().parents[1] / "examples" / "smol-tasks" / "tasks.jsonl"
MODEL_NAME = "smol"
AGENT = "sandbox.agents.code_writer:run"
NPM_BIN = Path(__file__).resolve().parents[1] / ".cache" / "npm" / "node_modules" / ".bin"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    real = parser.add_argument_group("--model smol (the real-model loop)")
    real.add_argument("--group-size", type=int, default=6,
                      help="rollouts per training group (default 6)")
    real.add_argument("--eval-samples", type=int, default=4,
                      help="rollouts per held-out task at each evaluation (default 4)")
    real.add_argument("--eval-every", type=int, default=8,
                      help="evaluate held-out pass@1 every N steps during training (default 8)")
    real.add_argument("--learning-rate", type=float, default=1e-5,
                      help="AdamW learning rate of the bridge (default 1e-5)")
    real.add_argument("--temperature", type=float, default=0.7,
                      help="sampling temperature of the policy, the gateway's and the "
                      "trainer's (default 0.7)")
    real.add_argument("--concurrency", type=int, default=6,
                      help="sandboxes at once (default 6)")
    real.add_argument("--pi-rollouts", type=int, default=2,
                      help="rollouts of the Pi harness CLI at the end (default 2; 0 skips)")
    real.add_argument("--max-backlog", type=int, default=None, metavar="N",
                      help="rollouts the runner may be ahead of training (default two groups: "
                      "one trained while the next plays)")
    real.add_argument("--seed", type=int, default=0, help="trainer seed (default 0)")
    real.add_argument("--train-minutes", type=float, default=None, metavar="M",
                      help="stop training after M minutes even if steps remain, then evaluate "
                      "(for machines slower than planned; default: no limit)")


# ---- pure helpers ---------------------------------------------------------------------------


def passed(reward: float | None) -> bool:
    return reward is not None and reward >= 1.0


def pass_at_1(outcomes: dict[str, list[bool]]) -> float:
    """Mean over tasks of each task's fraction of passing rollouts."""
    rates = [sum(v) / len(v) for v in outcomes.values() if v]
    return sum(rates) / len(rates) if rates else 0.0


def bootstrap(outcomes: dict[str, list[bool]], rounds: int = 2000, seed: int = 0):
    """pass@1 over `rounds` resamplings, each task's rollouts resampled with replacement."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tasks = [np.asarray(v, dtype=float) for v in outcomes.values() if v]
    draws = np.stack([t[rng.integers(0, len(t), (rounds, len(t)))].mean(axis=1) for t in tasks])
    return draws.mean(axis=0)


def interval(draws, level: float = 0.95) -> tuple[float, float]:
    import numpy as np

    lo, hi = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


@dataclass
class Evaluation:
    label: str
    step: int
    outcomes: dict[str, list[bool]]
    versions: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def line(self) -> str:
        lo, hi = interval(bootstrap(self.outcomes))
        return (f"held-out pass@1 {self.label:>7} (step {self.step:>3}): "
                f"{100 * pass_at_1(self.outcomes):5.1f}%  (95% bootstrap {100 * lo:.1f}–"
                f"{100 * hi:.1f}%; {sum(map(len, self.outcomes.values()))} rollouts, "
                f"policy versions {self.versions}, {self.seconds:.0f} s)")


# ---- rollouts through the runner ------------------------------------------------------------


def _harness(preset: str, **extra):
    from sandbox.presets import Harness, check_harness

    harness = Harness(preset=preset, model=MODEL_NAME, **extra)
    check_harness(harness)
    return harness


async def _rollouts(tasks, harness, gateway: str, admin_key: str, run_id: str, state: Path, *,
                    group_size: int, concurrency: int, repeat: int = 1, stop=None, quiet=False,
                    max_backlog: int | None = None):
    """Run rollouts with the sandbox runner under a run id of ours (so the bridge can select
    them by it); returns the runner's report."""
    from sandbox.backends.local import LocalBackend
    from sandbox.runner import run_rollouts
    from sandbox.state import RunHeader, StateFile

    StateFile(state).append(RunHeader(run_id=run_id, created=time.time()))

    def show(record, progress) -> None:
        if not quiet:
            print(f"   [{progress.done:>3}/{progress.total}] {record.task_id:<20} reward "
                  f"{record.reward if record.reward is not None else 'none':<5} "
                  f"{record.duration_s:5.0f} s", flush=True)

    return await run_rollouts(
        tasks, harness, gateway=gateway, admin_key=admin_key, group_size=group_size,
        backend=LocalBackend(), concurrency=concurrency, repeat=repeat, state_path=str(state),
        stop=stop, on_finished=show, max_backlog=max_backlog)


class _Player(threading.Thread):
    """Plays training groups with the runner in a thread of its own until `halt()`."""

    def __init__(self, **rollouts) -> None:
        super().__init__(daemon=True)
        self.rollouts = rollouts
        self.ready = threading.Event()

    def run(self) -> None:
        async def play():
            self.loop, self.stop = asyncio.get_running_loop(), asyncio.Event()
            self.ready.set()
            await _rollouts(**self.rollouts, stop=self.stop)

        asyncio.run(play())

    def halt(self) -> None:
        self.ready.wait()
        if self.is_alive():  # it may have played every group it had already
            self.loop.call_soon_threadsafe(self.stop.set)


def _versions(admin, rollout_ids: list[str]) -> list[int]:
    seen: set[int] = set()
    for rid in rollout_ids:
        calls = admin.get(f"/admin/rollouts/{rid}/calls?bodies=0").json()["calls"]
        seen.update(v for c in calls for v in c["versions"])
    return sorted(seen)


def _check_alive(ctx: dict) -> None:
    for name, proc in (("vLLM", ctx["vllm"]), ("the gateway", ctx["gw"])):
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited (code {proc.returncode}) during the run; see "
                             f"{ctx['dir']}; on a machine short of memory the kernel may have "
                             "killed it (dmesg)")


def evaluate(label: str, step: int, heldout, ctx: dict) -> Evaluation:
    started = time.monotonic()
    run_id = f"{ctx['run']}-eval-{label}"
    report = asyncio.run(_rollouts(
        heldout, ctx["harness"], ctx["gateway"], ctx["admin_key"], run_id,
        ctx["dir"] / f"{run_id}.jsonl", group_size=ctx["eval_samples"],
        concurrency=ctx["concurrency"]))
    _check_alive(ctx)
    outcomes: dict[str, list[bool]] = {t.id: [] for t in heldout}
    crashed = 0
    for record in report.finished:
        # A harness that crashed (an engine gone, a sandbox failure) says nothing about the
        # model: it is counted apart, not as a failed attempt.
        if record.sandbox_status == "ok":
            outcomes[record.task_id].append(passed(record.reward))
        else:
            crashed += 1
    if crashed or report.errors:
        print(f"   ({crashed} crashed and {len(report.errors)} failed rollouts left out)",
              flush=True)
    ev = Evaluation(label, step, outcomes,
                    _versions(ctx["admin"], [r.rollout_id for r in report.finished]),
                    time.monotonic() - started)
    print("   " + ev.line(), flush=True)
    print("   per task: " + ", ".join(f"{t} {sum(v)}/{len(v)}" for t, v in outcomes.items()),
          flush=True)
    return ev


# ---- the stages -----------------------------------------------------------------------------


def _train(args, ctx: dict, train, heldout, evaluations: list[Evaluation]) -> list[dict]:
    """The bridge trains while the runner plays training groups; held-out evaluations run at
    every `eval_every` steps. Returns the bridge's per-step progress entries."""
    workdir, rolltap = ctx["dir"], ctx["rolltap"]
    run_id = f"{ctx['run']}-train"
    out_dir = workdir / "bridge"
    prompt_budget = 2048  # a sample is the prompt (~120 tokens) plus at most 300 sampled
    bridge = ctx["procs"].start(
        [*rolltap, "bridge", "--model", str(ctx["model_dir"]), "--vllm", ctx["upstream"],
         "--gateway", ctx["gateway"], "--data-dir", str(workdir / "data"),
         "--num-generations", str(args.group_size), "--max-steps", str(args.steps),
         "--weight-sync", "disk", "--checkpoint-dir", str(out_dir / "checkpoints"),
         "--output-dir", str(out_dir), "--match", f"run_id={run_id}",
         "--learning-rate", str(args.learning_rate), "--token-budget", str(prompt_budget),
         "--max-staleness", "2", "--queue-size", str(2 * args.group_size),
         "--group-deadline", "900", "--set", f"temperature={args.temperature}",
         "--set", f"seed={args.seed}",
         "--threads", "2"],
        workdir / "bridge.log", env={"ROLLTAP_ADMIN_KEY": ctx["admin_key"]},
    )
    # Groups until the bridge is done: some are dropped (all rewards equal, or stale), so no
    # fixed number is enough; the backlog keeps the runner one group ahead, and `halt()` ends it.
    groups = args.steps * len(train) * 4
    player = _Player(tasks=train, harness=ctx["harness"], gateway=ctx["gateway"],
                     admin_key=ctx["admin_key"], run_id=run_id,
                     state=workdir / f"{run_id}.jsonl", group_size=args.group_size,
                     concurrency=args.concurrency, repeat=max(1, groups // len(train)),
                     quiet=True, max_backlog=args.max_backlog or 2 * args.group_size)
    player.start()
    progress, entries, next_eval = out_dir / "progress.jsonl", [], args.eval_every
    deadline = time.monotonic() + 60 * args.train_minutes if args.train_minutes else None
    stopped = False
    print(f"   bridge log {workdir / 'bridge.log'}; {args.group_size} rollouts per group; "
          f"{'step':>4} {'reward':>7} {'version':>7} {'elapsed':>8}", flush=True)
    while True:
        lines = progress.read_text().splitlines() if progress.exists() else []
        for line in lines[len(entries):]:
            entry = json.loads(line)
            entries.append(entry)
            print(f"   step {entry['step']:>4}/{args.steps}  reward "
                  f"{entry['reward'] if entry['reward'] is not None else float('nan'):6.3f}  "
                  f"version {entry['version']!s:>4}  {time.monotonic() - ctx['t0']:6.0f} s",
                  flush=True)
        if bridge.poll() is not None:
            break
        _check_alive(ctx)
        if deadline and time.monotonic() > deadline and not stopped:
            # The bridge stops cleanly on SIGTERM: leases released, engines resumed.
            print(f"   --train-minutes {args.train_minutes} reached after {len(entries)} "
                  "step(s): stopping the bridge", flush=True)
            bridge.send_signal(signal.SIGTERM)
            stopped = True
        if entries and entries[-1]["step"] >= next_eval and next_eval < args.steps:
            evaluations.append(evaluate(f"step{entries[-1]['step']}", entries[-1]["step"],
                                        heldout, ctx))
            next_eval += args.eval_every
        time.sleep(2)
    player.halt()
    player.join(300)
    if bridge.returncode and not (stopped and bridge.returncode == 130):
        raise SystemExit(f"the bridge failed (exit {bridge.returncode}); see "
                         f"{workdir / 'bridge.log'}")
    return entries


def _pi(args, ctx: dict, tasks) -> dict | None:
    """A few rollouts of the Pi CLI: the calls, sequences, continuation paths and fork causes
    the gateway recorded for each."""
    pi = shutil.which("pi", path=f"{NPM_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if pi is None:
        print("   Pi is not installed (npm i --prefix .cache/npm "
              "@mariozechner/pi-coding-agent@0.73.1); skipped", flush=True)
        return None
    harness = _harness("pi", executable=pi, context_window=8192, max_output_tokens=512)
    run_id = f"{ctx['run']}-pi"
    report = asyncio.run(_rollouts(
        tasks[: args.pi_rollouts], harness, ctx["gateway"], ctx["admin_key"], run_id,
        ctx["dir"] / f"{run_id}.jsonl", group_size=1, concurrency=args.pi_rollouts))
    rows = []
    for record in report.finished:
        info = ctx["admin"].get(f"/admin/rollouts/{record.rollout_id}").json()
        stats = (info.get("merge") or {}).get("stats") or {}
        rows.append({"task": record.task_id, "reward": record.reward,
                     "calls": stats.get("calls"), "sequences": stats.get("sequences"),
                     "causes": stats.get("causes"), "continuation": info.get("continuation"),
                     "prompt_tokens": record.prompt_tokens})
        print(f"   pi {record.task_id}: reward {record.reward}, calls {stats.get('calls')}, "
              f"sequences {stats.get('sequences')}, prompt tokens {record.prompt_tokens}, "
              f"continuation {info.get('continuation')}, forks {stats.get('causes')}",
              flush=True)
    return {"rollouts": rows, "errors": [e.message for e in report.errors]}


def plot(entries: list[dict], evaluations: list[Evaluation], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [e["step"] for e in entries if e["reward"] is not None]
    ax.plot(steps, [e["reward"] for e in entries if e["reward"] is not None], "o-",
            label="training reward (mean over the step's rollouts)")
    xs = [ev.step for ev in evaluations]
    ys = [pass_at_1(ev.outcomes) for ev in evaluations]
    bounds = [interval(bootstrap(ev.outcomes)) for ev in evaluations]
    ax.errorbar(xs, ys, yerr=[[y - lo for y, (lo, _) in zip(ys, bounds)],
                              [hi - y for y, (_, hi) in zip(ys, bounds)]],
                fmt="s--", capsize=4, label="held-out pass@1 (95% bootstrap)")
    ax.set_xlabel("optimizer step")
    ax.set_ylim(0, 1)
    ax.set_title("SmolLM2-135M-Instruct, GRPO through rolltap on a CPU")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_real(args: argparse.Namespace) -> int:
    import httpx

    if args.train_steps is None:
        args.train_steps = 16
    args.steps = args.train_steps

    from sandbox.tasks import load_tasks

    workdir: Path = (args.dir / "smol").resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    rolltap = [sys.executable, "-m", "gateway.cli"]
    procs = _Processes()
    admin_key = secrets.token_urlsafe(16)
    t0 = time.monotonic()
    tasks = load_tasks(SMOL_TASKS)
    train = [t for t in tasks if t.metadata.get("split") == "train"]
    heldout = [t for t in tasks if t.metadata.get("split") == "heldout"]
    evaluations: list[Evaluation] = []
    try:
        model_dir = workdir.parent / "smol-model"
        _step(f"1/6 SmolLM2-135M-Instruct in {model_dir} (rolltap smol-model)")
        subprocess.run([*rolltap, "smol-model", str(model_dir)], check=True,
                       preexec_fn=die_with_parent())

        vllm_port, gw_port = _free_port(), _free_port()
        upstream = f"http://127.0.0.1:{vllm_port}"
        _step(f"2/6 vLLM (CPU build) on {upstream}; log {workdir / 'vllm.log'}")
        vllm = procs.start([*rolltap, "serve-model", str(model_dir), "--port", str(vllm_port),
                            "--served-model-name", MODEL_NAME, "--max-model-len", "8192",
                            "--kv-cache-gib", "1"], workdir / "vllm.log")
        _wait_http(upstream + "/health", vllm, workdir / "vllm.log", "vLLM", 900)

        gateway = f"http://127.0.0.1:{gw_port}"
        _step(f"3/6 gateway on {gateway} (temperature {args.temperature}; the agent's "
              "toolless calls are its rollouts, so they train)")
        data = workdir / "data"
        gw = procs.start([*rolltap, "gateway", "--upstream", upstream, "--port", str(gw_port),
                          "--data-dir", str(data), "--temperature", str(args.temperature),
                          "--train-auxiliary"],
                         workdir / "gateway.log", env={"ROLLTAP_ADMIN_KEY": admin_key})
        _wait_http(gateway + "/healthz", gw, workdir / "gateway.log", "gateway", 300)
        admin = httpx.Client(base_url=gateway, timeout=60,
                             headers={"Authorization": f"Bearer {admin_key}"})
        ctx = {"dir": workdir, "rolltap": rolltap, "procs": procs, "admin_key": admin_key,
               "admin": admin, "gateway": gateway, "upstream": upstream,
               "model_dir": model_dir, "run": secrets.token_hex(3), "t0": t0,
               "vllm": vllm, "gw": gw,
               "harness": _harness("python", agent=AGENT), "eval_samples": args.eval_samples,
               "concurrency": args.concurrency}

        _step(f"4/6 held-out pass@1 before training: {len(heldout)} tasks x "
              f"{args.eval_samples} rollouts")
        evaluations.append(evaluate("before", 0, heldout, ctx))

        _step(f"5/6 training: {args.steps} AsyncGRPO steps on {len(train)} tasks, weights to "
              "vLLM after each")
        entries = _train(args, ctx, train, heldout, evaluations)
        evaluations.append(evaluate("after", entries[-1]["step"] if entries else 0, heldout,
                                    ctx))

        pi = None
        if args.pi_rollouts:
            _step(f"6/6 the Pi harness CLI on {args.pi_rollouts} held-out task(s), multi-turn "
                  "recording")
            pi = _pi(args, ctx, heldout)
    finally:
        procs.stop_all()
        stop_embedded_postgres(workdir / "data" / "pgdata")
    before, after = evaluations[0], evaluations[-1]
    diff = bootstrap(after.outcomes, seed=1) - bootstrap(before.outcomes, seed=2)
    lo, hi = interval(diff)
    plot(entries, evaluations, workdir / "curve.png")
    summary = {
        "elapsed_s": round(time.monotonic() - t0),
        "evaluations": [{"label": e.label, "step": e.step, "pass_at_1": pass_at_1(e.outcomes),
                         "interval": interval(bootstrap(e.outcomes)), "versions": e.versions,
                         "per_task": {t: [sum(v), len(v)] for t, v in e.outcomes.items()},
                         "seconds": round(e.seconds)} for e in evaluations],
        "change": {"points": 100 * (pass_at_1(after.outcomes) - pass_at_1(before.outcomes)),
                   "interval_points": [100 * lo, 100 * hi]},
        "steps": entries,
        "pi": pi,
        "settings": {k: v for k, v in vars(args).items() if k != "func" and
                     isinstance(v, int | float | str)},
    }
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print("\n" + "\n".join(e.line() for e in evaluations))
    print(f"change after - before: {summary['change']['points']:+.1f} points "
          f"(95% bootstrap {100 * lo:+.1f} to {100 * hi:+.1f}); wall time "
          f"{summary['elapsed_s'] / 60:.1f} min; plot {workdir / 'curve.png'}, summary "
          f"{workdir / 'summary.json'}")
    return 0
