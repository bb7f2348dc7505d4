"""The gateway's HTTP application: harness-facing routes, admin routes, health, and the
middleware that turns every failure into the caller's protocol's error shape."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from core.store import rollouts as rollouts_store
from core.store import traces as traces_store
from core.store.db import UNAVAILABLE
from gateway import admin, admin_upstreams, health, traffic, viewer
from gateway.app_keys import (
    ADMISSION,
    CONFIG,
    DATABASE_CHECK,
    METRICS,
    MODELS,
    PIPELINE,
    POLICY,
    POOL,
    RECORDER,
    ROLLOUT_ID,
    ROLLOUT_KEYS,
    STREAM_STARTED,
    UPSTREAMS,
)
from gateway.auth import check_admin
from gateway.engine_exchange import upstream_error
from gateway.metrics import CONTENT_TYPE_LATEST
from gateway.path_protocol import protocol_of
from gateway.protocols import anthropic, chat, completions, responses
from gateway.protocols.adapter import Adapter
from gateway.protocols.errors import GatewayError
from gateway.recording import RETRY_AFTER_S

if TYPE_CHECKING:
    from gateway.runtime import Runtime

log = logging.getLogger(__name__)



def _renderer(path: str):
    """Errors on the Anthropic surface use Anthropic's shape, everything else OpenAI's."""
    if protocol_of(path) == "anthropic":
        return anthropic.ADAPTER.render_error
    return chat.ADAPTER.render_error


@web.middleware
async def protocol_errors(request: web.Request, handler):
    retry_after = None
    try:
        return await handler(request)
    except GatewayError as err:
        status, body = _renderer(request.path)(err)
        retry_after = err.retry_after
    except UNAVAILABLE as exc:
        retry_after = RETRY_AFTER_S
        status, body = _renderer(request.path)(
            GatewayError(
                503,
                f"database unavailable ({str(exc) or type(exc).__name__}); retry shortly",
                "service_unavailable",
            )
        )
    except RecursionError:
        status, body = _renderer(request.path)(
            GatewayError(400, "request body is nested too deeply")
        )
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[CONFIG].max_body_bytes
        status, body = _renderer(request.path)(
            GatewayError(
                413,
                f"request body too large: over the limit of {limit} bytes; raise "
                "the gateway's --max-body-mb if this is expected",
                "request_too_large",
            )
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        status, body = _renderer(request.path)(
            GatewayError(
                exc.status,
                exc.reason or "error",
                "not_found_error" if exc.status in (404, 405) else "invalid_request_error",
            )
        )
    except Exception:  # noqa: BLE001 - a bug must still answer in the caller's protocol
        log.exception("unhandled error on %s %s", request.method, request.path)
        status, body = _renderer(request.path)(
            GatewayError(500, "internal gateway error; see the gateway log", "api_error")
        )
    headers = {"Retry-After": str(retry_after)} if retry_after else None
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


@web.middleware
async def started_streams(request: web.Request, handler):
    """An error after a stream's headers went out cannot become an HTTP error response (it
    would be written into the chunked body). The pipeline ends its streams with the protocol's
    error event itself; whatever still escapes ends the body cleanly here."""
    try:
        return await handler(request)
    except Exception:
        started = request.get(STREAM_STARTED)
        if started is None:
            raise
        log.exception("error after a stream started on %s", request.path)
        return started


async def _admitted(
    request: web.Request,
    serve: Callable[[web.Request, bytes, uuid.UUID], Awaitable[web.StreamResponse]],
) -> web.StreamResponse:
    """A rollout's request through admission: its key, a place in its rollout's share from the
    head on, its body read, then a gateway slot while `serve` answers it."""
    app = request.app
    admission = app[ADMISSION]
    rollout_id = await app[ROLLOUT_KEYS].rollout_for(request.headers)
    request[ROLLOUT_ID] = rollout_id
    with admission.rollout_share(request, rollout_id):
        raw = await traffic.read_body(request, app[CONFIG].body_timeout_s)
        with admission.gateway_slot(request):
            return await serve(request, raw, rollout_id)


def _model_route(proto: Adapter):
    async def handler(request: web.Request) -> web.StreamResponse:
        return await _admitted(
            request, lambda r, raw, rid: r.app[PIPELINE].serve(r, proto, raw, rid))

    return handler


async def count_tokens(request: web.Request) -> web.StreamResponse:
    """Anthropic's token counter, answered by the engine's own tokenizer and chat template,
    under the same shares and limit as the model calls (it costs the engine a render)."""
    return await _admitted(request, _count_tokens)


async def _count_tokens(request: web.Request, raw: bytes, rollout_id: uuid.UUID) -> web.Response:
    app = request.app
    upstreams = app[UPSTREAMS]
    req = anthropic.parse_count_tokens(raw)
    body = anthropic.count_tokens_request(req)
    model = req.body.model
    await app[MODELS].check(model)
    body["model"] = model
    upstream, _ = upstreams.route(rollout_id, upstreams.placed(rollout_id))
    resp = await upstreams.post(upstream, "/tokenize", msgspec.json.encode(body))
    async with resp:
        raw = await resp.read()
        if resp.status != 200:
            raise upstream_error(resp.status, raw)
    return web.Response(
        body=anthropic.count_tokens_response(msgspec.json.decode(raw)),
        content_type="application/json",
    )


async def list_models(request: web.Request) -> web.Response:
    await request.app[ROLLOUT_KEYS].rollout_for(request.headers)
    models = sorted(await request.app[UPSTREAMS].served_models())
    return web.Response(
        body=msgspec.json.encode(
            {
                "object": "list",
                "data": [
                    {"id": m, "object": "model", "created": 0, "owned_by": "rolltap"}
                    for m in models
                ],
            }
        ),
        content_type="application/json",
    )


async def root(request: web.Request) -> web.Response:
    # Some harnesses probe the base URL (Claude Code sends `HEAD /`) before their first call.
    return web.json_response({"name": "rolltap", "status": "ok"})


async def healthz(request: web.Request) -> web.Response:
    app = request.app
    recorder = app[RECORDER]
    database = await app[DATABASE_CHECK].answer()
    upstreams = app[UPSTREAMS].probed()
    ok = health.healthy(database, upstreams)
    if not health.admin_requested(request.headers, app[CONFIG].admin_key):
        status, body = health.public_answer(ok)
        return web.json_response(body, status=status)
    st = recorder.stats
    return web.json_response(
        {
            "status": "ok" if ok else "degraded",
            "database": database,
            "upstreams": upstreams,
            # replica -> unix time since which it is paused (a weight push)
            "paused": {r.url: r.paused_since for r in app[UPSTREAMS].replicas.values()
                       if r.paused_since is not None},
            "policy_version": app[POLICY].value,
            "recorder": {
                "commits": st.commits,
                "records": st.records,
                "largest_batch": st.largest_batch,
                "pending": recorder.pending,
                "row_retries": st.row_retries,
                "refused": st.refused,
            },
        },
        status=200 if ok else 503,
    )


async def metrics(request: web.Request) -> web.Response:
    """Prometheus exposition; the admin key guards it like the rest of the operator's view."""
    check_admin(request.headers, request.app[CONFIG].admin_key)
    m = request.app[METRICS]
    if m.due_for_database():
        async with request.app[POOL].acquire() as conn:
            m.database_values(
                await rollouts_store.count_by_status(conn),
                await traces_store.harness_metrics(conn),
                await rollouts_store.ledger_totals(conn),
            )
    return web.Response(body=m.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(runtime: Runtime) -> web.Application:
    config = runtime.config
    app = web.Application(
        middlewares=[traffic.observe, protocol_errors, started_streams],
        client_max_size=config.max_body_bytes,
    )
    app.on_response_prepare.append(traffic.stamp_headers)
    runtime.install(app)
    app.router.add_post("/v1/chat/completions", _model_route(chat.ADAPTER))
    app.router.add_post("/v1/completions", _model_route(completions.ADAPTER))
    app.router.add_post("/v1/responses", _model_route(responses.ADAPTER))
    app.router.add_post("/v1/messages", _model_route(anthropic.ADAPTER))
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/", root)
    app.router.add_get("/metrics", metrics)
    app.router.add_routes(admin.routes)
    app.router.add_routes(admin_upstreams.routes)
    viewer.install(app)
    return app
