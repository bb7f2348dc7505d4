"""The long-lived components of one gateway process: built from the configuration, set on the
application under their keys (`gateway.app_keys`), started before it serves and closed after
(aiohttp's cleanup_ctx), with the deadline sweep running between."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING
from uuid import UUID

import asyncpg
from aiohttp import web

from core.merge import MAX_CALLS
from core.store import calls as calls_store
from core.store import rollouts as rollouts_store
from core.store import traces as traces_store
from gateway import app_keys
from gateway.admission import Admission
from gateway.auth import RolloutKeys
from gateway.config import GatewayConfig
from gateway.continuation.checked_render import CheckedRenderer
from gateway.continuation.engine_render import EngineRenderer
from gateway.continuation.local_template import LocalTemplate, Unsupported
from gateway.continuation.planner import Continuer
from gateway.continuation.rendering import RenderError
from gateway.continuation.window import WindowedRenderer
from gateway.finalize import merge_rollout
from gateway.health import DatabaseCheck, database_health
from gateway.metrics import Metrics
from gateway.notifications import Notifications
from gateway.pipeline import Pipeline
from gateway.policy_version import PolicyVersion
from gateway.recording import Recorder, Recording
from gateway.rollout_memory import RolloutMemory
from gateway.served_models import ServedModels
from gateway.upstream import Upstreams

if TYPE_CHECKING:
    from core.store.conn import Conn

log = logging.getLogger(__name__)

_SWEEP_INTERVAL_S = 5.0


def _renderer(config: GatewayConfig, upstreams: Upstreams) -> EngineRenderer | CheckedRenderer:
    engine = EngineRenderer(upstreams)
    if config.local_template is None:
        return engine
    try:
        local = LocalTemplate.from_model_dir(config.local_template)
    except Unsupported as exc:
        log.warning("not rendering locally (%s): %s", config.local_template, exc)
        return engine
    return CheckedRenderer(engine, local)


class Runtime:
    def __init__(self, config: GatewayConfig, pool: asyncpg.Pool) -> None:
        self.config = config
        self.pool = pool
        self.recorder = Recorder(
            pool,
            max_pending=config.max_pending_records,
            command_timeout_s=config.db_command_timeout_s,
            limits=calls_store.Limits(MAX_CALLS, int(config.rollout_max_stored_mb * (1 << 20))),
        )
        self.upstreams = Upstreams(
            config.upstreams,
            config.upstream_timeout_s,
            eject_after=config.eject_after,
            probe_interval_s=config.probe_interval_s,
            replica_max_inflight=config.replica_max_inflight,
        )
        self.keys = RolloutKeys(pool)
        self.database_check = DatabaseCheck(
            lambda: database_health(pool, lambda: self.recorder.down))
        self.memory = RolloutMemory(config.recent_calls_mib << 20)
        self.policy = PolicyVersion()
        self.models = ServedModels(self.upstreams)
        self.admission = Admission(config.max_inflight, config.rollout_max_inflight,
                                   config.rollout_max_rps)
        self.metrics = Metrics()
        self.renderer = _renderer(config, self.upstreams)
        planner = Continuer(
            config.continuation, pool, self.memory, WindowedRenderer(self.renderer)
        )
        recording = Recording(
            pool, self.recorder, self.memory, config.record_bodies, self.metrics.call_recorded
        )
        self.pipeline = Pipeline(
            config, pool, self.upstreams, planner, recording, self.memory, self.admission,
            self.policy, self.models, self.metrics,
        )  # fmt: skip
        self.metrics.watch(
            lambda: self.upstreams.replicas.values(),
            lambda: self.recorder.pending,
            lambda: self.admission.in_flight,
            lambda: self.policy.value,
            self.pipeline.cpu,
        )
        self.recorder.on_commit = self.metrics.committed
        self.notifications = Notifications(pool)
        self.notifications.on(rollouts_store.POLICY_CHANNEL, self.policy.notified)
        self.notifications.on_connect(self.policy.read)
        self.notifications.on(rollouts_store.ENDED_CHANNEL, self._rollout_ended)
        self.notifications.on_connect(self._listening_for_ends)
        self.notifications.on_lost(lambda: self.keys.listening(False))

    def install(self, app: web.Application) -> None:
        app[app_keys.CONFIG] = self.config
        app[app_keys.POOL] = self.pool
        app[app_keys.UPSTREAMS] = self.upstreams
        app[app_keys.ROLLOUT_KEYS] = self.keys
        app[app_keys.MEMORY] = self.memory
        app[app_keys.POLICY] = self.policy
        app[app_keys.MODELS] = self.models
        app[app_keys.METRICS] = self.metrics
        app[app_keys.RECORDER] = self.recorder
        app[app_keys.ADMISSION] = self.admission
        app[app_keys.DATABASE_CHECK] = self.database_check
        app[app_keys.PIPELINE] = self.pipeline
        app.cleanup_ctx.append(self._lifecycle)

    async def _lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        await self._start()
        sweeper = asyncio.create_task(self._end_overdue())
        yield
        sweeper.cancel()
        await self.notifications.stop()
        await self.recorder.close()
        await self.upstreams.close()

    async def _start(self) -> None:
        await self.upstreams.open()
        self.recorder.start()
        await self.notifications.start()
        await self.models.refresh()
        if isinstance(self.renderer, CheckedRenderer):
            for url in self.upstreams.urls:
                for model in self.models.names:
                    try:
                        await asyncio.wait_for(self.renderer.self_check(url, model), 30)
                    except (RenderError, TimeoutError) as exc:  # checked again on first use
                        log.warning("local template self-check on %s failed: %r", url, exc)

    async def _listening_for_ends(self, conn: Conn) -> None:
        self.keys.listening(True)

    def _rollout_ended(self, payload: str) -> None:
        """Another gateway (or this one) ended a rollout: its key and calls are not kept."""
        rollout_id = UUID(payload)
        self.keys.ended(rollout_id)
        self.memory.forget(rollout_id)

    async def _end_overdue(self) -> None:
        """Rollouts past their deadline end as `timeout` and are merged; ended rollouts left
        unmerged by a gateway that died are merged too. Safe with several gateways: the UPDATE
        picks each rollout once, and merging is idempotent."""
        while True:
            await asyncio.sleep(_SWEEP_INTERVAL_S)
            try:
                async with self.pool.acquire() as conn:
                    for rollout_id in await rollouts_store.expire_overdue(conn):
                        self.keys.forget(rollout_id)
                        self.memory.forget(rollout_id)
                    pending = await traces_store.unmerged(conn)
                for rollout_id in pending:
                    # A rollout that cannot be merged is marked so by merge_rollout; nothing one
                    # rollout holds may stop the sweep of the others.
                    await merge_rollout(self.pool, rollout_id, self.config.merge_options)
            except Exception:  # noqa: BLE001 - the sweeper must outlive any single failure
                log.exception("deadline sweep failed; retrying")
