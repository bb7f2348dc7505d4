"""`BridgeConfig`: every knob of `rolltap bridge` in one place, in TRL's style (a dataclass whose
fields carry their help), filled from command-line flags and `ROLLTAP_<FIELD>` variables.

The command line is generated from the fields (core/knobs.py, shared with the gateway's
config), so a flag, its help, its environment variable and its default cannot drift apart.
Precedence: flag, then environment variable, then default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from core import knobs

if TYPE_CHECKING:  # the source pulls in TRL: not needed to parse flags or print --help
    from trainer_bridge.release import SourceConfig

_SECRET = ("admin_key",)


def _opt(help: str, group: str, **argparse_kwargs: Any) -> dict:
    return knobs.knob(help, group=group, **argparse_kwargs)


def match_arg(key: str, value: object) -> str:
    """The `--match` argument selecting metadata `key` equal to `value`, type included. VALUE
    is read as JSON where it parses, so a text id written bare may come back a number (the
    hex id 64309107) and then match nothing; written as JSON it stays what it was."""
    return f"{key}={json.dumps(value)}"


_WHERE, _TRAIN, _GROUPS, _WEIGHTS = (
    "where things are", "training", "rollouts and groups", "weights")


@dataclass
class BridgeConfig:
    """Configuration of the trainer bridge (see `rolltap bridge --help`)."""

    # -- where things are
    model: str = field(default="", metadata=_opt(
        "model directory to train (the one vLLM serves)", _WHERE, metavar="PATH"))
    vllm: list[str] = field(default_factory=list, metadata=_opt(
        "a vLLM replica to push weights to, e.g. http://127.0.0.1:8000; repeat for several "
        "(nccl: exactly one)", _WHERE, metavar="URL", action="append"))
    gateway: list[str] = field(default_factory=list, metadata=_opt(
        "a gateway to tell the new policy version; repeat for several", _WHERE, metavar="URL",
        action="append"))
    admin_key: str | None = field(default=None, metadata=_opt(
        "the gateways' admin key", _WHERE, metavar="KEY"))
    database_url: str | None = field(default=None, metadata=_opt(
        "the gateways' Postgres; without it, the embedded Postgres in --data-dir", _WHERE,
        metavar="DSN"))
    data_dir: Path | None = field(default=None, metadata=_opt(
        "the gateway's data directory holding its embedded Postgres (default: the gateway's "
        "default)", _WHERE, metavar="DIR", type=Path))
    output_dir: Path = field(default=Path("runs/bridge"), metadata=_opt(
        "trainer output, progress.jsonl and summary.json", _WHERE, metavar="DIR", type=Path))
    metrics_port: int | None = field(default=None, metadata=_opt(
        "serve the trainer's Prometheus /metrics on 127.0.0.1:PORT (its idle fraction, steps, "
        "samples queued, taken and trained), e.g. for the viewer's run page (the gateway's "
        "--run-metrics)", _WHERE, metavar="PORT", type=int))
    checkpoint_dir: Path | None = field(default=None, metadata=_opt(
        "where checkpoints are written (disk sync: for the replicas to load, so the same path "
        "on their machines; nccl sync: to resume from) (default OUTPUT_DIR/weights)", _WHERE,
        metavar="DIR", type=Path))

    # -- training
    num_generations: int = field(default=8, metadata=_opt(
        "rollouts per group (per task); a group is trained when G of them finished", _TRAIN,
        metavar="G", type=int))
    max_steps: int = field(default=0, metadata=_opt(
        "optimizer steps to train; each is followed by a weight push", _TRAIN, metavar="N",
        type=int))
    learning_rate: float = field(default=1e-6, metadata=_opt(
        "AdamW learning rate, constant", _TRAIN, metavar="LR", type=float))
    temperature: float = field(default=1.0, metadata=_opt(
        "the policy's sampling temperature; must equal the gateway's --temperature (the bridge "
        "checks, and refuses to start otherwise)", _TRAIN, metavar="T", type=float))
    loss_normalization: Literal["token", "rollout"] = field(default="token", metadata=_opt(
        "token: TRL's loss, every trained token weighs the same; rollout: every rollout weighs "
        "the same whatever its length and sequence count", _TRAIN, choices=("token", "rollout")))
    importance_sampling: Literal["none", "tis"] = field(default="none", metadata=_opt(
        "none: TRL's clipped ratio against the recorded logprobs; tis: truncated importance "
        "sampling, each token weighted by min(C, exp(trainer logprob - recorded logprob)) "
        "(see README, training)", _TRAIN, choices=("none", "tis")))
    tis_cap: float = field(default=2.0, metadata=_opt(
        "C, the cap on a token's importance weight with --importance-sampling tis", _TRAIN,
        metavar="C", type=float))
    std_scaling: bool = field(default=True, metadata=_opt(
        "divide advantages by the group's reward std (--no-std-scaling: reward - group mean)",
        _TRAIN, action=argparse.BooleanOptionalAction))
    shuffle_rewards: bool = field(default=False, metadata=_opt(
        "a control run, not training: permute the rewards within each group before the "
        "advantages (a fixed permutation per group), so the policy gets a signal unrelated to "
        "what it did; a held-out change after such a run is what the loop does without one",
        _TRAIN, action=argparse.BooleanOptionalAction))
    token_budget: int = field(default=16384, metadata=_opt(
        "tokens per micro-batch row; longer sequences are skipped and logged, never truncated",
        _TRAIN, metavar="N", type=int))
    max_staleness: int = field(default=4, metadata=_opt(
        "trained tokens more than N policy versions behind the trainer are masked out of the "
        "loss; the rest of their sequence trains", _TRAIN, metavar="N", type=int))
    threads: int | None = field(default=None, metadata=_opt(
        "CPU threads for the trainer (default: torch's choice); on a CPU shared with vLLM, 1 "
        "keeps the two from stalling each other", _TRAIN, metavar="N", type=int))
    overrides: dict = field(default_factory=dict, metadata=_opt(
        "any other AsyncGRPOConfig field, VALUE as JSON or text, e.g. --set "
        "gradient_accumulation_steps=4 --set seed=1; repeatable", _TRAIN, flag="--set",
        env="OVERRIDES", metavar="KEY=VALUE", action="append", type=knobs.key_value))

    # -- rollouts and groups
    group_deadline: float = field(default=600.0, metadata=_opt(
        "seconds after a group's first rollout finished until it is released incomplete",
        _GROUPS, metavar="S", type=float))
    partial_groups: Literal["train", "drop"] = field(default="train", metadata=_opt(
        "what an incomplete group at its deadline becomes", _GROUPS, choices=("train", "drop")))
    match: dict = field(default_factory=dict, metadata=_opt(
        "only rollouts whose metadata has KEY=VALUE (VALUE as JSON or text: a text value "
        "that reads as JSON, like the id 64309107, goes in JSON quotes: run='\"64309107\"'); "
        "repeatable",
        _GROUPS, metavar="KEY=VALUE", action="append", type=knobs.key_value))
    queue_size: int = field(default=64, metadata=_opt(
        "claim new groups only while fewer than N samples wait for the trainer", _GROUPS,
        metavar="N", type=int))
    lease_seconds: float = field(default=60.0, metadata=_opt(
        "how long a claimed group stays this bridge's without a renewal; renewed until an "
        "optimizer step has taken its samples", _GROUPS, metavar="S", type=float))
    poll_interval: float = field(default=2.0, metadata=_opt(
        "seconds between looks at the database when no notification arrives", _GROUPS,
        metavar="S", type=float))
    max_attempts: int = field(default=5, metadata=_opt(
        "faults of a group (it could not be built into samples, or the trainer failed on "
        "them) before it is quarantined and reported; a bridge's crash does not count", _GROUPS,
        metavar="N", type=int))
    db_give_up: float = field(default=600.0, metadata=_opt(
        "seconds of nothing but database errors before the bridge gives up (shorter outages "
        "are retried with backoff)", _GROUPS, metavar="S", type=float))
    flush_after: float = field(default=60.0, metadata=_opt(
        "seconds without a new sample after which the micro-batch the trainer holds is trained "
        "as a step although it is not full (the last one of a finite run, or a quiet stretch)",
        _GROUPS, metavar="S", type=float))
    until_empty: bool = field(default=False, metadata=_opt(
        "end the run once nothing is left to deliver (after training what the trainer holds), "
        "even before --max-steps", _GROUPS, action=argparse.BooleanOptionalAction))
    report_every: float = field(default=30.0, metadata=_opt(
        "seconds between lines saying what the bridge waits for when no step comes, and why "
        "the groups it consumed trained nothing", _GROUPS, metavar="S", type=float))

    # -- weights
    weight_sync: Literal["disk", "nccl"] = field(default="disk", metadata=_opt(
        "how new weights reach vLLM (see above)", _WEIGHTS, choices=("disk", "nccl")))
    keep_checkpoints: int = field(default=2, metadata=_opt(
        "disk sync: newest checkpoints kept; the last is the trained model", _WEIGHTS,
        metavar="N", type=int))
    resume: bool = field(default=False, metadata=_opt(
        "start from the newest complete checkpoint in --checkpoint-dir (weights, optimizer, "
        "scheduler, step) and put back in the queue what later steps logged; without one, "
        "start from --model", _WEIGHTS, action=argparse.BooleanOptionalAction))
    state_every: int = field(default=1, metadata=_opt(
        "save the optimizer and scheduler with every Nth checkpoint, which makes it one to "
        "resume from (nccl sync: write a checkpoint every Nth push only); a crash re-trains at "
        "most N steps (raise it on GPUs, where the optimizer state is twice the model)",
        _WEIGHTS, metavar="N", type=int))
    pause_lease_seconds: float = field(default=5.0, metadata=_opt(
        "a weight sync's pause is leased from the gateways for this long and renewed; a "
        "bridge that dies mid-push has its replicas resumed by the gateways once it runs out",
        _WEIGHTS, metavar="S", type=float))

    def __post_init__(self) -> None:
        if self.importance_sampling not in ("none", "tis"):
            raise ValueError("importance_sampling must be 'none' or 'tis'")
        if self.tis_cap <= 0:
            raise ValueError("tis_cap must be positive")
        if self.temperature <= 0:
            raise ValueError("temperature must be positive (the trainer divides logits by it)")
        if self.state_every < 1 or self.pause_lease_seconds <= 0:
            raise ValueError("state_every must be at least 1 and pause_lease_seconds positive")

    def to_dict(self, *, redact: bool = True) -> dict[str, Any]:
        """Every knob as JSON-ready values; secrets shown only as set or not."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if redact and f.name in _SECRET and value:
                value = "<set>"
            out[f.name] = str(value) if isinstance(value, Path) else value
        return out

    def source_config(self, database_url: str, version_offset: int) -> SourceConfig:
        """The rollout source's part, once the database and the gateways' version are known."""
        from trainer_bridge.release import SourceConfig

        return SourceConfig(
            database_url=database_url,
            num_generations=self.num_generations,
            token_budget=self.token_budget,
            group_deadline_s=self.group_deadline,
            partial_groups=self.partial_groups,
            scale_std=self.std_scaling,
            shuffle_rewards=self.shuffle_rewards,
            max_staleness=self.max_staleness,
            queue_size=self.queue_size,
            lease_s=self.lease_seconds,
            poll_interval_s=self.poll_interval,
            match=dict(self.match),
            version_offset=version_offset,
            max_attempts=self.max_attempts,
            db_give_up_s=self.db_give_up,
            report_every_s=self.report_every,
            flush_after_s=self.flush_after,
            until_empty=self.until_empty,
        )

    # -- flags and environment ----------------------------------------------------------------

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, required: tuple[str, ...] = ()):
        """One flag per field, in its group, defaulting to `ROLLTAP_<FIELD>` when that is set.
        Fields in `required` must come from a flag or the environment."""
        knobs.add_arguments(cls, parser, required=required, secret=_SECRET)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BridgeConfig:
        """The config of parsed flags (from `add_arguments`); unset ones from the environment."""
        return cls(**knobs.values_from_args(cls, args))
