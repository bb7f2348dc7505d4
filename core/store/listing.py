"""Filtered, keyset-paged reads of the `rollouts` table: the trace viewer's list, `rolltap
inspect` and `rolltap export` select rollouts the same way.

Only the filters given become SQL conditions (a `$1 IS NULL OR ...` form would keep a generic
plan from using the indexes), and pages continue from the last row's (created_at, id), so a page
deep into 100k rollouts costs what the first one does."""

from __future__ import annotations

import base64
import datetime as dt
from uuid import UUID

import msgspec

from core.store import rollouts

STATUSES = ("running", "finished", "failed", "timeout")


class Filter(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    task: str | None = None
    group: str | None = None
    status: str | None = None
    harness: str | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    since: dt.datetime | None = None
    merged_only: bool = False

    def __post_init__(self) -> None:
        if self.status is not None and self.status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, not {self.status!r}")
        for name in ("min_reward", "max_reward"):
            value = getattr(self, name)
            if value is not None and value != value:
                raise ValueError(f"{name} is not a number")


class Cursor(msgspec.Struct, array_like=True):
    created_at: dt.datetime
    id: UUID


def encode_cursor(created_at: dt.datetime, rollout_id: UUID) -> str:
    raw = msgspec.json.encode(Cursor(created_at, rollout_id))
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(text: str) -> Cursor:
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        return msgspec.json.decode(raw, type=Cursor)
    except (ValueError, msgspec.DecodeError) as exc:
        raise ValueError(f"invalid page cursor: {exc}") from None


def where(f: Filter, after: Cursor | None = None) -> tuple[str, list]:
    """The WHERE clause (or "") and its arguments, numbered from $1."""
    conds: list[str] = []
    args: list = []

    def add(sql: str, value) -> None:
        args.append(value)
        conds.append(sql.replace("?", f"${len(args)}"))

    for column, value in (
        ("task_id", f.task),
        ("group_id", f.group),
        ("status", f.status),
        ("harness", f.harness),
    ):
        if value is not None:
            add(f"{column} = ?", value)
    if f.min_reward is not None:
        add("reward >= ?", f.min_reward)
    if f.max_reward is not None:
        add("reward <= ?", f.max_reward)
    if f.since is not None:
        add("created_at >= ?", f.since)
    if f.merged_only:
        conds.append("merged_at IS NOT NULL")
    if after is not None:
        args += [after.created_at, after.id]
        conds.append(f"(created_at, id) < (${len(args) - 1}, ${len(args)})")
    return (" WHERE " + " AND ".join(conds)) if conds else "", args


COLUMNS = (
    "id, task_id, group_id, status, reward, harness, call_count, created_at, finished_at,"
    " merged_at, metrics, merge_stats"
)
ORDER = " ORDER BY created_at DESC, id DESC"


def page_query(f: Filter, after: Cursor | None, limit: int) -> tuple[str, list]:
    """One page, newest first; asks for one row more than `limit` to know whether more follow."""
    clause, args = where(f, after)
    args.append(limit + 1)
    return f"SELECT {COLUMNS} FROM rollouts{clause}{ORDER} LIMIT ${len(args)}", args


def row_summary(r) -> dict:
    stats = r["merge_stats"] or {}
    return {
        **rollouts.identity(r),
        "calls": r["call_count"],
        "sequences": stats.get("sequences"),
        "trained_tokens": stats.get("trained_tokens"),
        "created_at": r["created_at"].isoformat(),
        "finished_at": r["finished_at"] and r["finished_at"].isoformat(),
        "merged": r["merged_at"] is not None,
    }


async def page(conn, f: Filter, after: Cursor | None, limit: int) -> tuple[list[dict], str | None]:
    """(rollout summaries, cursor of the next page or None)."""
    sql, args = page_query(f, after, limit)
    rows = await conn.fetch(sql, *args)
    more = len(rows) > limit
    rows = rows[:limit]
    nxt = encode_cursor(rows[-1]["created_at"], rows[-1]["id"]) if more else None
    return [row_summary(r) for r in rows], nxt
