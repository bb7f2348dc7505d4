"""The long-lived parts of one gateway process, built at start-up and shared by all handlers."""

from __future__ import annotations

import asyncio
import logging
import time
from uuid import UUID

import asyncpg

from gateway.auth import RolloutKeys
from gateway.config import GatewayConfig
from gateway.continuation.checked_render import CheckedRenderer
from gateway.continuation.engine_render import EngineRenderer, RenderError
from gateway.continuation.local_template import LocalTemplate, Unsupported
from gateway.continuation.planner import Continuer
from gateway.continuation.window import WindowedRenderer
from gateway.metrics import Metrics
from gateway.notifications import Notifications
from gateway.protocols.errors import GatewayError
from gateway.recording import Recorder, Recording
from gateway.store import rollouts as rollouts_store
from gateway.store.tokens import RecentCalls
from gateway.upstream import Upstreams

log = logging.getLogger(__name__)


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


class Services:
    def __init__(self, config: GatewayConfig, pool: asyncpg.Pool) -> None:
        self.config = config
        self.pool = pool
        self.recorder = Recorder(
            pool,
            max_pending=config.max_pending_records,
            command_timeout_s=config.db_command_timeout_s,
        )
        self.upstreams = Upstreams(
            config.upstreams,
            config.upstream_timeout_s,
            eject_after=config.eject_after,
            probe_interval_s=config.probe_interval_s,
            replica_max_inflight=config.replica_max_inflight,
        )
        self.keys = RolloutKeys(pool)
        self.recent = RecentCalls(config.recent_calls_mib << 20)
        self.renderer = _renderer(config, self.upstreams)
        self.continuer = Continuer(
            config.continuation, pool, self.recent, WindowedRenderer(self.renderer)
        )
        self.recording = Recording(
            pool, self.recorder, self.recent, self.continuer, config.record_bodies
        )
        self.policy_version = 0
        self.notifications = Notifications(pool)
        self.notifications.on(rollouts_store.POLICY_CHANNEL, self._policy_notified)
        self.notifications.on_connect(self._read_policy_version)
        self.notifications.on(rollouts_store.ENDED_CHANNEL, self._rollout_ended)
        self.notifications.on_connect(self._listening_for_ends)
        self.notifications.on_lost(lambda: self.keys.listening(False))
        # Model calls in flight here (each with an `abort(reason)`), for back-pressure and for
        # ending them in the protocol's terms when a shutdown's drain time is up.
        self.calls: set = set()
        self.model_requests = 0  # model-route requests being served, for --max-inflight
        self.closing = False  # set on SIGTERM: new calls are refused, in-flight ones finish
        self.metrics = Metrics()
        self.metrics.watch(
            lambda: self.upstreams.replicas.values(),
            lambda: self.recorder.pending,
            lambda: self.model_requests,
            lambda: self.policy_version,
        )
        self.recorder.on_commit = self.metrics.committed
        self._models: set[str] = set()
        self._models_checked = 0.0

    async def start(self) -> None:
        await self.upstreams.open()
        self.recorder.start()
        await self.notifications.start()
        self._models = await self.upstreams.served_models()
        self._models_checked = time.monotonic()
        if isinstance(self.renderer, CheckedRenderer):
            for url in self.upstreams.urls:
                for model in self._models:
                    try:
                        await asyncio.wait_for(self.renderer.self_check(url, model), 30)
                    except (RenderError, TimeoutError) as exc:  # checked again on first use
                        log.warning("local template self-check on %s failed: %r", url, exc)

    def _policy_notified(self, payload: str) -> None:
        self._set_policy_version(int(payload))

    async def _read_policy_version(self, conn: asyncpg.Connection) -> None:
        self._set_policy_version(await rollouts_store.policy_version(conn))

    async def _listening_for_ends(self, conn: asyncpg.Connection) -> None:
        self.keys.listening(True)

    def _rollout_ended(self, payload: str) -> None:
        """Another gateway (or this one) ended a rollout: its key and calls are not kept."""
        rollout_id = UUID(payload)
        self.keys.ended(rollout_id)
        self.recent.forget(rollout_id)

    def _set_policy_version(self, version: int) -> None:
        if version != self.policy_version:
            log.info("policy version %d -> %d", self.policy_version, version)
        self.policy_version = version

    async def close(self) -> None:
        await self.notifications.stop()
        await self.recorder.close()
        await self.upstreams.close()

    async def check_model(self, model: str) -> None:
        """Unknown model names fail fast with the list of served ones; the list is refreshed
        at most every few seconds (a replica may have come up since)."""
        if model in self._models:
            return
        if time.monotonic() - self._models_checked > 5.0:
            self._models = await self.upstreams.served_models() or self._models
            self._models_checked = time.monotonic()
            if model in self._models:
                return
        served = ", ".join(sorted(self._models)) or "none (no replica answers /v1/models)"
        raise GatewayError(
            404,
            f"model {model!r} is not served here; served: {served}",
            "not_found_error",
            param="model",
            code="model_not_found",
        )
