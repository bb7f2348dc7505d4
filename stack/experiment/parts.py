"""The parts of the experiment. Each takes the run's `Context` and returns its result as a
JSON-ready dict; the driver (driver.py) writes it, with the commit and the configuration, and
skips a part whose result exists.

- `screen`: every template's base pass rate (a few instances x samples); keeps the templates
  in the configured band and fixes the positive control's length target.
- `positive`: the training loop with the reply-length reward, which the model surely learns.
- `aa`: the base model evaluated twice on the held-out set with different seeds; its paired
  spread gives the design's minimum detectable effect. Its first arm is also every training
  seed's "before" (the same weights and seeds).
- `train-N`: training seed N on the real reward, evaluated midway and after.
- `shuffled-N`: the same with rewards permuted within each group (`rolltap bridge
  --shuffle-rewards`): the held-out change the loop makes without a real signal.
- `agent-N`: the real reward with the two-call agent (write, see what running the file
  printed, revise), so the gateway's merge and exact continuation are in the loop.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from stack.experiment import stats
from stack.experiment.evaluation import Evaluation, evaluate
from stack.experiment.servers import MODEL_NAME, Servers
from stack.experiment.tasks import generate, length_variant, prompts, read_tasks, write_tasks
from stack.experiment.templates import IN_DISTRIBUTION, OUT_OF_DISTRIBUTION
from stack.experiment.training import ONE_CALL, TWO_CALLS, TrainSettings, segment


class Config(msgspec.Struct, frozen=True):
    """Everything that decides the experiment's numbers (recorded with every part)."""

    seed: int = 0  # task generation
    screen_instances: int = 3
    screen_samples: int = 4
    band: tuple[float, float] = (0.2, 0.6)
    heldout_prompts: int = 64
    ood_per_template: int = 6
    train_per_template: int = 24
    eval_samples: int = 8
    temperature: float = 0.7
    group_size: int = 8
    groups_per_step: int = 4
    steps: int = 20
    learning_rate: float = 2e-5
    max_staleness: int = 2
    # Unique tokens per micro-batch (4 per step), the shared prompt counted once. Measured in
    # the positive control: at 800 a step took 17 samples; at 1600 (replies near the length
    # target, about 100 tokens) 54-57 samples in 9 groups, at least the 4 groups of 8 wanted.
    token_budget: int = 1600
    state_every: int = 5  # resumable checkpoints (optimizer state): must divide steps // 2
    concurrency: int = 8  # sandboxes of the training runner
    eval_concurrency: int = 16  # requests in flight to vLLM while evaluating
    threads: int = 2
    length_fraction: float = 0.5  # positive control target: this x the base median reply
    eval_seed: int = 1000  # seed base of the "before"/after arms; the A/A's second arm adds 1
    heldout_file: str | None = None  # a task file of one's own instead of the generated set


@dataclass
class Context:
    config: Config
    workdir: Path  # logs, databases, checkpoints (not committed)
    results: Path  # the JSON per part, tasks, table, plot (committed)
    model_dir: Path
    log: Callable[[str], None]
    done: dict[str, dict[str, Any]]  # results of the parts finished so far


def _servers(ctx: Context, part: str, gateway: bool = False) -> Servers:
    return Servers(ctx.workdir / part, ctx.model_dir, ctx.config.temperature, gateway=gateway)


def _eval(ctx: Context, servers: Servers, label: str, tasks: list[dict[str, Any]], samples: int,
          seed_base: int) -> Evaluation:
    ctx.log(f"   evaluating {label}: {len(tasks)} prompts x {samples} samples")
    ev = evaluate(label, tasks, upstream=servers.upstream, model=MODEL_NAME, samples=samples,
                  seed_base=seed_base, temperature=ctx.config.temperature,
                  concurrency=ctx.config.eval_concurrency, log=ctx.log)
    inside = ev.outcomes()
    ctx.log(f"   {label}: pass@1 {_mean_rate(inside):.3f} over {len(inside)} prompts, "
            f"verdicts {ev.verdicts()}, {ev.seconds:.0f} s")
    return ev


def _mean_rate(outcomes: dict[str, list[bool]]) -> float:
    rates = [stats.rate(v) for v in outcomes.values() if v]
    return sum(rates) / len(rates) if rates else float("nan")


def screen(ctx: Context) -> dict[str, Any]:
    c = ctx.config
    tasks = generate(c.seed, "screen", [*IN_DISTRIBUTION, *OUT_OF_DISTRIBUTION],
                     c.screen_instances)
    with _servers(ctx, "screen") as servers:
        ev = _eval(ctx, servers, "screen", tasks, c.screen_samples, c.eval_seed + 7)
    per_template: dict[str, dict[str, Any]] = {}
    for task in tasks:
        row = per_template.setdefault(task["metadata"]["template"], {"passed": 0, "samples": 0})
        ss = ev.samples[task["id"]]
        row["passed"] += sum(s.verdict == "pass" for s in ss)
        row["samples"] += len(ss)
    for row in per_template.values():
        row["rate"] = row["passed"] / row["samples"]
    lo, hi = c.band
    kept = [t for t in IN_DISTRIBUTION if lo <= per_template[t]["rate"] <= hi]
    chars = sorted(s.chars for ss in ev.samples.values() for s in ss)
    median = chars[len(chars) // 2]
    ctx.log(f"   kept {len(kept)} of {len(IN_DISTRIBUTION)} templates in [{lo}, {hi}]: "
            f"{', '.join(kept)}; median reply {median} chars")
    return {"per_template": per_template, "kept": kept, "band": [lo, hi],
            "median_reply_chars": median, "length_target": round(c.length_fraction * median),
            "verdicts": ev.verdicts(), "evaluation_s": ev.seconds,
            "startup_s": servers.startup_s}


def task_sets(ctx: Context) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training tasks, held-out tasks) of the run: generated from the kept templates (or the
    held-out file of the configuration), written under results/tasks."""
    c = ctx.config
    kept = ctx.done["screen"]["result"]["kept"]
    if not kept:
        raise SystemExit("no template's base pass rate is in the band: widen --band")
    per = -(-c.heldout_prompts // len(kept))
    if c.heldout_file:
        heldout = read_tasks(Path(c.heldout_file))
    else:
        heldout = generate(c.seed, "heldout", kept, per) + generate(
            c.seed, "heldout", list(OUT_OF_DISTRIBUTION), c.ood_per_template, ood=True)
    train = generate(c.seed, "train", kept, c.train_per_template, exclude=prompts(heldout))
    random.Random(c.seed).shuffle(train)  # the runner plays in file order: mix the templates
    write_tasks(ctx.results / "tasks" / "train.jsonl", train)
    write_tasks(ctx.results / "tasks" / "heldout.jsonl", heldout)
    return train, heldout


def _settings(ctx: Context, seed: int, shuffle_rewards: bool = False,
              agent: str = ONE_CALL) -> TrainSettings:
    c = ctx.config
    return TrainSettings(c.group_size, c.groups_per_step, c.learning_rate, c.temperature,
                         c.max_staleness, seed, c.concurrency, c.threads, c.token_budget,
                         shuffle_rewards, agent)


def _step_summary(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per step: reward, agreement and where the time went (TRL's perf metrics)."""
    keep = ("agreement/", "perf/", "batch/", "rollout/", "kl", "ratio", "reward")
    return [{"step": e["step"], "reward": e["reward"], "version": e["version"],
             "elapsed_s": e["elapsed_s"],
             "metrics": {k: v for k, v in e.get("metrics", {}).items() if k.startswith(keep)}}
            for e in entries]


def positive(ctx: Context) -> dict[str, Any]:
    c = ctx.config
    train, _ = task_sets(ctx)
    target = ctx.done["screen"]["result"]["length_target"]
    control = write_tasks(ctx.workdir / "positive" / "tasks.jsonl",
                          [length_variant(t, target) for t in train])
    with _servers(ctx, "positive", gateway=True) as servers:
        entries = segment(servers, _settings(ctx, 0), control, len(train),
                          out=ctx.workdir / "positive" / "bridge", run_id="r-positive",
                          until=c.steps, resume=False, state_every=c.state_every,
                          log=ctx.log)
    return {"reward": "reply length target", "length_target": target,
            "steps": _step_summary(entries), "startup_s": servers.startup_s}


def aa(ctx: Context) -> dict[str, Any]:
    c = ctx.config
    _, heldout = task_sets(ctx)
    with _servers(ctx, "aa") as servers:
        first = _eval(ctx, servers, "A", heldout, c.eval_samples, c.eval_seed)
        second = _eval(ctx, servers, "A'", heldout, c.eval_samples, c.eval_seed + 1)
    diffs = list(stats.paired_differences(first.outcomes(), second.outcomes()).values())
    out = {"comparison": stats.summary(first.outcomes(), second.outcomes()),
           "mde_80": stats.mde(diffs), "startup_s": servers.startup_s,
           "arms": [msgspec.to_builtins(first), msgspec.to_builtins(second)]}
    ctx.log(f"   A/A: effect {out['comparison']['effect']:+.3f}, minimum detectable effect "
            f"(80% power) {out['mde_80']:.3f}")
    return out


def train(ctx: Context, seed: int, shuffle_rewards: bool = False,
          two_calls: bool = False) -> dict[str, Any]:
    """Training seed `seed` (with `shuffle_rewards`: the shuffled-reward control; with
    `two_calls`: rollouts of the two-call agent, whose second call continues the first)."""
    c = ctx.config
    train_tasks, heldout = task_sets(ctx)
    before = msgspec.convert(ctx.done["aa"]["result"]["arms"][0], Evaluation)
    name = f"{'shuffled' if shuffle_rewards else 'agent' if two_calls else 'train'}-{seed}"
    agent = TWO_CALLS if two_calls else ONE_CALL
    tasks_file = ctx.results / "tasks" / "train.jsonl"
    out = ctx.workdir / name / "bridge"
    evaluations, steps = [before], []
    mid = c.steps // 2
    if mid % c.state_every:
        raise SystemExit(f"state_every {c.state_every} must divide the midpoint step {mid}")
    with _servers(ctx, name, gateway=True) as servers:
        for label, until, resume in ((f"step{mid}", mid, False), ("after", c.steps, True)):
            entries = segment(servers, _settings(ctx, seed, shuffle_rewards, agent), tasks_file,
                              len(train_tasks),
                              out=out, run_id=f"r-{name}-{until}", until=until,
                              resume=resume, state_every=c.state_every, log=ctx.log)
            steps += _step_summary(entries)
            evaluations.append(_eval(ctx, servers, label, heldout, c.eval_samples,
                                     c.eval_seed))
    result = {"seed": seed, "shuffle_rewards": shuffle_rewards, "agent": agent, "steps": steps,
              "startup_s": servers.startup_s,
              "evaluations": [msgspec.to_builtins(e) for e in evaluations[1:]],
              "before": "aa arm A (same weights and seeds)"}
    for ev in evaluations[1:]:
        result[f"vs_before_{ev.label}"] = stats.summary(before.outcomes(), ev.outcomes())
        result[f"structural_vs_before_{ev.label}"] = stats.summary(before.structural(),
                                                                   ev.structural())
        if before.ood:
            result[f"ood_vs_before_{ev.label}"] = stats.summary(before.outcomes(ood=True),
                                                                ev.outcomes(ood=True))
    return result
