"""Resuming a crashed bridge: checkpoints that hold the trainer's state and the history of the
delivery log they contain, so the log and the weights agree.

Durability order of one step (the trainer's callbacks run it in this order):
1. `optimizer.step()`;
2. the step's deliveries are committed to the delivery log (`deliveries.acknowledge`, under the
   bridge's owner name and the step number);
3. the push writes checkpoint `policy-N` beside its final name and renames it into place. With
   the weights it holds the optimizer and scheduler (every `state_every` steps: a resumable
   checkpoint) and `rolltap-history.json`: for every bridge whose steps it contains, the last
   one (`trained_through`);
4. the engines reload it, the new version is announced, the engines resume.

A crash before 2 leaves nothing logged (the leases run out and the rollouts are claimed again).
A crash between 2 and the next resumable checkpoint leaves steps in the log that no resumable
checkpoint holds: resuming from the newest resumable checkpoint deletes the log rows of every
step after its `trained_through` and puts their rollouts back in the queue, so each rollout is
in the resumed weights' history exactly once. A crash costs the training since that checkpoint
(at most `state_every` steps), which is done again.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from uuid import UUID

import asyncpg

from trainer_bridge import deliveries
from trainer_bridge.checkpoints import checkpoint_index

HISTORY_FILE = "rolltap-history.json"
TRAINER_STATE_FILE = "trainer_state.json"  # HF Trainer's name: its resume reads it


def read_history(checkpoint: Path) -> dict[str, int]:
    """`trained_through` of a checkpoint: bridge (lease owner) -> its last step in it."""
    data = json.loads((Path(checkpoint) / HISTORY_FILE).read_text())
    return {owner: int(step) for owner, step in data["trained_through"].items()}


def resumable(checkpoint: Path) -> bool:
    """A checkpoint holds the trainer's state and its delivery history: a bridge can resume
    from it. Only complete ones have a final name (`write_checkpoint` renames into place)."""
    return (checkpoint / HISTORY_FILE).is_file() and (checkpoint / TRAINER_STATE_FILE).is_file()


def newest_resumable(checkpoint_dir: Path) -> Path | None:
    if not Path(checkpoint_dir).is_dir():
        return None
    found = [p for p in Path(checkpoint_dir).iterdir() if checkpoint_index(p) and resumable(p)]
    return max(found, key=lambda p: checkpoint_index(p) or 0, default=None)


def revert_to(database_url: str, history: dict[str, int]) -> list[UUID]:
    """Put back in the queue what steps after `history` logged (`deliveries.revert_steps_after`)."""

    async def run() -> list[UUID]:
        conn = await asyncpg.connect(database_url)
        try:
            return await deliveries.revert_steps_after(conn, history)
        finally:
            await conn.close()

    return asyncio.run(run())


def history_after(history: dict[str, int], owner: str, step: int) -> dict[str, int]:
    """The history of a checkpoint written by `owner` at `step`, on top of the one it resumed
    from."""
    return {**history, owner: step}


class StateWriter:
    """`DiskWeightSync.add_state` for one trainer: writes the history into every checkpoint, and
    the optimizer, scheduler and trainer state (HF Trainer's files, which its
    `resume_from_checkpoint` loads) into every `every`th step's."""

    def __init__(self, trainer, owner: str, history: dict[str, int], every: int) -> None:
        self.trainer, self.owner, self.history, self.every = trainer, owner, history, every

    def __call__(self, directory: Path) -> None:
        step = self.trainer.state.global_step
        history = history_after(self.history, self.owner, step)
        if step % self.every == 0:
            self.trainer._save_optimizer_and_scheduler(str(directory))
            self.trainer.state.save_to_json(str(directory / TRAINER_STATE_FILE))
        # Last: the history says what the checkpoint holds once everything else is in it.
        (directory / HISTORY_FILE).write_text(
            json.dumps({"step": step, "trained_through": history}, indent=2) + "\n")
