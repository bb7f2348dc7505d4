"""The bridge's progress display: one line per optimizer step, a JSON line per step for tools
(the demo, the tests), and the final summary."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from transformers import TrainerCallback

# Steps averaged at each end of the run for the summary's "first" and "last" reward.
_ENDS = 5


def _number(value) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


class Progress(TrainerCallback):
    """Prints step, reward, loss, queue and policy version as TRL logs each step, and appends
    the step's whole log (TRL's metrics and the rollout source's) to `jsonl_path`."""

    def __init__(self, source, transfer, jsonl_path: Path) -> None:
        self.source = source
        self.transfer = transfer  # a VersionedTransfer: its announcer knows the versions
        self.jsonl_path = Path(jsonl_path)
        self.jsonl_path.write_text("")
        self.rewards: list[tuple[int, float]] = []
        self._started = time.monotonic()

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "loss" not in logs:  # the end-of-training summary log, not a step
            return
        reward = _number(logs.get("reward"))
        if reward is not None:
            self.rewards.append((state.global_step, reward))
        announced = self.transfer.announcer.announced
        entry = {
            "step": state.global_step,
            "reward": reward,
            "loss": _number(logs.get("loss")),
            "queue": self.source.rollout_buffer.qsize(),
            "version": announced[-1] if announced else None,
            "elapsed_s": round(time.monotonic() - self._started, 3),
            # Waiting for samples, over the wall time since the trainer first asked for one.
            "idle_fraction": _rounded(self.source.rollout_buffer.idle_fraction()),
            "metrics": {k: _number(v) for k, v in logs.items() if isinstance(v, int | float)},
            # The ledgers of every rollout consumed so far: tokens trained, excluded by cause.
            "consumed": dict(self.source.consumed),
        }
        with self.jsonl_path.open("a") as out:
            out.write(json.dumps(entry) + "\n")
        print(
            f"step {state.global_step:>4}/{state.max_steps}"
            f"  reward {_fmt(reward)}  loss {_fmt(entry['loss'], '+.4f')}"
            f"  queue {entry['queue']:>3}  version {entry['version']}"
            f"  rollouts {self.source.stats['rollouts']}"
            f"  stale tokens {self.source.stats['stale_tokens']}"
            f"  {entry['elapsed_s']:.0f} s",
            flush=True,
        )

    def summary(self, *, elapsed_s: float, steps: int, checkpoint: Path | None) -> dict:
        rewards = [r for _, r in self.rewards]
        announced = self.transfer.announcer.announced
        return {
            "steps": steps,
            "elapsed_s": round(elapsed_s, 1),
            "reward_per_step": dict(self.rewards),
            "reward_first_steps": _mean(rewards[:_ENDS]),
            "reward_last_steps": _mean(rewards[-_ENDS:]),
            "versions": [announced[0], announced[-1]] if announced else [],
            "gateways": self.transfer.announcer.gateways,
            "source": dict(self.source.stats),
            "consumed": dict(self.source.consumed),
            "trainer_idle_fraction": _rounded(self.source.rollout_buffer.idle_fraction()),
            "checkpoint": str(checkpoint) if checkpoint else None,
        }

    @staticmethod
    def format_summary(summary: dict) -> str:
        stats = summary["source"]
        versions = summary["versions"]
        lines = [
            f"rolltap bridge: {summary['steps']} steps in {summary['elapsed_s']:.0f} s",
            f"  trained {stats.get('rollouts', 0)} rollouts in {stats.get('groups', 0)} groups "
            f"({stats.get('partial_groups', 0)} partial), {stats.get('samples', 0)} samples; "
            f"dropped {stats.get('dropped_rollouts', 0)} rollouts in "
            f"{stats.get('dropped_groups', 0)} groups, {stats.get('stale', 0)} stale samples, "
            f"{stats.get('too_long', 0)} sequences over the token budget",
            f"  delivery: {stats.get('trained_samples', 0)} samples logged as trained, "
            f"{stats.get('stale_tokens', 0)} stale tokens masked, "
            f"{stats.get('redelivered_groups', 0)} groups delivered again after a crash, "
            f"{stats.get('quarantined_groups', 0)} quarantined, "
            f"{stats.get('db_errors', 0)} database errors retried",
            _consumed_line(summary.get("consumed") or {}),
            f"  reward: first {_ENDS} steps {_fmt(summary['reward_first_steps'])}, "
            f"last {_ENDS} steps {_fmt(summary['reward_last_steps'])}",
            f"  policy versions {versions[0]}..{versions[-1]} announced to "
            f"{len(summary['gateways'])} gateway(s)" if versions else "  no version announced",
            _idle_line(summary.get("trainer_idle_fraction")),
        ]
        if summary["checkpoint"]:
            lines.append(f"  trained model: {summary['checkpoint']}")
        return "\n".join(lines)


def _consumed_line(consumed: dict) -> str:
    excluded = sorted(((n, k.split("/", 1)[1]) for k, n in consumed.items()
                       if k.startswith("excluded_tokens/") and n), reverse=True)
    return (
        f"  consumed {consumed.get('rollouts', 0)} rollouts "
        f"({consumed.get('trained_nothing', 0)} trained nothing): "
        f"{consumed.get('trained_tokens', 0)} tokens trained, excluded "
        + (", ".join(f"{cause} {n}" for n, cause in excluded) or "none")
    )


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _idle_line(idle: float | None) -> str:
    if idle is None:
        return "  trainer idle: never asked for a sample"
    return (f"  trainer idle {idle:.0%} of its wall time, waiting for samples (more rollouts "
            "at once, --oversample and phase pools in rolltap rollouts lower it)")


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "  -  " if value is None else format(value, spec)
