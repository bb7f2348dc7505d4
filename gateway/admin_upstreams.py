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

from gateway.admin import _decode, _json, _services
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


def _listing(svc) -> web.Response:
    return _json({"upstreams": [r.describe() for r in svc.upstreams.replicas.values()]})


@routes.get("/admin/upstreams")
async def list_upstreams(request: web.Request) -> web.Response:
    return _listing(_services(request))


@routes.get("/admin/models")
async def list_models(request: web.Request) -> web.Response:
    svc = _services(request)
    return _json({"models": sorted(await svc.upstreams.served_models()),
                  "upstreams": list(svc.upstreams.urls)})


@routes.post("/admin/upstreams")
async def change_upstream(request: web.Request) -> web.Response:
    svc = _services(request)
    spec = _decode(await request.read(), UpstreamChange)
    url = _checked_url(spec.url)
    if spec.draining:
        if svc.upstreams.drain(url) is None:
            raise GatewayError(404, f"no upstream {url}", "not_found_error", param="url")
    else:
        svc.upstreams.add(url)
    return _listing(svc)


@routes.delete("/admin/upstreams")
async def remove_upstream(request: web.Request) -> web.Response:
    svc = _services(request)
    url = request.query.get("url", "").rstrip("/")
    if not url:
        raise GatewayError(400, "name the replica: DELETE /admin/upstreams?url=URL", param="url")
    if svc.upstreams.remove(url) is None:
        raise GatewayError(404, f"no upstream {url}", "not_found_error", param="url")
    return _listing(svc)


@routes.post("/admin/upstreams/pause-lease")
async def lease_pause(request: web.Request) -> web.Response:
    svc = _services(request)
    spec = _decode(await request.read(), PauseLease)
    if not 0 <= spec.seconds <= 3600:
        raise GatewayError(400, "seconds must be between 0 (the lease ends) and 3600: renew a "
                           "lease while the push lasts rather than taking a long one",
                           param="seconds")
    if svc.upstreams.lease_pause(_checked_url(spec.url), spec.seconds) is None:
        raise GatewayError(404, f"no upstream {spec.url}", "not_found_error", param="url")
    return _listing(svc)
