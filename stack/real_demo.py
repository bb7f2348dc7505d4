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
import json
import os
import secrets
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from stack.launcher import (
    ROLLTAP,
    Processes,
    admin_client,
    free_port,
    run_once,
    serve_model,
    start_gateway,
    step,
    stop_embedded_postgres,
)
from stack.rollouts import finished, rollouts_command, task_ids

ROOT = Path(__file__).resolve().parents[1]
SMOL_TASKS = ROOT / "examples" / "smol-tasks" / "tasks.jsonl"
MODEL_NAME = "smol"
# The sandbox runner's `python` preset with the code-block agent.
HARNESS = ["--harness", "python", "--agent", "sandbox.agents.code_writer:run"]
NPM_BIN = ROOT / ".cache" / "npm" / "node_modules" / ".bin"


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


def _rollouts(ctx: dict, harness: list[str], run_id: str, tasks: list[str], *, group_size: int,
              concurrency: int) -> tuple[list, int]:
    """One run of `rolltap rollouts` to its end, its progress on the terminal, under a run id of
    ours; returns the finished rollouts and how many did not finish (the runner says why)."""
    state = ctx["dir"] / f"{run_id}.jsonl"
    run_once(rollouts_command(SMOL_TASKS, harness, gateway=ctx["gateway"], model=MODEL_NAME,
                              run_id=run_id, state=state, group_size=group_size,
                              concurrency=concurrency, tasks=tasks),
             env={"ROLLTAP_ADMIN_KEY": ctx["admin_key"]}, check=False)
    done = finished(state)
    return done, len(tasks) * group_size - len(done)


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


def evaluate(label: str, at_step: int, heldout: list[str], ctx: dict) -> Evaluation:
    started = time.monotonic()
    done, failed = _rollouts(ctx, HARNESS, f"{ctx['run']}-eval-{label}", heldout,
                             group_size=ctx["eval_samples"], concurrency=ctx["concurrency"])
    _check_alive(ctx)
    outcomes: dict[str, list[bool]] = {t: [] for t in heldout}
    crashed = 0
    for record in done:
        # A harness that crashed (an engine gone, a sandbox failure) says nothing about the
        # model: it is counted apart, not as a failed attempt.
        if record.sandbox_status == "ok":
            outcomes[record.task_id].append(passed(record.reward))
        else:
            crashed += 1
    if crashed or failed:
        print(f"   ({crashed} crashed and {failed} failed rollouts left out)", flush=True)
    ev = Evaluation(label, at_step, outcomes,
                    _versions(ctx["admin"], [r.rollout_id for r in done]),
                    time.monotonic() - started)
    print("   " + ev.line(), flush=True)
    print("   per task: " + ", ".join(f"{t} {sum(v)}/{len(v)}" for t, v in outcomes.items()),
          flush=True)
    return ev


# ---- the stages -----------------------------------------------------------------------------


def _train(args, ctx: dict, train, heldout, evaluations: list[Evaluation]) -> list[dict]:
    """The bridge trains while the runner plays training groups; held-out evaluations run at
    every `eval_every` steps. Returns the bridge's per-step progress entries."""
    workdir = ctx["dir"]
    run_id = f"{ctx['run']}-train"
    out_dir = workdir / "bridge"
    prompt_budget = 2048  # a sample is the prompt (~120 tokens) plus at most 300 sampled
    bridge = ctx["procs"].start(
        [*ROLLTAP, "bridge", "--model", str(ctx["model_dir"]), "--vllm", ctx["upstream"],
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
    player = ctx["procs"].start(
        rollouts_command(SMOL_TASKS, HARNESS, gateway=ctx["gateway"], model=MODEL_NAME,
                         run_id=run_id, state=workdir / f"{run_id}.jsonl",
                         group_size=args.group_size, concurrency=args.concurrency,
                         tasks=train, repeat=max(1, groups // len(train)),
                         max_backlog=args.max_backlog or 2 * args.group_size),
        workdir / f"{run_id}.log", env={"ROLLTAP_ADMIN_KEY": ctx["admin_key"]})
    progress, entries, next_eval = out_dir / "progress.jsonl", [], args.eval_every
    deadline = time.monotonic() + 60 * args.train_minutes if args.train_minutes else None
    stopped = False
    print(f"   bridge log {workdir / 'bridge.log'}, runner log {workdir / f'{run_id}.log'}; "
          f"{args.group_size} rollouts per group; "
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
    # The runner stops on SIGTERM: sandboxes in flight killed, their rollouts finished as failed.
    if player.poll() is None:  # it may have played every group it had already
        player.send_signal(signal.SIGTERM)
    player.wait(300)
    if bridge.returncode and not (stopped and bridge.returncode == 130):
        raise SystemExit(f"the bridge failed (exit {bridge.returncode}); see "
                         f"{workdir / 'bridge.log'}")
    return entries


def _pi(args, ctx: dict, tasks: list[str]) -> dict | None:
    """A few rollouts of the Pi CLI: the calls, sequences, continuation paths and fork causes
    the gateway recorded for each."""
    pi = shutil.which("pi", path=f"{NPM_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if pi is None:
        print("   Pi is not installed (npm i --prefix .cache/npm "
              "@mariozechner/pi-coding-agent@0.73.1); skipped", flush=True)
        return None
    harness = ["--harness", "pi", "--harness-bin", pi, "--context-window", "8192",
               "--max-output-tokens", "512"]
    done, failed = _rollouts(ctx, harness, f"{ctx['run']}-pi", tasks[: args.pi_rollouts],
                             group_size=1, concurrency=args.pi_rollouts)
    rows = []
    for record in done:
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
    return {"rollouts": rows, "failed": failed}


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
    if args.train_steps is None:
        args.train_steps = 16
    args.steps = args.train_steps

    workdir: Path = (args.dir / "smol").resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    procs = Processes()
    admin_key = secrets.token_urlsafe(16)
    t0 = time.monotonic()
    train, heldout = task_ids(SMOL_TASKS, "train"), task_ids(SMOL_TASKS, "heldout")
    evaluations: list[Evaluation] = []
    try:
        model_dir = workdir.parent / "smol-model"
        step(f"1/6 SmolLM2-135M-Instruct in {model_dir} (rolltap smol-model)")
        run_once([*ROLLTAP, "smol-model", str(model_dir)])

        vllm_port, gw_port = free_port(), free_port()
        upstream = f"http://127.0.0.1:{vllm_port}"
        step(f"2/6 vLLM (CPU build) on {upstream}; log {workdir / 'vllm.log'}")
        vllm = serve_model(procs, workdir / "vllm.log", model_dir, vllm_port, MODEL_NAME,
                           ("--max-model-len", "8192", "--kv-cache-gib", "1"), timeout=900)

        gateway = f"http://127.0.0.1:{gw_port}"
        step(f"3/6 gateway on {gateway} (temperature {args.temperature}; the agent's "
             "toolless calls are its rollouts, so they train)")
        gw = start_gateway(procs, workdir, upstream, gw_port, admin_key,
                           ("--temperature", str(args.temperature), "--train-auxiliary"),
                           timeout=300)
        admin = admin_client(gateway, admin_key)
        ctx = {"dir": workdir, "procs": procs, "admin_key": admin_key,
               "admin": admin, "gateway": gateway, "upstream": upstream,
               "model_dir": model_dir, "run": secrets.token_hex(3), "t0": t0,
               "vllm": vllm, "gw": gw, "eval_samples": args.eval_samples,
               "concurrency": args.concurrency}

        step(f"4/6 held-out pass@1 before training: {len(heldout)} tasks x "
              f"{args.eval_samples} rollouts")
        evaluations.append(evaluate("before", 0, heldout, ctx))

        step(f"5/6 training: {args.steps} AsyncGRPO steps on {len(train)} tasks, weights to "
              "vLLM after each")
        entries = _train(args, ctx, train, heldout, evaluations)
        evaluations.append(evaluate("after", entries[-1]["step"] if entries else 0, heldout,
                                    ctx))

        pi = None
        if args.pi_rollouts:
            step(f"6/6 the Pi harness CLI on {args.pi_rollouts} held-out task(s), multi-turn "
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
