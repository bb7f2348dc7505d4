"""The feeder: the rollout source's loop, in a thread of its own with its own event loop.

It wakes on every finished rollout (LISTEN on `FINISHED_CHANNEL`, with polling should that
connection drop), renews the leases of rollouts with samples out, looks at the groups waiting
for delivery, and for each one the release policy (trainer_bridge/release.py) says is due:
claims it with a lease, releases it (its advantages fixed in the database first), and puts its
samples on the trainer's queue. Transient database errors are retried with backoff; a group
whose claims failed `max_attempts` times is quarantined and reported. The trainer's thread
runs its database work here too (`call`), so one pool serves both.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import TypeVar
from uuid import UUID

import asyncpg
import numpy as np

from core.store.conn import Conn
from core.store.db import open_pool
from core.store.traces import FINISHED_CHANNEL
from trainer_bridge import deliveries
from trainer_bridge.faults import crash_point
from trainer_bridge.handover import DeliveryQueue, Fit
from trainer_bridge.narration import Narrator, Waiting, group_account
from trainer_bridge.outstanding import Outstanding
from trainer_bridge.release import (
    GroupBatch,
    Member,
    Metrics,
    PendingGroup,
    Release,
    SourceConfig,
    build_group,
    decide,
    group_number,
    plan_release,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
# How often a full trainer queue is looked at again: the trainer drains it without telling us.
_ROOM_POLL_S = 0.2


class Backoff:
    """Retry pacing for database errors: doubling pauses, and a give-up after `give_up_s` of
    nothing but failures."""

    def __init__(self, give_up_s: float) -> None:
        self.give_up_s = give_up_s
        self._failing_since: float | None = None
        self._delay = 0.1

    def ok(self) -> None:
        self._failing_since, self._delay = None, 0.1

    def failed(self, what: str, exc: BaseException) -> float:
        """The pause before the next try; raises `exc` once failures lasted `give_up_s`."""
        now = time.monotonic()
        self._failing_since = self._failing_since or now
        if now - self._failing_since >= self.give_up_s:
            raise exc
        delay, self._delay = self._delay, min(self._delay * 2, 5.0)
        log.warning("%s failed (%s: %s); retrying in %.1f s", what, type(exc).__name__, exc, delay)
        return delay


class Feeder:
    """The loop that feeds `buffer` from the database (module doc)."""

    def __init__(
        self,
        config: SourceConfig,
        owner: str,
        outstanding: Outstanding,
        buffer: DeliveryQueue,
        metrics: queue.Queue[Metrics],
        narrator: Narrator,
        decode: Callable[[np.ndarray], str] | None,
    ) -> None:
        self.config, self.owner, self.outstanding = config, owner, outstanding
        self.buffer, self.metrics, self.narrator, self.decode = buffer, metrics, narrator, decode
        self.error: BaseException | None = None
        self.beat = time.time()
        # Groups waiting for members, their finished rollouts, seconds to the first deadline.
        self.gathering: tuple[int, int, float | None] = (0, 0, None)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._pool: asyncpg.Pool | None = None
        self._renewed_at = 0.0
        self.waiting: Callable[[], Waiting] = lambda: Waiting(0, 0)

    # -- the thread ---------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the rollout source was already started")
        self.beat = time.time()
        self._thread = threading.Thread(target=self._run, name="rolltap-rollout-source",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._nudge()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def alive(self) -> bool:
        # The thread, not its loop: right after start() the loop does not exist yet, and a
        # health check then must not take the feeder for dead.
        return self._thread is not None and self._thread.is_alive()

    def call(self, op: Callable[[Conn], Awaitable[T]], what: str) -> T:
        """`op` on a pooled connection from another thread, retried through transient
        database errors; returns its result."""
        loop = self._loop
        if loop is None or not self.alive:
            raise RuntimeError(f"{what}: the rollout source is not running") from self.error
        return asyncio.run_coroutine_threadsafe(self._retry(op, what), loop).result()

    def _nudge(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the feeder's loop already ended: nothing left to wake
                pass

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # surfaced to the trainer by check_health
            log.exception("rollout source failed")
            self.error = exc

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = wake = asyncio.Event()
        backoff = Backoff(self.config.db_give_up_s)
        while self._pool is None:
            try:
                self._pool = await open_pool(self.config.database_url, min_size=1, max_size=3)
            except deliveries.TRANSIENT as exc:
                self.beat = time.time()
                await asyncio.sleep(backoff.failed("connecting to the database", exc))
        listener = None
        try:
            while not self._stop.is_set():
                self.beat = time.time()
                if listener is None or listener.is_closed():
                    listener = await self._listen(wake)
                # Cleared before looking, so a NOTIFY that lands while we look runs us again.
                wake.clear()
                try:
                    await self._keep_leases(self._pool)
                    wait_s = await self._feed(self._pool)
                    backoff.ok()
                    self.narrator.tick(self.waiting())
                except deliveries.TRANSIENT as exc:
                    self.outstanding.count(db_errors=1)
                    wait_s = backoff.failed("looking for rollouts", exc)
                timeout = min(wait_s, self.config.poll_interval_s, self.config.lease_s / 4)
                try:
                    await asyncio.wait_for(wake.wait(), timeout)
                except TimeoutError:
                    pass
        finally:
            await self._give_back(self._pool)
            if listener is not None and not listener.is_closed():
                await listener.close()
            await self._pool.close()

    async def _retry(self, op: Callable[[Conn], Awaitable[T]], what: str) -> T:
        backoff = Backoff(self.config.db_give_up_s)
        while True:
            try:
                assert self._pool is not None  # `alive` implies the pool is open
                async with self._pool.acquire() as conn:
                    return await op(conn)
            except deliveries.TRANSIENT as exc:
                self.outstanding.count(db_errors=1)
                await asyncio.sleep(backoff.failed(what, exc))

    async def _listen(self, wake: asyncio.Event) -> asyncpg.Connection | None:
        """A connection that wakes the feeder on every finished rollout; None if it cannot be
        opened now (polling covers until the next attempt)."""
        try:
            conn = await asyncpg.connect(self.config.database_url)
            await conn.add_listener(FINISHED_CHANNEL, lambda *_: wake.set())
            return conn
        except (OSError, asyncpg.PostgresError) as exc:
            log.warning("cannot LISTEN for finished rollouts (%s); polling instead", exc)
            return None

    # -- leases -------------------------------------------------------------------------------

    async def _keep_leases(self, pool: asyncpg.Pool) -> None:
        """Renew the lease of every rollout with samples out; give back abandoned ones."""
        now = time.monotonic()
        if now - self._renewed_at < self.config.lease_s / 4:
            return
        renew, give_back = self.outstanding.leases_due()
        if renew:
            async with pool.acquire() as conn:
                held = await deliveries.renew(conn, self.owner, renew, self.config.lease_s)
            self.outstanding.renewed(renew, held, now)
        if give_back:
            async with pool.acquire() as conn:
                await deliveries.release(conn, self.owner, give_back)
            self.outstanding.given_back(give_back)
        self._renewed_at = now

    async def _give_back(self, pool: asyncpg.Pool) -> None:
        """On stop: leases of rollouts whose samples no step took go back at once, so the next
        bridge need not wait them out (best effort; they run out anyway)."""
        out = self.outstanding.leased()
        if not out:
            return
        try:
            async with pool.acquire() as conn:
                await deliveries.release(conn, self.owner, out)
        except deliveries.TRANSIENT as exc:
            log.warning("could not give back %d leases (%s); they run out by themselves",
                        len(out), exc)

    # -- groups -------------------------------------------------------------------------------

    def _room(self) -> bool:
        return self.buffer.qsize() < self.config.queue_size

    async def _feed(self, pool: asyncpg.Pool) -> float:
        """Release every group that is due while the queue has room; returns how long to wait."""
        open_batch = self.buffer.open_batch
        if open_batch.run_full():
            return math.inf  # this run trains nothing more
        if open_batch.closing:
            if not self.buffer.drained():
                return _ROOM_POLL_S  # the group that did not fit waits for an idle trainer
            open_batch.closing = False
        if not self._room() or open_batch.waiting_for_trainer():
            return _ROOM_POLL_S
        async with pool.acquire() as conn:
            groups = await deliveries.pending_groups(conn, self.config.match)
        self._look(groups)
        wait_s = math.inf
        for group in groups:
            if self._stop.is_set():
                break
            if not self._room():
                return _ROOM_POLL_S
            if open_batch.run_full() or open_batch.closing:
                return _ROOM_POLL_S
            if group.leased:
                continue
            decision = decide(group.ready, group.waited_s, group.released, self.config)
            if decision is Release.WAIT:
                wait_s = min(wait_s, self.config.group_deadline_s - group.waited_s)
                continue
            await self._release(pool, group.group_key, decision)
        return max(wait_s, 0.0)

    def _look(self, groups: Sequence[PendingGroup]) -> None:
        gathering = [g for g in groups if not g.leased and not g.released
                     and g.ready < self.config.num_generations]
        self.gathering = (
            len(gathering),
            sum(g.ready for g in gathering),
            min((self.config.group_deadline_s - g.waited_s for g in gathering), default=None),
        )
        # Nothing deliverable, under anyone's lease or not, and nothing queued for the trainer.
        self.buffer.open_batch.source_empty = not groups and self.buffer.empty()

    async def _release(self, pool: asyncpg.Pool, group_key: str, decision: Release) -> None:
        config = self.config
        async with pool.acquire() as conn:
            members = await deliveries.claim_group(
                conn, self.owner, group_key, config.match, config.lease_s
            )
            if members is None:  # another bridge is on it
                return
            claimed_at = time.monotonic()
            crash_point("after_claim")
            ids = [m.id for m in members]
            faults = max(m.delivery_attempts for m in members)
            if faults >= config.max_attempts:
                await deliveries.quarantine(conn, self.owner, ids)
                self._report_quarantine(group_key, ids, faults)
                return
            if decision is Release.PARTIAL and len(members) >= config.num_generations:
                decision = Release.COMPLETE  # the rest arrived since we looked
            try:
                advantages, dropped = plan_release(members, decision, config)
                training = [m for m in members if m.id in advantages]
                traces = await deliveries.undelivered_traces(conn, list(advantages))
                batch = build_group(training, advantages, traces, group_id=group_number(group_key),
                                    config=config, decode=self.decode)
                fit = self.buffer.fit(batch.samples)
                if fit is Fit.LATER:
                    # Its samples would be taken and not all trained: given back until the
                    # trainer holds nothing, the open micro-batch trains first.
                    await deliveries.release(conn, self.owner, ids)
                    self.buffer.open_batch.closing = True
                    log.info("group %s waits: the steps left (--max-steps) train it only after "
                             "what the trainer holds", group_key)
                    return
                await deliveries.release_group(conn, self.owner, advantages, dropped,
                                               batch.skipped)
                # Dropped members, and members with nothing to deliver, are consumed now.
                ledgers = await deliveries.ledgers(conn, ids)
            except deliveries.LeaseLost as exc:
                # The lease ran out and another bridge took the group: it delivers it.
                log.warning("group %s: %s; leaving it to the new owner", group_key, exc)
                self.outstanding.count(lease_lost=1)
                self.metrics.put({"rollout/lease_lost_total": 1.0})
                return
            except deliveries.TRANSIENT:
                raise  # the lease runs out, and the group is claimed again
            except Exception:
                # Bad data (or a bug) in this group: give it back and go on with the others. It
                # counts as a fault, so a group that always fails ends in quarantine.
                log.exception("group %s failed (attempt %d of %d)", group_key, faults + 1,
                              config.max_attempts)
                self.outstanding.count(failed_claims=1)
                self.metrics.put({"rollout/failed_claims_total": 1.0})
                await deliveries.release(conn, self.owner, ids, fault=True)
                return
        self.outstanding.add(batch, claimed_at)
        for sample in batch.samples:
            self.buffer.put_nowait(sample)
        if fit is Fit.PART:
            log.info("group %s is bigger than all the steps left (--max-steps): what fits "
                     "trains, the rest goes back; the run takes nothing more", group_key)
            self.buffer.open_batch.taken_all = True
        crash_point("after_put")
        self._account(decision, members, dropped, batch)
        self.outstanding.count_consumed(ledgers)
        offered = [(out.rollout_id, "trained", int(np.count_nonzero(sample.completion_mask)), 0)
                   for sample, out in zip(batch.samples, batch.pending, strict=True)]
        aside = [(e.rollout_id, e.outcome, e.trained_tokens, e.excluded_tokens)
                 for e in batch.skipped]
        trained, excluded = group_account(members, advantages, dropped, [*offered, *aside])
        self.narrator.group_released(group_key, len(members), trained, excluded)

    def _report_quarantine(self, group_key: str, ids: list[UUID], faults: int) -> None:
        log.error(
            "group %s quarantined after %d failed delivery attempts; its rollouts (%s) are left "
            "out of training. Inspect them (rollouts.quarantined_at), then clear quarantined_at "
            "and delivery_attempts to deliver them again.",
            group_key, faults, ", ".join(map(str, ids)),
        )
        self.outstanding.count(quarantined_groups=1, quarantined_rollouts=len(ids))
        self.metrics.put({"rollout/quarantined_groups_total": 1.0,
                          "rollout/quarantined_rollouts_total": float(len(ids))})

    def _account(
        self, decision: Release, members: Sequence[Member], dropped: list[UUID], batch: GroupBatch
    ) -> None:
        counts = batch.counts
        metrics: Metrics = {}
        if counts["rollouts"]:
            self.outstanding.count(
                groups=1, partial_groups=decision is Release.PARTIAL,
                redelivered_groups=decision is Release.REDELIVER, rollouts=counts["rollouts"],
                samples=counts["samples"], too_long=counts["too_long"],
                untrained=counts["untrained"], unscorable=counts["unscorable"])
            now = datetime.now(UTC)
            waited = [(now - m.finished_at).total_seconds() for m in members
                      if m.finished_at is not None and m.id not in dropped]
            metrics.update(batch.metrics)
            metrics["rollout/partial_groups_total"] = float(decision is Release.PARTIAL)
            metrics["rollout/redelivered_groups_total"] = float(decision is Release.REDELIVER)
            if waited:
                metrics["rollout/finish_to_queue_s"] = float(np.mean(waited))
                metrics["rollout/finish_to_queue_s_max"] = float(np.max(waited))
        if dropped:
            late = decision is Release.REDELIVER
            self.outstanding.count(dropped_groups=not counts["rollouts"],
                                   dropped_rollouts=len(dropped))
            metrics["rollout/dropped_groups_total"] = float(not counts["rollouts"])
            metrics["rollout/dropped_rollouts_total"] = float(len(dropped))
            metrics["rollout/late_rollouts_total"] = float(len(dropped) if late else 0)
        self.metrics.put(metrics)

