"""The rollout source: finished rollouts from Postgres into TRL's AsyncGRPO trainer, each trace
taken into exactly one optimizer step. What the trainer sees of it is a `DeliveryWorker`
(trainer_bridge/worker.py); this module is that facade, over the loop that feeds it.

It is TRL's rollout worker without generation: harnesses generate through the gateway, the
gateway merges each finished rollout into traces and announces it. The feeder
(trainer_bridge/feeder.py) wakes on that, waits until a group is due (trainer_bridge/release.py),
claims and releases it, and puts its samples on the trainer's queue (trainer_bridge/handover.py).

Delivery (trainer_bridge/deliveries.py holds the SQL): a sample is not delivered when it is
queued but when an optimizer step has taken it. The trainer acknowledges each step's samples
right after `optimizer.step()` (trainer_bridge/trainer.py); only then does the delivery log
say so, and a rollout is consumed once all its traces are in the log. Until then the feeder
renews the lease of every rollout with samples out (trainer_bridge/outstanding.py). A crash
before the acknowledgement leaves the rollouts to the next claim, which delivers again the
traces not in the log, with the advantages fixed at release; a crash after it delivers nothing
again. A sample is handed to the trainer only while its lease is confirmed for at least half its
length, so a bridge cut off from the database stops training what another bridge may be about
to claim.

Staleness is per token, judged when the trainer takes a sample off the queue: trained tokens
more than `max_staleness` versions behind the trainer are masked out of the loss, the rest of
the sequence trains, and a sample with no fresh token left is put aside (logged 'stale').

Versions: the trainer counts its pushes from 1 (the cold sync before training); the gateway
stamps tokens with `version_offset` + that count (trainer_bridge/versions.py). Token versions
are brought back to the trainer's count, so staleness compares like with like; tokens sampled
before this run began come out at 0 or below, as stale as they are.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import socket
import time
from collections import Counter
from collections.abc import Callable, Sequence
from multiprocessing.queues import Queue as MPQueue
from typing import Any
from uuid import UUID

import numpy as np
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from core.store.conn import Conn
from trainer_bridge import deliveries
from trainer_bridge.feeder import Feeder
from trainer_bridge.handover import DeliveryQueue, OpenBatch
from trainer_bridge.narration import Narrator, Waiting
from trainer_bridge.outstanding import Outstanding
from trainer_bridge.release import Metrics, SourceConfig
from trainer_bridge.worker import DELIVERY_KEY

__all__ = ["DELIVERY_KEY", "RolloutSource", "SourceConfig"]

log = logging.getLogger(__name__)
Ledgers = dict[UUID, dict[str, Any]]


class RolloutSource:
    """A `DeliveryWorker` over the gateway's finished rollouts (see module doc).

    `owner` names this bridge in leases and the delivery log (default: host, pid and a random
    suffix, so a restarted bridge never mistakes a dead one's leases for its own). `decode`
    turns token ids into text for TRL's sample logs. `stats` counts what was delivered and put
    aside, for summaries; `consumed` sums the ledgers of the rollouts this bridge consumed
    (core/store/ledger.py). `say` prints what the bridge waits for and why what it consumed
    trained nothing (trainer_bridge/narration.py).
    """

    def __init__(
        self,
        config: SourceConfig,
        *,
        owner: str | None = None,
        decode: Callable[[np.ndarray], str] | None = None,
        say: Callable[[str], None] = lambda line: print(line, flush=True),
    ) -> None:
        self.config = config
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.outstanding = Outstanding(config.lease_s, config.max_staleness)
        self.open_batch = OpenBatch(config.flush_after_s, config.until_empty)
        # Unbounded on purpose: room is checked before a group is claimed, so handing over a
        # released group never blocks.
        self.delivery_queue = DeliveryQueue(self._take, self.open_batch)
        self.metrics: queue.Queue[Metrics] = queue.Queue()
        # TRL's names for the two queues, typed as TRL's protocol declares them.
        self.rollout_buffer: queue.Queue[Any] | MPQueue[Any] = self.delivery_queue
        self.metrics_queue: queue.Queue[Any] | MPQueue[Any] = self.metrics
        self.narrator = Narrator(num_generations=config.num_generations,
                                 token_budget=config.token_budget,
                                 group_deadline_s=config.group_deadline_s,
                                 flush_after_s=config.flush_after_s,
                                 every_s=config.report_every_s, say=say)
        self.feeder = Feeder(config, self.owner, self.outstanding, self.delivery_queue,
                             self.metrics, self.narrator, decode)
        self.feeder.waiting = self.waiting

    @property
    def stats(self) -> Counter[str]:
        return self.outstanding.stats

    @property
    def consumed(self) -> Counter[str]:
        return self.outstanding.consumed

    # -- TRL's RolloutWorkerProtocol ------------------------------------------------------------

    def start(self) -> None:
        self.feeder.start()

    def stop(self) -> None:
        self.feeder.stop()

    def update_model_version(self, model_version: int) -> None:
        self.outstanding.model_version = model_version

    def check_health(self, stale_after_s: float) -> None:
        feeder = self.feeder
        if feeder.error is not None:
            raise RuntimeError("the rollout source failed; see the chained exception") from (
                feeder.error
            )
        if not feeder.started or not feeder.alive:
            raise RuntimeError("the rollout source is not running")
        age = time.time() - feeder.beat
        if age > stale_after_s:
            raise RuntimeError(f"the rollout source is stuck: no heartbeat for {age:.0f} s")

    # -- the extension: delivery (the trainer's thread) ----------------------------------------

    def _take(self, sample: RolloutSample) -> RolloutSample | None:
        taken, metrics = self.outstanding.take(sample)
        if metrics:
            self.metrics.put(dict(metrics))
        return taken

    def fault(self, keys: Sequence[int]) -> None:
        """The trainer failed on the samples numbered `keys`: their groups count a fault
        (towards `max_attempts`) and their leases go back; the error then ends the run."""
        ids = self.outstanding.rollouts_of(keys)
        if not ids or not self.feeder.alive:
            return  # nothing counts it; the leases run out
        log.error("training failed on samples of %d rollouts; their groups count a fault",
                  len(ids))
        self.feeder.call(lambda conn: deliveries.release(conn, self.owner, ids, fault=True),
                         "counting a training fault")

    def acknowledge(self, step: int, keys: Sequence[int]) -> None:
        """Log that optimizer step `step` took the samples numbered `keys`: called by the
        trainer after the step, it returns once the delivery log holds them (retrying through
        database errors)."""
        entries, trained = self.outstanding.step_entries(keys)
        if not entries:
            return

        async def log_step(conn: Conn) -> tuple[set[UUID], Ledgers]:
            lost = await deliveries.acknowledge(conn, self.owner, step, entries)
            return lost, await deliveries.ledgers(conn, list({e.rollout_id for e in entries}))

        # Nothing can log it when the feeder is gone: the next claim delivers these again.
        lost, ledgers = self.feeder.call(log_step, f"acknowledging step {step}")
        self.narrator.stepped()
        self.outstanding.stepped(entries, trained, ledgers)
        if lost:
            self._trained_without_lease(step, lost)

    def _trained_without_lease(self, step: int, lost: set[UUID]) -> None:
        # Trained, but the lease had run out: another bridge may train these too. The delivery
        # log marks them (leased = false).
        log.error("step %d trained %d rollouts whose lease this bridge no longer held: %s",
                  step, len(lost), ", ".join(sorted(map(str, lost))))
        self.outstanding.count(trained_without_lease=len(lost))
        self.metrics.put({"rollout/trained_without_lease_total": float(len(lost))})

    def waiting(self) -> Waiting:
        """What is out for the trainer and not in a logged step yet, what the trainer holds
        open, and what waits for members."""
        out = self.outstanding.snapshot()
        gathering, gathered, deadline_in = self.feeder.gathering
        return Waiting(
            trainer_waiting=self.delivery_queue.trainer_waiting,
            samples=len(out),
            taken=sum(p.taken for p in out),
            gathering=gathering,
            gathered=gathered,
            deadline_in_s=deadline_in,
            held=self.open_batch.held,
            flush_in_s=self.open_batch.flush_in(),
            queued=self.delivery_queue.qsize(),
        )
