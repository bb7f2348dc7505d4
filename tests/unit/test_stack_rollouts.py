"""The whole-stack launchers drive the sandbox runner through `rolltap rollouts` and read its
state file back (stack/rollouts.py): the command they build is one the runner's
parser accepts, and what they read is what the runner writes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sandbox.cli import register
from sandbox.state import FinishedRollout, RunHeader, StateFile
from stack.real_demo import SMOL_TASKS
from stack.rollouts import Finished, finished, rollouts_command, task_ids


def _parsed(command: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rolltap")
    register(parser.add_subparsers(dest="subcommand"))
    assert command[1:3] == ["-m", "core.cli"]
    return parser.parse_args(command[3:])


def test_the_launchers_command_is_one_the_runner_accepts(tmp_path):
    command = rollouts_command(
        SMOL_TASKS, ["--harness", "python", "--agent", "sandbox.agents.code_writer:run"],
        gateway="http://127.0.0.1:9", model="smol", run_id="r1", state=tmp_path / "s.jsonl",
        group_size=3, concurrency=2, tasks=["add", "gcd"], repeat=4, max_backlog=6)
    args = _parsed(command)
    assert (args.subcommand, args.tasks, args.harness, args.agent) == (
        "rollouts", str(SMOL_TASKS), "python", "sandbox.agents.code_writer:run")
    assert (args.gateway, args.model, args.run_id, args.state) == (
        "http://127.0.0.1:9", "smol", "r1", str(tmp_path / "s.jsonl"))
    assert (args.group_size, args.concurrency, args.repeat, args.max_backlog) == (3, 2, 4, 6)
    assert args.task_ids == ["add", "gcd"]
    assert _parsed(rollouts_command(SMOL_TASKS, [], gateway="g", model="m", run_id="r",
                                    state=Path("s"), group_size=1,
                                    concurrency=1)).max_backlog is None


def test_the_launcher_reads_what_the_runner_writes(tmp_path):
    state = tmp_path / "state.jsonl"
    assert finished(state) == []
    writer = StateFile(state)
    writer.append(RunHeader(run_id="r1", created=1.0))
    writer.append(FinishedRollout(
        task_id="add", repeat=0, member=1, rollout_id="ro-1", group_id="g", status="finished",
        sandbox_status="ok", reward=1.0, reward_detail="", duration_s=2.0, prompt_tokens=120))
    writer.append(FinishedRollout(
        task_id="gcd", repeat=0, member=0, rollout_id="ro-2", group_id="g", status="failed",
        sandbox_status="crashed", reward=None, reward_detail="", duration_s=2.0))
    with open(state, "a") as torn:  # a crash mid-line: that rollout is not finished
        torn.write('{"type": "rollout", "task_id"')
    assert finished(state) == [Finished("add", "ro-1", 1.0, "ok", 120),
                               Finished("gcd", "ro-2", None, "crashed", None)]


def test_task_ids_of_a_split_follow_the_task_file():
    tasks = [json.loads(line) for line in SMOL_TASKS.read_text().splitlines() if line.strip()]
    for split in ("train", "heldout"):
        ids = task_ids(SMOL_TASKS, split)
        assert ids and ids == [t["id"] for t in tasks if t["metadata"]["split"] == split]
