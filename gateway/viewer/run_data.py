"""What the viewer's run page plots, read from the store: each group's reward when its last
member ended, the tokens trained and excluded by cause as they accumulate, and how long each
rollout waited between its end and the trainer taking it.

One query over the newest `WINDOW` rollouts (of one run, or of all), shaped here; the page
polls it, so it reads an index-ordered slice, never the whole table. Times are unix seconds."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from typing import Any

from core.store.conn import Conn
from core.store.ledger import CAUSES

WINDOW = 2000
RUNS_LISTED = 20
# Tokens a merge left to train that no trainer has taken yet: trained or excluded once it does.
WAITING = "awaiting trainer"

_COLUMNS = ("id, task_id, group_id, status, reward, finished_at, merged_at, consumed_at,"
            " merge_stats, ledger")


def _ts(t: dt.datetime | None) -> float | None:
    return t.timestamp() if t is not None else None


async def recent_rollouts(conn: Conn, run_id: str | None, window: int = WINDOW) -> list:
    if run_id is None:
        return await conn.fetch(
            f"SELECT {_COLUMNS} FROM rollouts ORDER BY created_at DESC, id DESC LIMIT $1",
            window)
    return await conn.fetch(
        f"SELECT {_COLUMNS} FROM rollouts"
        " WHERE metadata @> jsonb_build_object('run_id', $1::text)"
        " ORDER BY created_at DESC, id DESC LIMIT $2", run_id, window)


async def recent_runs(conn: Conn, window: int = WINDOW) -> list[str]:
    """Run ids (the runner's `metadata.run_id`) of the newest rollouts, newest run first."""
    rows = await conn.fetch(
        "SELECT metadata->>'run_id' AS run_id, max(created_at) AS last FROM"
        " (SELECT metadata, created_at FROM rollouts ORDER BY created_at DESC, id DESC"
        "  LIMIT $1) AS recent"
        " WHERE metadata ? 'run_id' GROUP BY 1 ORDER BY last DESC LIMIT $2",
        window, RUNS_LISTED)
    return [r["run_id"] for r in rows]


def groups(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One point per group whose members have all ended, at its last member's end: the mean
    of its scorable rewards (None when none scored), oldest first."""
    members: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        if r["group_id"] is not None:
            members.setdefault(r["group_id"], []).append(r)
    out = []
    for group, rs in members.items():
        if any(r["status"] == "running" for r in rs):
            continue
        rewards = [r["reward"] for r in rs if r["reward"] is not None]
        out.append({
            "t": max(_ts(r["finished_at"]) or 0.0 for r in rs),
            "group": group,
            "task": rs[0]["task_id"],
            "reward": sum(rewards) / len(rewards) if rewards else None,
            "members": len(rs),
            "scored": len(rewards),
        })
    return sorted(out, key=lambda g: g["t"])


def _counts(tokens: Mapping[str, Any] | None) -> dict[str, int]:
    return {c: int(n) for c, n in (tokens or {}).items()}


def _token_events(r: Mapping[str, Any]) -> list[tuple[float, dict[str, int]]]:
    """How a rollout's tokens moved the totals: at its merge, what the merge left to train
    waits for a trainer and what it excluded is counted; once a trainer took it (its ledger),
    the waiting tokens are trained or excluded by the bridge's causes."""
    stats = r["merge_stats"]
    if not stats or not r["merged_at"]:
        return []
    waiting = int(stats.get("trained_tokens") or 0)
    merged = _counts(stats.get("excluded_by_cause"))
    events = [(r["merged_at"].timestamp(), {WAITING: waiting, **merged})]
    ledger = r["ledger"]
    if ledger and r["consumed_at"]:
        taken = {c: n - merged.get(c, 0) for c, n in _counts(ledger.get("excluded_tokens")).items()}
        taken |= {WAITING: -waiting, "trained": int(ledger.get("trained_tokens") or 0)}
        events.append((r["consumed_at"].timestamp(), taken))
    return events


def tokens(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Tokens trained, excluded by cause and awaiting a trainer over time: `columns` name the
    series, each row is [time, total of each column then]; only columns with a token appear."""
    events = sorted((e for r in rows for e in _token_events(r)), key=lambda e: e[0])
    order = ["trained", WAITING, *CAUSES]
    seen = {c for _, counts in events for c, n in counts.items() if n}
    columns = [c for c in order if c in seen] + sorted(seen - set(order))
    totals = dict.fromkeys(columns, 0)
    out = []
    for t, counts in events:
        for c in columns:
            totals[c] += counts.get(c, 0)
        out.append([t, *(totals[c] for c in columns)])
    return {"columns": columns, "rows": out}


def staleness(rows: Iterable[Mapping[str, Any]]) -> list[list[float]]:
    """[time the trainer took a rollout, seconds since the rollout ended], oldest first."""
    out = [[r["consumed_at"].timestamp(), (r["consumed_at"] - r["finished_at"]).total_seconds()]
           for r in rows if r["consumed_at"] and r["finished_at"]]
    return sorted(out)


def run_view(rows: list, runs: list[str], run_id: str | None,
             metrics: dict[str, list[list[float]]]) -> dict[str, Any]:
    return {
        "run": run_id,
        "runs": runs,
        "rollouts": len(rows),
        "window": WINDOW,
        "running": sum(r["status"] == "running" for r in rows),
        "groups": groups(rows),
        "tokens": tokens(rows),
        "staleness": staleness(rows),
        "metrics": metrics,
    }
