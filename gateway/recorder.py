"""Group commit: calls finishing at about the same time share one transaction.

A request handler awaits `record()`, which returns only once its row is committed, so nothing
is acknowledged to a client before it is durable (invariant 2). One writer task drains
everything queued while the previous transaction was in flight, so under load one commit (one
fsync) covers many calls, and at low load a call waits for exactly one commit.
"""

from __future__ import annotations

import asyncio
import logging
import time

import asyncpg

from gateway.store import calls as calls_store

log = logging.getLogger(__name__)


class RecorderStats:
    __slots__ = ("commits", "records", "commit_seconds", "largest_batch")

    def __init__(self) -> None:
        self.commits = 0
        self.records = 0
        self.commit_seconds = 0.0
        self.largest_batch = 0


class Recorder:
    def __init__(self, pool: asyncpg.Pool, max_batch: int = 512) -> None:
        self._pool = pool
        self._max_batch = max_batch
        self._queue: asyncio.Queue[tuple[calls_store.CallRecord, asyncio.Future]] = asyncio.Queue()
        self._writer: asyncio.Task | None = None
        self.stats = RecorderStats()
        self.on_commit = None  # (batch size, seconds) -> None; the metrics hook

    @property
    def depth(self) -> int:
        """Records waiting for a commit."""
        return self._queue.qsize()

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

    async def record(self, rec: calls_store.CallRecord) -> None:
        """Returns once `rec` is committed; raises if the commit failed."""
        fut = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((rec, fut))
        # Shielded: a client that goes away must not cancel the commit of its own call.
        await asyncio.shield(fut)

    async def _write_forever(self) -> None:
        # The writer keeps one connection: acquiring from the pool per commit costs a reset
        # query round trip on release, which every waiting call would sit through.
        conn = None
        try:
            while True:
                batch = [await self._queue.get()]
                while len(batch) < self._max_batch and not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                started = time.perf_counter()
                try:
                    if conn is None:
                        conn = await self._pool.acquire()
                    # One statement, atomic on its own (asyncpg runs executemany in an implicit
                    # transaction): no BEGIN/COMMIT round trips.
                    await conn.executemany(
                        calls_store.INSERT, [calls_store.insert_args(rec) for rec, _ in batch]
                    )
                except Exception as exc:  # every waiter must hear of the failure
                    log.exception("commit of %d call records failed", len(batch))
                    if conn is not None:
                        await self._pool.release(conn)
                        conn = None  # a broken connection is replaced on the next batch
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_exception(exc)
                else:
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_result(None)
                    st = self.stats
                    elapsed = time.perf_counter() - started
                    st.commits += 1
                    st.records += len(batch)
                    st.commit_seconds += elapsed
                    st.largest_batch = max(st.largest_batch, len(batch))
                    if self.on_commit is not None:
                        self.on_commit(len(batch), elapsed)
                finally:
                    for _ in batch:
                        self._queue.task_done()
        finally:
            if conn is not None:
                await self._pool.release(conn)
