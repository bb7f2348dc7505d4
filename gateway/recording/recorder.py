"""Group commit: calls finishing at about the same time share one transaction.

A request handler awaits `record()`, which returns only once its row is committed, so nothing
is acknowledged to a client before it is durable (invariant 2). One writer task drains
everything queued while the previous transaction was in flight, so under load one commit (one
fsync) covers many calls, and at low load a call waits for exactly one commit.

A batch the database refuses is written again row by row, so one bad row fails only its own
call. The queue is bounded and the writer knows when the database is unreachable: `admit()`
then turns new calls away at once, before the engine spends time on them, and the writer probes
the database until it answers again.

The wait for a commit is bounded (`commit_wait_s`): a frozen database answers nothing, and a call
must not hang on it. A call whose commit does not come in time is answered `Stalled`, and new calls
are turned away while the commit in flight is that late. A record whose commit failed because the
database was away or stalled is held and written once it answers again (its primary key makes a
second write of a row that did commit a refusal, not a duplicate): its client was told to retry,
the engine's work is still on record, and the merge reads the retry as one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import asyncpg  # pyright: ignore[reportMissingTypeStubs] - asyncpg ships no type stubs

from core.store import calls as calls_store
from core.store.db import UNAVAILABLE

if TYPE_CHECKING:
    from core.store.conn import Conn, Connection, Pool

log = logging.getLogger(__name__)

_PROBE_INTERVAL_S = 0.5


class RecorderStats:
    __slots__ = ("commits", "records", "commit_seconds", "largest_batch", "row_retries", "refused")

    def __init__(self) -> None:
        self.commits = 0
        self.records = 0
        self.commit_seconds = 0.0
        self.largest_batch = 0
        self.row_retries = 0  # batches the database refused, written again row by row
        self.refused = 0  # rows refused on their own


class Unavailable(Exception):
    """The database could not be reached or did not answer in time; the row is held and written
    once it answers again."""


class Stalled(Unavailable):
    """The commit did not come within the bound; the row is written once the database answers."""


class Recorder:
    def __init__(
        self,
        pool: Pool,
        max_batch: int = 512,
        max_pending: int = 4096,
        command_timeout_s: float | None = None,
        limits: calls_store.Limits = calls_store.NO_LIMITS,
        commit_wait_s: float | None = None,
    ) -> None:
        self._pool = pool
        self._limits = limits
        self._max_batch = max_batch
        self.max_pending = max_pending
        self._timeout = command_timeout_s
        self._queue: asyncio.Queue[tuple[calls_store.CallRecord, asyncio.Future[None]]] = (
            asyncio.Queue()
        )
        self._writer: asyncio.Task[None] | None = None
        self._in_flight = 0
        self.commit_wait_s = commit_wait_s
        self._writing_since: float | None = None  # when the commit in flight began
        # Records whose commit failed while the database was away, to write when it is back.
        self._held: deque[calls_store.CallRecord] = deque()
        self.dropped = 0  # held records given up: more than max_pending were held
        self._dropping: set[asyncio.Task[None]] = set()
        self.stats = RecorderStats()
        # Why the database is unusable, or None; set by a failed commit, cleared by a commit
        # or a probe that succeeds.
        self.down: str | None = None
        self.on_commit: Callable[[int, float], None] | None = None  # the metrics hook

    @property
    def pending(self) -> int:
        """Records waiting for their commit: queued, held, and in the transaction in flight."""
        return self._queue.qsize() + len(self._held) + self._in_flight

    def start(self) -> None:
        self._writer = asyncio.create_task(self._write_forever(), name="rolltap-recorder")

    async def close(self) -> None:
        """Commits what is queued, then stops."""
        if self._writer is None:
            return
        await self._queue.join()
        self._writer.cancel()
        try:
            await self._writer
        except asyncio.CancelledError:
            pass
        self._writer = None

    def trouble(self) -> str | None:
        """Why the database cannot take records now (away, or stalled), or None."""
        if self.down is not None:
            return self.down
        since = self._writing_since
        if since is not None and self.commit_wait_s is not None:
            waited = time.monotonic() - since
            if waited > self.commit_wait_s:
                return f"database stalled: a commit has waited {waited:.1f} s"
        return None

    def busy(self) -> str | None:
        """Why a new call should not start now, or None."""
        trouble = self.trouble()
        if trouble is not None:
            return f"database unavailable ({trouble})"
        if self.pending >= self.max_pending:
            return f"{self.pending} call records wait for the database"
        return None

    async def record(self, rec: calls_store.CallRecord) -> None:
        """Returns once `rec` is committed; raises `Unavailable`, or the database's error for
        this row, if it was not."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(_heard)
        self._queue.put_nowait((rec, fut))
        # Shielded: a client that goes away (or a wait past the bound) must not cancel the
        # commit of its own call.
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.commit_wait_s)
        except TimeoutError:
            raise Stalled(f"database stalled: no commit within the gateway's --commit-wait of "
                          f"{self.commit_wait_s:g} s") from None

    async def _next_batch(self) -> list[tuple[calls_store.CallRecord, asyncio.Future[None]]]:
        while self.down is not None:
            # Records that arrive while the database is away fail at once (their calls get
            # 503 now, not after another timeout); a probe decides when it is back.
            while not self._queue.empty():
                rec, fut = self._queue.get_nowait()
                self._hold(rec)
                _settle(fut, Unavailable(self.down))
                self._queue.task_done()
            await self._probe()
            # pyright keeps the loop's narrowing to str across the await; _probe() resets it.
            if self.down is not None:  # pyright: ignore[reportUnnecessaryComparison]
                await asyncio.sleep(_PROBE_INTERVAL_S)
        batch: list[tuple[calls_store.CallRecord, asyncio.Future[None]]] = []
        while self._held and len(batch) < self._max_batch:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            fut.add_done_callback(_heard)
            self._queue.put_nowait((self._held.popleft(), fut))
        batch.append(await self._queue.get())
        while len(batch) < self._max_batch and not self._queue.empty():
            batch.append(self._queue.get_nowait())
        return batch

    def _hold(self, rec: calls_store.CallRecord) -> None:
        if len(self._held) >= self.max_pending:
            self.dropped += 1
            log.error("call record %s dropped: more than %d records wait for the database",
                      rec.id, self.max_pending)
            return
        self._held.append(rec)

    async def _probe(self) -> None:
        try:
            async with self._pool.acquire() as conn:
                # asyncpg ships no stubs: its connection methods are untyped.
                await cast("Connection", conn).fetchval("SELECT 1", timeout=self._timeout)
        except Exception as exc:  # noqa: BLE001 - any failure means: not back yet
            self.down = _reason(exc)
        else:
            log.info("database reachable again")
            self.down = None

    async def _write_forever(self) -> None:
        # The writer keeps one connection: acquiring from the pool per commit costs a reset
        # query round trip on release, which every waiting call would sit through.
        conn: Conn | None = None
        try:
            while True:
                batch = await self._next_batch()
                self._in_flight = len(batch)
                self._writing_since = time.monotonic()
                started = time.perf_counter()
                try:
                    if conn is None:
                        conn = await self._pool.acquire()
                    await self._write(cast("Connection", conn), batch)
                except Exception as exc:  # noqa: BLE001 - every waiter must hear; the writer lives
                    if isinstance(exc, UNAVAILABLE):
                        log.error("commit of %d call records failed: %r", len(batch), exc)
                    else:  # not the database being away: a bug, logged with its traceback
                        log.exception("commit of %d call records failed", len(batch))
                    self.down = _reason(exc)
                    # The waiting calls hear first: dropping a connection to a frozen server
                    # can itself take until the timeout.
                    # Only a record that is held hears `Unavailable` (written later); one a
                    # bug failed hears the bug.
                    held = isinstance(exc, UNAVAILABLE)
                    for rec, fut in batch:
                        if held and not fut.done():
                            self._hold(rec)
                        _settle(fut, Unavailable(self.down) if held else exc)
                    if conn is not None:
                        # In the background, for the same reason.
                        self._dropping.add(asyncio.create_task(_drop(self._pool, conn)))
                        self._dropping = {t for t in self._dropping if not t.done()}
                        conn = None  # replaced on the next batch
                else:
                    self.down = None
                    st = self.stats
                    elapsed = time.perf_counter() - started
                    st.commits += 1
                    st.records += len(batch)
                    st.commit_seconds += elapsed
                    st.largest_batch = max(st.largest_batch, len(batch))
                    if self.on_commit is not None:
                        self.on_commit(len(batch), elapsed)
                finally:
                    self._in_flight = 0
                    self._writing_since = None
                    for _ in batch:
                        self._queue.task_done()
        finally:
            if conn is not None:
                await _drop(self._pool, conn)

    async def _write(
        self, conn: Connection, batch: list[tuple[calls_store.CallRecord, asyncio.Future[None]]]
    ) -> None:
        """One statement for the batch, atomic on its own (asyncpg runs executemany in an
        implicit transaction: no BEGIN/COMMIT round trips); row by row if it is refused."""
        try:
            await conn.executemany(
                calls_store.INSERT,
                [calls_store.insert_args(rec, self._limits) for rec, _ in batch],
                timeout=self._timeout,
            )
        except UNAVAILABLE:
            raise
        except asyncpg.PostgresError as exc:
            if len(batch) == 1:
                self.stats.refused += 1
                _settle(batch[0][1], exc)
                return
            log.warning("batch of %d call records refused (%r); row by row", len(batch), exc)
            self.stats.row_retries += 1
            for rec, fut in batch:
                try:
                    await conn.execute(
                        calls_store.INSERT, *calls_store.insert_args(rec, self._limits),
                        timeout=self._timeout,
                    )
                except UNAVAILABLE:
                    raise
                except asyncpg.PostgresError as row_exc:
                    self.stats.refused += 1
                    _settle(fut, row_exc)
                else:
                    _settle(fut, None)
        else:
            for _, fut in batch:
                _settle(fut, None)


def _settle(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def _heard(fut: asyncio.Future[None]) -> None:
    """Marks a record's outcome as heard: its waiter may have left (answered `Stalled`, or a
    held record has none), and asyncio would log an exception nobody retrieved."""
    if not fut.cancelled():
        fut.exception()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        # Connected, but no answer: a frozen or overwhelmed server, not a stopped one.
        return "database stalled: no answer within --db-command-timeout"
    return str(exc) or type(exc).__name__


async def _drop(pool: Pool, conn: Conn) -> None:
    """Gives a connection that failed back to the pool, which closes it if it is broken."""
    try:
        await pool.release(conn)
    except Exception:  # noqa: BLE001 - the pool terminates a connection it cannot reset
        pass
