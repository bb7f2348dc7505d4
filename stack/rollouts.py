"""The sandbox runner as the launchers drive it: `rolltap rollouts` in a child process, and the
finished rollouts read back from its state file (JSONL, one `"type": "rollout"` line each).

A process boundary, not an import: the bridge's package never imports the sandbox package, and
the launchers use the runner exactly as a user does."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from stack.launcher import ROLLTAP


@dataclass(frozen=True)
class Finished:
    """What a launcher reads of one finished rollout."""

    task_id: str
    rollout_id: str
    reward: float | None
    sandbox_status: str
    prompt_tokens: int | None


def task_ids(tasks_file: Path, split: str) -> list[str]:
    """The ids of the tasks in `tasks_file` whose `metadata.split` is `split`."""
    lines = tasks_file.read_text().splitlines()
    tasks = [json.loads(line) for line in lines if line.strip()]
    return [t["id"] for t in tasks if t.get("metadata", {}).get("split") == split]


def rollouts_command(tasks_file: Path, harness: list[str], *, gateway: str, model: str,
                     run_id: str, state: Path, group_size: int, concurrency: int,
                     tasks: list[str] = (), repeat: int = 1,
                     max_backlog: int | None = None) -> list[str]:
    """`rolltap rollouts` for `tasks` of `tasks_file` under our `run_id` (a bridge selects the
    run's rollouts by it); the admin key goes by `ROLLTAP_ADMIN_KEY` in the child's env."""
    command = [*ROLLTAP, "rollouts", str(tasks_file), *harness, "--gateway", gateway,
               "--model", model, "--run-id", run_id, "--state", str(state),
               "--group-size", str(group_size), "--concurrency", str(concurrency),
               "--repeat", str(repeat)]
    for task in tasks:
        command += ["--task", task]
    if max_backlog is not None:
        command += ["--max-backlog", str(max_backlog)]
    return command


def finished(state: Path) -> list[Finished]:
    """The finished rollouts a state file holds (none if it was never written)."""
    lines = state.read_text().splitlines() if state.exists() else []
    out = []
    for line in lines:
        try:
            item = json.loads(line)
        except ValueError:  # a line torn by a crash: its rollout was not finished
            continue
        if item.get("type") == "rollout":
            out.append(Finished(item["task_id"], item["rollout_id"], item["reward"],
                                item["sandbox_status"], item.get("prompt_tokens")))
    return out
