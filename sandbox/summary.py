"""Progress lines and the end-of-run table. Pure functions over finished-rollout records."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from sandbox.harbor.protocol import UNSEALED
from sandbox.state import FinishedRollout, unscorable_cause

SHOWN_REWARDS = 16


class TaskSummary(msgspec.Struct, frozen=True):
    task_id: str
    rollouts: int
    statuses: dict[str, int]
    rewards: list[float | None]
    mean_reward: float | None
    calls: int
    trained_tokens: int
    errors: int = 0
    tampered: int = 0  # finished with reward 0: protected paths changed or report forged


def trained_tokens(stats: Mapping[str, Any] | None, completion_tokens: int | None) -> int | None:
    """The merge's count of trained tokens if the gateway reports one, else the sampled
    (completion) tokens of the rollout's calls, which is what merging trains on."""
    if stats and isinstance(stats.get("trained_tokens"), int):
        return stats["trained_tokens"]
    return completion_tokens


def summarize(
    records: Iterable[FinishedRollout], errors: Mapping[str, int] | None = None
) -> list[TaskSummary]:
    by_task: dict[str, list[FinishedRollout]] = {}
    for record in records:
        by_task.setdefault(record.task_id, []).append(record)
    errors = errors or {}
    out = []
    for task_id in sorted(set(by_task) | set(errors)):
        rows = sorted(by_task.get(task_id, []), key=lambda r: (r.repeat, r.member))
        rewards = [r.reward for r in rows]
        scored = [x for x in rewards if x is not None]
        out.append(TaskSummary(
            task_id=task_id,
            rollouts=len(rows),
            statuses=dict(Counter(r.status for r in rows)),
            rewards=rewards,
            mean_reward=sum(scored) / len(scored) if scored else None,
            calls=sum(r.calls or 0 for r in rows),
            trained_tokens=sum(r.trained_tokens or 0 for r in rows),
            errors=errors.get(task_id, 0),
            tampered=sum(r.sandbox_status == "tampered" for r in rows),
        ))
    return out


def _reward(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def format_table(summaries: list[TaskSummary]) -> str:
    header = ["task", "n", "finished", "failed", "timeout", "tampered", "errors", "mean", "calls",
              "tokens", "rewards"]
    rows = [header]
    for s in summaries:
        shown = " ".join(_reward(x) for x in s.rewards[:SHOWN_REWARDS])
        if len(s.rewards) > SHOWN_REWARDS:
            shown += f" ... (+{len(s.rewards) - SHOWN_REWARDS})"
        rows.append([
            s.task_id, str(s.rollouts), str(s.statuses.get("finished", 0)),
            str(s.statuses.get("failed", 0)), str(s.statuses.get("timeout", 0)),
            str(s.tampered), str(s.errors),
            _reward(s.mean_reward), str(s.calls), str(s.trained_tokens), shown,
        ])
    total_rewards = [x for s in summaries for x in s.rewards if x is not None]
    rows.append([
        "all", str(sum(s.rollouts for s in summaries)),
        *(str(sum(s.statuses.get(k, 0) for s in summaries))
          for k in ("finished", "failed", "timeout")),
        str(sum(s.tampered for s in summaries)), str(sum(s.errors for s in summaries)),
        _reward(sum(total_rewards) / len(total_rewards) if total_rewards else None),
        str(sum(s.calls for s in summaries)), str(sum(s.trained_tokens for s in summaries)), "",
    ])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = [
        "  ".join([cell.ljust(w) if j == 0 else cell.rjust(w)
                   for j, (cell, w) in enumerate(zip(row, widths))] + [row[-1]]).rstrip()
        for row in rows
    ]
    rule = "-" * max(len(line) for line in lines)
    return "\n".join([lines[0], rule, *lines[1:-1], rule, lines[-1]])


def isolation_line(records: Iterable[FinishedRollout], requested: str) -> str:
    """How the sandboxes were confined, loudly when they were not."""
    seen = {r.isolation for r in records if r.isolation is not None} or {requested}
    if "none" in seen:
        return ("isolation: NONE (--isolation none): agents ran unconfined and could read the "
                "task set's hidden tests and reach the machine's network")
    if "harbor" in seen:
        return ("isolation: the Harbor environment's own (rolltap promises only what that "
                "backend enforces)")
    return "isolation: bwrap (own uids and namespaces; network: the gateway only)"


def progress_line(record: FinishedRollout, done: int, total: int, running: int) -> str:
    width = len(str(total))
    calls = "?" if record.calls is None else str(record.calls)
    tokens = "?" if record.trained_tokens is None else str(record.trained_tokens)
    return (
        f"[{done:>{width}}/{total}] {record.task_id} r{record.repeat} m{record.member}  "
        f"{record.status:<8} reward {_reward(record.reward):>5}  calls {calls}  "
        f"tokens {tokens}  {record.duration_s:.1f}s  ({record.reward_detail}; "
        f"{running} running)"
    )


def error_line(task_id: str, repeat: int, member: int, message: str, done: int,
               total: int) -> str:
    width = len(str(total))
    return f"[{done:>{width}}/{total}] {task_id} r{repeat} m{member}  ERROR    {message}"


def unsealed_lines(records: Iterable[FinishedRollout]) -> list[str]:
    """One line a task whose verdict its tested code could change (a Harbor task whose
    verifier runs no sealed pytest), so that a user knows which rewards to trust."""
    tasks = sorted({r.task_id for r in records if UNSEALED in r.reward_detail})
    return [f"{task}: {UNSEALED}" for task in tasks]


def unscorable_lines(records: Iterable[FinishedRollout], max_share: float) -> list[str]:
    """The unscorable rollouts by cause, and a warning above `max_share` of the run: an
    unscorable rollout leaves its group's baseline, so many of them skew what is learnt."""
    rows = list(records)
    causes = Counter(unscorable_cause(r.reward_detail, r.sandbox_status)
                     for r in rows if r.reward is None)
    if not causes:
        return []
    total = sum(causes.values())
    lines = [f"unscorable: {total} of {len(rows)} ("
             + ", ".join(f"{cause}: {n}" for cause, n in causes.most_common()) + ")"]
    if total > max_share * len(rows):
        lines.append(f"WARNING: {total / len(rows):.0%} of the rollouts are unscorable, above "
                     f"--max-unscorable-share {max_share:g}: the environment is failing, not "
                     "the policy; see each rollout's cause")
    return lines
