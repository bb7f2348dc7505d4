"""What the admin routes share: the admin key checked, a JSON body decoded to its struct (400
naming what is wrong), a JSON answer."""

from __future__ import annotations

import msgspec
from aiohttp import web

from gateway.app_keys import CONFIG
from gateway.auth import check_admin
from gateway.protocols.errors import GatewayError


def decode_body(raw: bytes, kind: type):
    try:
        return msgspec.json.decode(raw or b"{}", type=kind)
    except msgspec.ValidationError as exc:
        raise GatewayError(400, f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise GatewayError(400, f"request body is not valid JSON: {exc}") from None


def admin_app(request: web.Request) -> web.Application:
    """The application, once the request showed the admin key."""
    check_admin(request.headers, request.app[CONFIG].admin_key)
    return request.app


def json_response(obj, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(obj), status=status, content_type="application/json"
    )
