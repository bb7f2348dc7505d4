"""The gateway's HTTP application: harness-facing routes, admin routes, health, and the
middleware that turns every failure into the caller's protocol's error shape."""

from __future__ import annotations

import asyncio
import logging

import asyncpg
import msgspec
from aiohttp import web

from gateway import admin, admin_upstreams, health, traffic, viewer
from gateway.access_log import ROLLOUT_KEY
from gateway.auth import check_admin
from gateway.config import GatewayConfig
from gateway.finalize import merge_rollout
from gateway.metrics import CONTENT_TYPE_LATEST
from gateway.protocols import anthropic, chat, completions, responses
from gateway.protocols.adapter import Adapter
from gateway.protocols.errors import GatewayError
from gateway.recording import RETRY_AFTER_S
from gateway.relay import STREAM_STARTED, relay, upstream_error
from gateway.services import Services
from gateway.store import rollouts as rollouts_store
from gateway.store import traces as traces_store
from gateway.store.db import UNAVAILABLE

log = logging.getLogger(__name__)

_SWEEP_INTERVAL_S = 5.0


def _renderer(path: str):
    """Errors on the Anthropic surface use Anthropic's shape, everything else OpenAI's."""
    if path.startswith("/v1/messages"):
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
        limit = request.app["services"].config.max_body_bytes
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
    would be written into the chunked body). The relay ends its streams with the protocol's
    error event itself; whatever still escapes ends the body cleanly here."""
    try:
        return await handler(request)
    except Exception:
        started = request.get(STREAM_STARTED)
        if started is None:
            raise
        log.exception("error after a stream started on %s", request.path)
        return started


def _model_route(proto: Adapter):
    async def handler(request: web.Request) -> web.StreamResponse:
        svc: Services = request.app["services"]
        traffic.refuse_if_busy(request, svc.model_requests, svc.config.max_inflight,
                               svc.closing)
        svc.model_requests += 1
        try:
            rollout_id = await svc.keys.rollout_for(request.headers)
            request[ROLLOUT_KEY] = rollout_id
            raw = await traffic.read_body(request, svc.config.body_timeout_s)
            return await relay(request, proto, raw, rollout_id)
        finally:
            svc.model_requests -= 1

    return handler


async def count_tokens(request: web.Request) -> web.Response:
    """Anthropic's token counter, answered by the engine's own tokenizer and chat template."""
    svc: Services = request.app["services"]
    rollout_id = await svc.keys.rollout_for(request.headers)
    req = anthropic.parse_count_tokens(
        await traffic.read_body(request, svc.config.body_timeout_s)
    )
    body = anthropic.count_tokens_request(req)
    model = req.body.model
    await svc.check_model(model)
    body["model"] = model
    upstream, _ = svc.upstreams.route(rollout_id, svc.upstreams.placed(rollout_id))
    resp = await svc.upstreams.post(upstream, "/tokenize", msgspec.json.encode(body))
    async with resp:
        raw = await resp.read()
        if resp.status != 200:
            raise upstream_error(resp.status, raw)
    return web.Response(
        body=anthropic.count_tokens_response(msgspec.json.decode(raw)),
        content_type="application/json",
    )


async def list_models(request: web.Request) -> web.Response:
    svc: Services = request.app["services"]
    await svc.keys.rollout_for(request.headers)
    models = sorted(await svc.upstreams.served_models())
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
    svc: Services = request.app["services"]
    database = await svc.database_check.answer()
    upstreams = svc.upstreams.probed()
    ok = health.healthy(database, upstreams)
    if not health.admin_requested(request.headers, svc.config.admin_key):
        status, body = health.public_answer(ok)
        return web.json_response(body, status=status)
    st = svc.recorder.stats
    return web.json_response(
        {
            "status": "ok" if ok else "degraded",
            "database": database,
            "upstreams": upstreams,
            # replica -> unix time since which it is paused (a weight push)
            "paused": {r.url: r.paused_since for r in svc.upstreams.replicas.values()
                       if r.paused_since is not None},
            "policy_version": svc.policy_version,
            "recorder": {
                "commits": st.commits,
                "records": st.records,
                "largest_batch": st.largest_batch,
                "pending": svc.recorder.pending,
                "row_retries": st.row_retries,
                "refused": st.refused,
            },
        },
        status=200 if ok else 503,
    )


async def metrics(request: web.Request) -> web.Response:
    """Prometheus exposition; the admin key guards it like the rest of the operator's view."""
    svc: Services = request.app["services"]
    check_admin(request.headers, svc.config.admin_key)
    m = svc.metrics
    if m.due_for_database():
        async with svc.pool.acquire() as conn:
            m.database_values(
                await rollouts_store.count_by_status(conn),
                await traces_store.harness_metrics(conn),
                await rollouts_store.ledger_totals(conn),
            )
    return web.Response(body=m.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _end_overdue(svc: Services) -> None:
    """Rollouts past their deadline end as `timeout` and are merged; ended rollouts left
    unmerged by a gateway that died are merged too. Safe with several gateways: the UPDATE picks
    each rollout once, and merging is idempotent."""
    while True:
        await asyncio.sleep(_SWEEP_INTERVAL_S)
        try:
            async with svc.pool.acquire() as conn:
                for rollout_id in await rollouts_store.expire_overdue(conn):
                    svc.keys.forget(rollout_id)
                    svc.recent.forget(rollout_id)
                pending = await traces_store.unmerged(conn)
            for rollout_id in pending:
                # A rollout that cannot be merged is marked so by merge_rollout; nothing one
                # rollout holds may stop the sweep of the others.
                await merge_rollout(svc.pool, rollout_id, svc.config.merge_options)
        except Exception:  # noqa: BLE001 - the sweeper must outlive any single failure
            log.exception("deadline sweep failed; retrying")


def build_app(config: GatewayConfig, pool: asyncpg.Pool) -> web.Application:
    app = web.Application(
        middlewares=[traffic.observe, protocol_errors, started_streams],
        client_max_size=config.max_body_bytes,
    )
    app.on_response_prepare.append(traffic.stamp_headers)
    svc = Services(config, pool)
    app["services"] = svc

    async def lifecycle(app: web.Application):
        await svc.start()
        sweeper = asyncio.create_task(_end_overdue(svc))
        yield
        sweeper.cancel()
        await svc.close()

    app.cleanup_ctx.append(lifecycle)
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
