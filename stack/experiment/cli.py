"""`rolltap experiment`: does a real model learn through rolltap? (`make learn`)

SmolLM2-135M-Instruct (`rolltap smol-model`) learns procedurally generated single-function
Python tasks (stack/experiment/templates.py) with GRPO through the whole loop: vLLM behind the
recording gateway, the code-writer agent in sandboxes, hidden pytest tests as the reward,
`rolltap bridge` training on the recorded tokens. The parts, in order:

  screen     base pass rate of every template; keeps those in --band
  positive   positive control: the same loop with a reply-length reward (must rise)
  aa         the base model evaluated twice (different seeds): calibrates the paired test and
             gives the minimum detectable effect at 80 % power
  train-N    training seed N: held-out pass@1 midway and after, paired against the base
  shuffled-N the first seed again with rewards shuffled within each group (must not move)
  agent-N    the first seed with the two-call agent (write, see what running it printed,
             revise): the merge and exact continuation in the loop

Each part writes RESULTS/PART.json (commit, configuration, wall time, numbers) when it
finishes; rerunning the same command skips finished parts, so a run spread over several
sittings carries on where it stopped (a part cut short restarts from its beginning). After
each part RESULTS gets a per-prompt before/after table (table-train-N.csv) and a plot
(learning.png). Evaluation samples vLLM directly with a fixed seed per (prompt, sample); see
stack/experiment/evaluation.py for why that seed can never reach a training rollout.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser("experiment", help="the learning experiment (make learn): does "
                              "SmolLM2-135M learn through rolltap, with controls and statistics",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=Path("experiments/learning"),
                   help="where the part results, tasks, tables and plot go (default %(default)s)")
    p.add_argument("--workdir", type=Path, default=Path("runs/learn"),
                   help="logs, databases and checkpoints (default %(default)s)")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="the model to train (default WORKDIR/smol-model, built by "
                   "`rolltap smol-model` when missing)")
    p.add_argument("--seeds", default="0,1,2", help="training seeds (default %(default)s)")
    p.add_argument("--only", default=None, metavar="PARTS",
                   help="run only these parts (comma-separated names), in plan order")
    p.add_argument("--heldout", type=Path, default=None, metavar="TASKS.jsonl",
                   help="evaluate on this task file instead of the generated held-out set "
                   "(each task needs metadata.func and metadata.cases)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run (default 20)")
    p.add_argument("--learning-rate", type=float, default=2e-5, help="default 2e-5")
    p.add_argument("--heldout-prompts", type=int, default=64, help="default 64")
    p.add_argument("--eval-samples", type=int, default=8, help="default 8")
    p.add_argument("--band", default="0.2,0.6",
                   help="kept templates' base pass-rate band (default %(default)s)")
    p.add_argument("--commit", action="store_true",
                   help="git-commit RESULTS after each part")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from stack.experiment import driver, report
    from stack.experiment.parts import Config
    from stack.launcher import ROLLTAP, run_once

    lo, hi = (float(x) for x in args.band.split(","))
    config = Config(steps=args.steps, learning_rate=args.learning_rate,
                    heldout_prompts=args.heldout_prompts, eval_samples=args.eval_samples,
                    band=(lo, hi),
                    heldout_file=str(args.heldout) if args.heldout else None)
    model_dir = args.model_dir or args.workdir / "smol-model"
    if not (model_dir / "model.safetensors").exists():
        run_once([*ROLLTAP, "smol-model", str(model_dir)])
    seeds = [int(s) for s in args.seeds.split(",")]
    driver.run(config, driver.plan(seeds), results=args.results.resolve(),
               workdir=args.workdir.resolve(), model_dir=model_dir.resolve(), seeds=seeds,
               only=args.only.split(",") if args.only else None, commit=args.commit,
               log=lambda line: print(line, flush=True),
               after_part=lambda ctx: report.write(ctx.done, ctx.results))
    return 0
