"""Stopping a bridge (SIGTERM, Ctrl-C) without leaving a step logged that no checkpoint holds.

From the moment a step's samples go into the delivery log (right after `optimizer.step()`) to
the end of its push (which writes its checkpoint), a stop waits: the step is finished, pushed and
checkpointed, then training stops as if `--max-steps` were reached, and the bridge exits with
status 130. Anywhere else a stop interrupts at once: nothing is logged that the newest
checkpoint lacks (a step interrupted before its log entry is simply not delivered). A second
signal during the wait interrupts at once too; the bridge then takes back what it logged after
its newest checkpoint (trainer_bridge/cli.py), as a resume would.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StepEndStop(TrainerCallback):
    """The stop of a bridge, held from a step's log entry to the end of its push (`hold`, then
    the callback's `on_step_end`, which runs after TRL's push)."""

    def __init__(self) -> None:
        self.requested = False
        self.holding = False

    def install(self) -> None:
        for signum in _SIGNALS:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.holding and not self.requested:
            self.requested = True
            print(f"\nrolltap bridge: {signal.Signals(signum).name}: stopping once the step in "
                  "flight is pushed and checkpointed (signal again to stop at once)",
                  file=sys.stderr, flush=True)
            return
        self.requested = True
        raise KeyboardInterrupt

    def hold(self) -> None:
        """A step is about to be logged: a stop waits until its push is over."""
        self.holding = True

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
        **kwargs: Any,
    ) -> TrainerControl:
        self.holding = False
        if self.requested:
            control.should_training_stop = True
        return control
