"""Runs the experiment's parts in order, each once: a part whose result file exists is skipped,
so rerunning the same command after a stop carries on where it stopped. Every result file
records the commit, the full configuration and the part's wall time; with `commit`, each is
committed to git as soon as it is written."""

from __future__ import annotations

import datetime
import json
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from stack.experiment import parts
from stack.experiment.parts import Config, Context

Part = Callable[[Context], dict[str, Any]]


def plan(seeds: list[int]) -> list[tuple[str, Part]]:
    """The parts in the order they run: screening, the positive control, the A/A, the first
    seed, the shuffled-reward control, the two-call agent, the other seeds."""
    steps: list[tuple[str, Part]] = [("screen", parts.screen), ("positive", parts.positive),
                                     ("aa", parts.aa)]
    for i, seed in enumerate(seeds):
        steps.append((f"train-{seed}", lambda ctx, s=seed: parts.train(ctx, s)))
        if i == 0:  # the controls right after the first seed, before the others
            steps.append((f"shuffled-{seed}",
                          lambda ctx, s=seed: parts.train(ctx, s, shuffle_rewards=True)))
            steps.append((f"agent-{seed}",
                          lambda ctx, s=seed: parts.train(ctx, s, two_calls=True)))
    return steps


CODE = Path(__file__).resolve().parents[2]  # the checkout this code runs from


def git_commit_id(repo: Path = CODE) -> str:
    """The commit of the code (a "-dirty" suffix when tracked files differ from it)."""
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                           capture_output=True, text=True).stdout.strip()
    return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"


def result_path(results: Path, name: str) -> Path:
    return results / f"{name}.json"


def load_done(results: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """The results already written, by part name."""
    return {n: json.loads(result_path(results, n).read_text()) for n in names
            if result_path(results, n).exists()}


def run(config: Config, steps: list[tuple[str, Part]], *, results: Path, workdir: Path,
        model_dir: Path, seeds: list[int], only: list[str] | None = None, commit: bool = False,
        log: Callable[[str], None] = print, after_part: Callable[[Context], None] | None = None
        ) -> dict[str, dict[str, Any]]:
    """Run every part of `steps` (`plan(seeds)`) not done yet (or only those named in `only`,
    in that order)."""
    results.mkdir(parents=True, exist_ok=True)
    done = load_done(results, [n for n, _ in steps])
    ctx = Context(config, workdir, results, model_dir, log, done)
    for name, part in steps:
        if name in ctx.done:
            log(f"== {name}: done ({ctx.done[name]['wall_s']:.0f} s), skipped")
            continue
        if only is not None and name not in only:
            continue
        log(f"== {name}: started {datetime.datetime.now().isoformat(timespec='seconds')}")
        # A part cut short left its database, runner state and checkpoints here: a rerun
        # starts the part afresh, or its old rollouts would join the new run's groups.
        shutil.rmtree(workdir / name, ignore_errors=True)
        started = time.monotonic()
        result = part(ctx)
        record = {"part": name, "commit": git_commit_id(),
                  "config": msgspec.to_builtins(config), "seeds": seeds,
                  "finished": datetime.datetime.now().isoformat(timespec="seconds"),
                  "wall_s": round(time.monotonic() - started, 1), "result": result}
        path = result_path(results, name)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(msgspec.to_builtins(record), indent=1) + "\n")
        tmp.replace(path)  # a part is done exactly when its whole file exists
        ctx.done[name] = record
        log(f"== {name}: finished in {record['wall_s'] / 60:.1f} min; {path}")
        if after_part is not None:
            after_part(ctx)
        if commit:
            _commit(results, name)
    return ctx.done


def _commit(results: Path, name: str) -> None:
    subprocess.run(["git", "add", "--", str(results)], cwd=results, check=True)
    subprocess.run(["git", "commit", "-q", "-m",
                    f"Learning experiment: results of part {name} (issue #37)", "--",
                    str(results)], cwd=results, check=False)
