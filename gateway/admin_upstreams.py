"""The live replica set: `GET/POST/DELETE /admin/upstreams` (admin key), and `GET
/admin/models`, the models its available replicas serve (a runner checks its --model there
before its first rollout).

POST adds a replica, or with `"draining": true` stops new calls to it while its in-flight calls
finish (its rollouts move on their next call, recorded as rerouted). DELETE removes it.
`POST /admin/upstreams/pause-lease` is a bridge's lease on a replica it paused (see
`gateway.upstream`): renew it while the push lasts, end it with `"seconds": 0`.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import msgspec
from aiohttp import web

from gateway.admin_http import admin_app, decode_body, json_response
from gateway.app_keys import UPSTREAMS
from gateway.protocols.errors import GatewayError

routes = web.RouteTableDef()


class UpstreamChange(msgspec.Struct, forbid_unknown_fields=True):
    url: str
    draining: bool = False


class PauseLease(msgspec.Struct, forbid_unknown_fields=True):
    url: str
    seconds: float


def _checked_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query:
        raise GatewayError(
            400, f"upstream url must look like http://HOST:PORT (a vLLM server root), not {url!r}",
            param="url",
        )
    return url.rstrip("/")


def _listing(app: web.Application) -> web.Response:
    replicas = app[UPSTREAMS].replicas.values()
    return json_response({"upstreams": [r.describe() for r in replicas]})


@routes.get("/admin/upstreams")
async def list_upstreams(request: web.Request) -> web.Response:
    return _listing(admin_app(request))


@routes.get("/admin/models")
async def list_models(request: web.Request) -> web.Response:
    app = admin_app(request)
    return json_response({"models": sorted(await app[UPSTREAMS].served_models()),
                  "upstreams": list(app[UPSTREAMS].urls)})


@routes.post("/admin/upstreams")
async def change_upstream(request: web.Request) -> web.Response:
    app = admin_app(request)
    spec = decode_body(await request.read(), UpstreamChange)
    url = _checked_url(spec.url)
    if spec.draining:
        if app[UPSTREAMS].drain(url) is None:
            raise GatewayError(404, f"no upstream {url}", "not_found_error", param="url")
    else:
        app[UPSTREAMS].add(url)
    return _listing(app)


@routes.delete("/admin/upstreams")
async def remove_upstream(request: web.Request) -> web.Response:
    app = admin_app(request)
    url = request.query.get("url", "").rstrip("/")
    if not url:
        raise GatewayError(400, "name the replica: DELETE /admin/upstreams?url=URL", param="url")
    if app[UPSTREAMS].remove(url) is None:
        raise GatewayError(404, f"no upstream {url}", "not_found_error", param="url")
    return _listing(app)


@routes.post("/admin/upstreams/pause-lease")
async def lease_pause(request: web.Request) -> web.Response:
    app = admin_app(request)
    spec = decode_body(await request.read(), PauseLease)
    if not 0 <= spec.seconds <= 3600:
        raise GatewayError(400, "seconds must be between 0 (the lease ends) and 3600: renew a "
                           "lease while the push lasts rather than taking a long one",
                           param="seconds")
    if app[UPSTREAMS].lease_pause(_checked_url(spec.url), spec.seconds) is None:
        raise GatewayError(404, f"no upstream {spec.url}", "not_found_error", param="url")
    return _listing(app)
