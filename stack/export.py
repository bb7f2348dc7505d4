"""`rolltap export`: recorded rollouts from Postgres to files that Hugging Face `datasets` and
pyarrow read directly, at two grains:

- tokens: one row per merged sequence, exactly as `/admin/rollouts/{id}/traces` gives it
  (input_ids, loss_mask, logprobs, versions), with the rollout's reward, its group-relative
  advantage as the bridge computes it, task, group and harness: RL replay and analysis.
- messages: one row per rollout, the conversation of its last successful call (the one with
  tools, if any) in OpenAI chat form plus the reply it sampled, and the tools it was offered:
  supervised fine-tuning on verified traces.

Rows stream from a server-side cursor inside one read-only transaction (a consistent snapshot)
and go out in bounded batches, so memory stays flat however many rollouts there are."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
from collections import OrderedDict
from pathlib import Path

GRAINS = ("tokens", "messages")
FORMATS = ("parquet", "jsonl")
# A batch is written once it holds this many rows or tokens: bounds memory for long sequences.
BATCH_ROWS = 256
BATCH_TOKENS = 1 << 20

DESCRIPTION = __doc__.split("\n\n", 1)[1] + """
Files: OUT_DIR/tokens.parquet and OUT_DIR/messages.parquet (or .jsonl with --format jsonl).
Read them with:
  datasets.load_dataset("parquet", data_files={"train": "OUT_DIR/messages.parquet"})
  pyarrow.parquet.read_table("OUT_DIR/tokens.parquet")
In message rows, `tools` is a JSON string (tool schemas have no fixed shape); `json.loads` it.

--push-to-hub REPO uploads each grain as a config of the dataset repository REPO after writing
(needs network access and a token: `huggingface-cli login` or HF_TOKEN).

Example:
  rolltap export runs/export --database-url postgresql://... --status finished --min-reward 1
"""


def _token_schema():
    import pyarrow as pa

    return pa.schema([
        ("rollout_id", pa.string()),
        ("sequence", pa.int32()),
        ("task_id", pa.string()),
        ("group_id", pa.string()),
        ("harness", pa.string()),
        ("status", pa.string()),
        ("reward", pa.float64()),
        ("advantage", pa.float64()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.uint8())),
        ("logprobs", pa.list_(pa.float32())),
        ("versions", pa.list_(pa.int32())),
        ("cause", pa.string()),
        ("auxiliary", pa.bool_()),
        ("excluded", pa.bool_()),
        ("created_at", pa.timestamp("us", tz="UTC")),
    ])


def _message_schema():
    import pyarrow as pa

    call = pa.struct([
        ("id", pa.string()),
        ("type", pa.string()),
        ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())])),
    ])
    message = pa.struct([
        ("role", pa.string()),
        ("content", pa.string()),
        ("reasoning_content", pa.string()),
        ("name", pa.string()),
        ("tool_call_id", pa.string()),
        ("tool_calls", pa.list_(call)),
    ])
    return pa.schema([
        ("rollout_id", pa.string()),
        ("task_id", pa.string()),
        ("group_id", pa.string()),
        ("harness", pa.string()),
        ("status", pa.string()),
        ("reward", pa.float64()),
        ("call_id", pa.string()),
        ("messages", pa.list_(message)),
        ("tools", pa.string()),
        ("created_at", pa.timestamp("us", tz="UTC")),
    ])


# ---- pure row shaping -----------------------------------------------------------------------


def _text(content) -> str | None:
    """Chat content as one string: text parts joined (the engine saw only text)."""
    if content is None or isinstance(content, str):
        return content
    return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)


def message_row(message: dict) -> dict:
    calls = message.get("tool_calls")
    return {
        "role": message.get("role"),
        "content": _text(message.get("content")),
        "reasoning_content": message.get("reasoning_content") or message.get("reasoning"),
        "name": message.get("name"),
        "tool_call_id": message.get("tool_call_id"),
        "tool_calls": [
            {
                "id": c.get("id"),
                "type": c.get("type", "function"),
                "function": {
                    "name": c["function"].get("name"),
                    "arguments": c["function"].get("arguments")
                    if isinstance(c["function"].get("arguments"), str)
                    else json.dumps(c["function"].get("arguments")),
                },
            }
            for c in calls
        ]
        if calls
        else None,
    }


class Advantages:
    """Group-relative advantages as the bridge computes them, over all ended rollouts of a
    group (not only the exported ones); None for a rollout without a group. The last groups
    seen are cached: rollouts of a group are usually created together."""

    def __init__(self, conn, size: int = 1024) -> None:
        self._conn = conn
        self._cache: OrderedDict[str, dict] = OrderedDict()
        self._size = size

    async def of(self, group_id: str | None, rollout_id) -> float | None:
        from trainer_bridge.advantages import group_advantages

        if group_id is None:
            return None
        if group_id not in self._cache:
            rows = await self._conn.fetch(
                "SELECT id, reward FROM rollouts WHERE group_id = $1 AND merged_at IS NOT NULL"
                " ORDER BY created_at, id",
                group_id,
            )
            values = group_advantages([r["reward"] for r in rows])
            self._cache[group_id] = {r["id"]: float(a) for r, a in zip(rows, values)}
            if len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return self._cache[group_id].get(rollout_id)


# ---- writers --------------------------------------------------------------------------------


class Sink:
    """Rows of one grain to OUT_DIR/GRAIN.FORMAT, in bounded batches."""

    def __init__(self, path: Path, schema, fmt: str) -> None:
        self.path, self.schema, self.fmt = path, schema, fmt
        self.rows: list[dict] = []
        self.tokens = 0
        self.written = 0
        self._writer = None
        self._file = None

    def add(self, row: dict, tokens: int = 0) -> None:
        self.rows.append(row)
        self.tokens += tokens
        if len(self.rows) >= BATCH_ROWS or self.tokens >= BATCH_TOKENS:
            self.flush()

    def flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self.rows:
            return
        table = pa.Table.from_pylist(self.rows, schema=self.schema)
        if self.fmt == "parquet":
            if self._writer is None:
                self._writer = pq.ParquetWriter(str(self.path), self.schema)
            self._writer.write_table(table)
        else:
            if self._file is None:
                self._file = open(self.path, "w", encoding="utf-8")
            for row in table.to_pylist():
                self._file.write(json.dumps(row, default=_jsonable, ensure_ascii=False) + "\n")
        self.written += len(self.rows)
        self.rows, self.tokens = [], 0

    def close(self) -> None:
        import pyarrow.parquet as pq

        self.flush()
        if self.fmt == "parquet" and self._writer is None:  # no rows: still a readable file
            pq.write_table(self.schema.empty_table(), str(self.path))
        if self._writer is not None:
            self._writer.close()
        if self._file is not None:
            self._file.close()
        elif self.fmt == "jsonl" and not self.path.exists():
            self.path.touch()


def _jsonable(value):
    if isinstance(value, dt.datetime):
        return value.isoformat()
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


# ---- the export -----------------------------------------------------------------------------


async def export(
    dsn: str,
    out_dir: Path,
    filt,
    grains: tuple[str, ...] = GRAINS,
    fmt: str = "parquet",
    progress: bool = True,
) -> dict[str, Path]:
    """Writes the selected rollouts' rows; returns the file of each grain."""
    import asyncpg
    from tqdm import tqdm

    from core.store import listing
    from core.store.db import init_connection

    out_dir.mkdir(parents=True, exist_ok=True)
    clause, args = listing.where(filt)
    paths = {g: out_dir / f"{g}.{fmt}" for g in grains}
    conn = await asyncpg.connect(dsn)
    side = await asyncpg.connect(dsn)
    try:
        for c in (conn, side):
            await init_connection(c)
        total = await conn.fetchval(f"SELECT count(*) FROM rollouts{clause}", *args)
        for grain in grains:
            sink = Sink(paths[grain], (_token_schema if grain == "tokens" else
                                       _message_schema)(), fmt)
            bar = tqdm(total=total, unit="rollout", desc=f"export {grain}", disable=not progress,
                       file=sys.stderr)
            try:
                async with conn.transaction(readonly=True, isolation="repeatable_read"):
                    if grain == "tokens":
                        await _tokens(conn, side, clause, args, sink, bar)
                    else:
                        await _messages(conn, side, clause, args, sink, bar)
            finally:
                bar.close()
            sink.close()
    finally:
        await conn.close()
        await side.close()
    return paths


_ROLLOUT_COLUMNS = "r.id, r.task_id, r.group_id, r.harness, r.status, r.reward, r.created_at"


def _rollout_fields(r) -> dict:
    from core.store import rollouts

    return {**rollouts.identity(r), "created_at": r["created_at"]}


async def _tokens(conn, side, clause, args, sink: Sink, bar) -> None:
    from core.store.traces import StoredTrace

    advantages = Advantages(side)
    sql = (
        f"SELECT {_ROLLOUT_COLUMNS}, t.idx, t.input_ids, t.loss_mask, t.logprobs, t.versions,"
        " t.call_ids, t.cause, t.auxiliary, t.excluded"
        f" FROM (SELECT * FROM rollouts{clause}) r JOIN traces t ON t.rollout_id = r.id"
        " ORDER BY r.created_at, r.id, t.idx"
    )
    last = None
    async for row in conn.cursor(sql, *args, prefetch=64):
        if row["id"] != last:
            bar.update(1)
            last = row["id"]
        trace = StoredTrace(row)
        sink.add(
            {
                **_rollout_fields(row),
                "sequence": row["idx"],
                "advantage": await advantages.of(row["group_id"], row["id"]),
                "input_ids": trace.input_ids,
                "loss_mask": trace.loss_mask,
                "logprobs": trace.logprobs,
                "versions": trace.versions,
                "cause": trace.cause,
                "auxiliary": trace.auxiliary,
                "excluded": trace.excluded,
            },
            tokens=len(trace.input_ids),
        )
    bar.update(bar.total - bar.n)  # rollouts without traces (unmerged) count as done


async def _messages(conn, side, clause, args, sink: Sink, bar) -> None:
    from core.store import bodies
    from core.store import calls as calls_store
    from gateway.conversation import chat_view
    from gateway.protocols.errors import GatewayError

    sql = (
        f"SELECT {_ROLLOUT_COLUMNS}, c.id AS call_id, c.protocol, c.request_base,"
        f" c.request_body, c.response_body FROM (SELECT * FROM rollouts{clause}) r"
        " CROSS JOIN LATERAL (SELECT id, protocol, request_base, request_body, response_body"
        "   FROM calls"
        "   WHERE rollout_id = r.id AND status = 'ok' AND request_body IS NOT NULL"
        "   ORDER BY offered_tools DESC, seq DESC LIMIT 1) c"
        " ORDER BY r.created_at, r.id"
    )
    async for row in conn.cursor(sql, *args, prefetch=32):
        bar.update(1)
        reply = calls_store.decompress_json(row["response_body"])
        states = {}
        if row["protocol"] == "responses":  # previous_response_id chains of this rollout
            states = {
                r["response_id"]: calls_store.decompress_json(r["response_body"])
                for r in await side.fetch(
                    "SELECT response_id, response_body FROM calls WHERE rollout_id = $1"
                    " AND response_id IS NOT NULL",
                    row["id"],
                )
            }
        if row["request_base"] is None:
            request = bodies.unwhole(row["request_body"])
        else:  # a delta: its chain of parent bodies
            request = await calls_store.request_body(side, row["id"], row["call_id"])
        try:
            view = chat_view(row["protocol"], request, reply and reply.get("message"), states.get)
        except GatewayError:
            continue  # a body the gateway refused when it came; nothing to learn from
        if view is None:
            continue
        messages, tools = view
        sink.add(
            {
                **_rollout_fields(row),
                "call_id": str(row["call_id"]),
                "messages": [message_row(m) for m in messages],
                "tools": json.dumps(tools, ensure_ascii=False),
            }
        )
    bar.update(bar.total - bar.n)


def _filter(args: argparse.Namespace):
    from core.store.listing import Filter

    try:
        since = dt.datetime.fromisoformat(args.since).astimezone(dt.UTC) if args.since else None
    except ValueError:
        raise SystemExit(f"rolltap export: --since takes an ISO date or time such as "
                         f"2026-12-01 or 2026-12-01T12:00:00+00:00, not {args.since!r}") from None
    try:
        return Filter(task=args.task, status=args.status, min_reward=args.min_reward,
                      since=since, merged_only=True)
    except ValueError as exc:
        raise SystemExit(f"rolltap export: {exc}") from None


def _dsn(args: argparse.Namespace) -> str:
    if args.database_url:
        return args.database_url
    from core.paths import default_data_dir
    from core.store.db import start_embedded

    data_dir = args.data_dir or Path(os.environ.get("ROLLTAP_DATA_DIR") or default_data_dir())
    print(f"rolltap export: no --database-url; using the embedded Postgres in {data_dir}",
          file=sys.stderr)
    return start_embedded(data_dir)


def _push(paths: dict[str, Path], fmt: str, repo: str) -> None:
    import datasets

    for grain, path in paths.items():
        ds = datasets.load_dataset("parquet" if fmt == "parquet" else "json",
                                   data_files={"train": str(path)}, split="train")
        ds.push_to_hub(repo, config_name=grain)
        print(f"pushed {grain} ({len(ds)} rows) to https://huggingface.co/datasets/{repo}")


def run(args: argparse.Namespace) -> int:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise SystemExit("rolltap export needs pyarrow and datasets: pip install "
                         "'rolltap[export]' (make install does)") from None
    filt = _filter(args)
    grains = GRAINS if args.grain == "both" else (args.grain,)
    try:
        paths = asyncio.run(export(_dsn(args), args.out_dir, filt, grains, args.format,
                                   progress=not args.quiet))
    except OSError as exc:
        raise SystemExit(f"rolltap export: cannot reach the database: {exc}. Check "
                         "--database-url.") from None
    for grain, path in paths.items():
        print(f"{grain}: {path}")
    if args.push_to_hub:
        _push(paths, args.format, args.push_to_hub)
    return 0


def register(subparsers) -> None:
    env = os.environ.get
    parser = subparsers.add_parser(
        "export",
        help="write recorded rollouts as Parquet/JSONL datasets (token rows for RL, message "
        "rows for SFT)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="directory to write into")
    parser.add_argument("--database-url", default=env("ROLLTAP_DATABASE_URL"), metavar="DSN",
                        help="the gateway's Postgres (env ROLLTAP_DATABASE_URL); without it, "
                        "the embedded Postgres in --data-dir")
    parser.add_argument("--data-dir", type=Path, default=None, metavar="DIR",
                        help="the gateway's data directory (env ROLLTAP_DATA_DIR)")
    parser.add_argument("--format", choices=FORMATS, default="parquet",
                        help="file format (default %(default)s)")
    parser.add_argument("--grain", choices=(*GRAINS, "both"), default="both",
                        help="token rows, message rows, or both (default %(default)s)")
    parser.add_argument("--min-reward", type=float, default=None, metavar="R",
                        help="only rollouts with reward >= R (unscorable ones are left out)")
    parser.add_argument("--status", choices=("finished", "failed", "timeout"), default=None,
                        help="only rollouts that ended so (default: any ended and merged)")
    parser.add_argument("--task", default=None, metavar="TASK_ID", help="only this task")
    parser.add_argument("--since", default=None, metavar="ISO_TIME",
                        help="only rollouts created at or after this time, e.g. 2026-12-01 or "
                        "2026-12-01T12:00:00+00:00 (local time if no zone)")
    parser.add_argument("--push-to-hub", default=None, metavar="REPO",
                        help="also upload each grain to the Hugging Face dataset repo REPO "
                        "(needs network and a token)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)
