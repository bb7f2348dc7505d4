"""What the gateway's routes read from the application, one typed key per component (aiohttp's
`web.AppKey`; `gateway.runtime` builds the components and sets them), and what one request
carries from a middleware or handler to the next (`web.RequestKey`)."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import asyncpg
from aiohttp import web

if TYPE_CHECKING:
    from gateway.admission import Admission
    from gateway.auth import RolloutKeys
    from gateway.config import GatewayConfig
    from gateway.finalize import MergeWorker
    from gateway.health import DatabaseCheck
    from gateway.metrics import Metrics
    from gateway.pipeline import Pipeline
    from gateway.policy_version import PolicyVersion
    from gateway.recording import Recorder
    from gateway.rollout_memory import RolloutMemory
    from gateway.served_models import ServedModels
    from gateway.upstream import Upstreams

CONFIG: web.AppKey[GatewayConfig] = web.AppKey("config")
POOL = web.AppKey("pool", asyncpg.Pool)
UPSTREAMS: web.AppKey[Upstreams] = web.AppKey("upstreams")
ROLLOUT_KEYS: web.AppKey[RolloutKeys] = web.AppKey("rollout_keys")
MEMORY: web.AppKey[RolloutMemory] = web.AppKey("memory")
POLICY: web.AppKey[PolicyVersion] = web.AppKey("policy")
MODELS: web.AppKey[ServedModels] = web.AppKey("models")
METRICS: web.AppKey[Metrics] = web.AppKey("metrics")
RECORDER: web.AppKey[Recorder] = web.AppKey("recorder")
ADMISSION: web.AppKey[Admission] = web.AppKey("admission")
DATABASE_CHECK: web.AppKey[DatabaseCheck] = web.AppKey("database_check")
PIPELINE: web.AppKey[Pipeline] = web.AppKey("pipeline")
MERGER: web.AppKey[MergeWorker] = web.AppKey("merger")

REQUEST_ID = web.RequestKey("request_id", str)
# Handlers that learn the rollout (from its key or the URL) leave its id here for the log line.
ROLLOUT_ID = web.RequestKey("rollout_id", uuid.UUID)
RETRY_AFTER = web.RequestKey("retry_after", str)  # what a refusal asks the client to wait, s
CLOSE_CONNECTION = web.RequestKey("close_connection", bool)  # its body may still trickle in
# Set once a stream's headers are sent: an error after that can only be told as the protocol's
# error event inside the stream, never as a new HTTP response.
STREAM_STARTED = web.RequestKey("stream_started", web.StreamResponse)
