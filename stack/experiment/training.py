"""One training segment: `rolltap bridge` trains up to a step while `rolltap rollouts` plays
the training tasks through the gateway (the code-writer agent in sandboxes, hidden tests
scoring), exactly as a user runs the two. A run of several segments resumes the bridge from
its last checkpoint (`--resume`), with a new runner and run id per segment, so an evaluation
between segments sees the weights of one step and no rollout is in flight meanwhile."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stack.experiment.servers import MODEL_NAME, Servers
from stack.launcher import ROLLTAP
from stack.rollouts import rollouts_command

MAX_RESTARTS = 3  # bridge restarts after a SIGKILL within one segment
ONE_CALL = "sandbox.agents.code_writer:run"
TWO_CALLS = "sandbox.agents.code_reviser:run"  # write, see what running it printed, revise


@dataclass(frozen=True)
class TrainSettings:
    group_size: int
    groups_per_step: int
    learning_rate: float
    temperature: float
    max_staleness: int
    seed: int
    concurrency: int
    threads: int
    token_budget: int
    shuffle_rewards: bool = False  # the shuffled-reward control
    agent: str = ONE_CALL


    def bridge_flags(self) -> list[str]:
        # TRL's token-budget batcher fills each micro-batch up to the budget (a group's shared
        # prompt counted once), and a step is gradient_accumulation_steps micro-batches: a
        # budget of about one group makes a step about `groups_per_step` groups. (At 8192 a
        # step took some 60 groups of these short replies.)
        return ["--num-generations", str(self.group_size),
                "--learning-rate", str(self.learning_rate),
                "--temperature", str(self.temperature),
                "--max-staleness", str(self.max_staleness),
                "--token-budget", str(self.token_budget), "--group-deadline", "1800",
                "--queue-size", str(2 * self.group_size * self.groups_per_step),
                "--set", f"gradient_accumulation_steps={self.groups_per_step}",
                "--set", f"seed={self.seed}", "--threads", str(self.threads),
                *(["--shuffle-rewards"] if self.shuffle_rewards else [])]


def _bridge(servers: Servers, settings: TrainSettings, out: Path, run_id: str, until: int,
            resume: bool, state_every: int):
    return servers.procs.start(
        [*ROLLTAP, "bridge", "--model", str(servers.model_dir), "--vllm", servers.upstream,
         "--gateway", servers.gateway_url, "--data-dir", str(servers.workdir / "data"),
         "--max-steps", str(until), "--weight-sync", "disk",
         "--checkpoint-dir", str(out / "checkpoints"), "--keep-checkpoints", "1",
         # The optimizer state (twice the weights) is written every few steps, where a later
         # segment or a restart resumes: every step it was a fixed cost of seconds per step.
         "--state-every", str(state_every),
         "--output-dir", str(out), "--match", f"run_id={run_id}",
         *settings.bridge_flags(), *(["--resume"] if resume else [])],
        out / "bridge.log", env={"ROLLTAP_ADMIN_KEY": servers.admin_key})


def segment(servers: Servers, settings: TrainSettings, tasks_file: Path, n_tasks: int, *,
            out: Path, run_id: str, until: int, resume: bool, state_every: int,
            log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Train to step `until` (resuming from the last resumable checkpoint if `resume`; one is
    written every `state_every` steps); returns the bridge's per-step entries of this segment."""
    out.mkdir(parents=True, exist_ok=True)
    progress = out / "progress.jsonl"
    progress.unlink(missing_ok=True)
    bridge = _bridge(servers, settings, out, run_id, until, resume, state_every)
    per_step = settings.group_size * settings.groups_per_step
    # Enough groups for every step plus the ones dropped (all rewards equal): the runner is
    # stopped when the bridge is done. Repeat-major order cycles through the tasks.
    repeat = max(2, -(-4 * until * settings.groups_per_step // max(n_tasks, 1)))
    player = servers.procs.start(
        rollouts_command(tasks_file, ["--harness", "python", "--agent", settings.agent],
                         gateway=servers.gateway_url, model=MODEL_NAME,
                         run_id=run_id, state=out / f"{run_id}.jsonl",
                         group_size=settings.group_size, concurrency=settings.concurrency,
                         repeat=repeat, max_backlog=2 * per_step),
        out / f"{run_id}.log", env={"ROLLTAP_ADMIN_KEY": servers.admin_key})
    log(f"   bridge log {out / 'bridge.log'}; runner log {out / f'{run_id}.log'}; "
        f"{per_step} rollouts per step")
    by_step: dict[int, dict[str, Any]] = {}  # a restarted bridge redoes steps: the last counts
    started, shown, restarts = time.monotonic(), 0, 0
    while True:
        lines = progress.read_text().splitlines() if progress.exists() else []
        for line in lines[shown:]:
            entry = json.loads(line)
            by_step[entry["step"]] = {**entry, "bridge_restarts": restarts}
            m = entry.get("metrics", {})
            # Agreement over the tokens the trainer's current weights sampled (NeMo RL's 1.05
            # applies to these), and over all trained tokens, stale ones included.
            log(f"   step {entry['step']:>3}/{until}  reward {_num(entry['reward'])}  "
                f"agreement {_num(m.get('agreement/same_version_exp_abs_dlogp'), '.4f')} "
                f"(max {_num(m.get('agreement/same_version_exp_abs_dlogp_max'), '.3f')}, "
                f"{_num(m.get('agreement/same_version_frac'), '.0%')} of tokens), all tokens "
                f"{_num(m.get('agreement/exp_abs_dlogp'), '.4f')}  "
                f"{time.monotonic() - started:6.0f} s")
        shown = len(lines)
        if bridge.poll() is not None:
            if bridge.returncode != -signal.SIGKILL or restarts >= MAX_RESTARTS:
                break
            # Killed (the kernel's OOM killer on a shared machine): the bridge carries on from
            # its last resumable checkpoint; the runner goes on meanwhile.
            restarts += 1
            log(f"   the bridge was killed (SIGKILL, see dmesg); restart {restarts}/"
                f"{MAX_RESTARTS} from its last resumable checkpoint")
            progress.unlink(missing_ok=True)
            shown = 0
            bridge = _bridge(servers, settings, out, run_id, until, True, state_every)
        servers.alive()
        time.sleep(5)
    if player.poll() is None:
        player.send_signal(signal.SIGTERM)
    player.wait(600)
    if bridge.returncode:
        raise SystemExit(f"the bridge failed (exit {bridge.returncode}); see {out / 'bridge.log'}")
    return [by_step[k] for k in sorted(by_step)]


def _num(value: float | None, fmt: str = "6.3f") -> str:
    return format(value, fmt) if isinstance(value, int | float) else "   n/a"
