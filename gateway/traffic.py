"""What every request goes through before the protocol handlers: a request id, metrics, and a
deadline for reading the body (the in-flight limit is `gateway.admission`)."""

from __future__ import annotations

import asyncio
import re
import secrets
import time

from aiohttp import web

from gateway.app_keys import CLOSE_CONNECTION, CONFIG, METRICS, REQUEST_ID, RETRY_AFTER
from gateway.logs import request_id
from gateway.path_protocol import protocol_of
from gateway.protocols.errors import GatewayError

REQUEST_ID_HEADER = "X-Request-Id"
# A harness's own id is kept if it is a plain token; anything else is replaced.
_VALID_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")


@web.middleware
async def observe(request: web.Request, handler):
    """Outermost: ids every request and counts it once its response is decided."""
    rid = request.headers.get(REQUEST_ID_HEADER, "")
    if not _VALID_ID.fullmatch(rid):
        # 32 random hex digits, as uuid4().hex spelled them, without building a UUID (8 µs
        # on the bench's busy VMs, where reading the 16 bytes took 1.5)
        rid = secrets.token_hex(16)
    request[REQUEST_ID] = rid
    token = request_id.set(rid)
    started = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        if request.get(CLOSE_CONNECTION):
            response.force_close()
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    finally:
        request_id.reset(token)
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        request.app[METRICS].request_done(
            protocol_of(request.path), route, status, time.perf_counter() - started
        )


async def stamp_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: the request id on every response, streamed or not, and the
    Retry-After a refusal asked for."""
    rid = request.get(REQUEST_ID)
    if rid:
        response.headers[REQUEST_ID_HEADER] = rid
    retry = request.get(RETRY_AFTER)
    if retry:
        response.headers["Retry-After"] = retry


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The whole body, or 408 (and the connection closed) if it trickles in too slowly."""
    if request.content.is_eof():
        # It came with the head, as most bodies do: nothing to wait for, so no deadline (one
        # costs a timer set and cancelled, tens of µs a call).
        return await _read(request)
    try:
        async with asyncio.timeout(timeout_s):
            return await _read(request)
    except TimeoutError:
        request[CLOSE_CONNECTION] = True  # the rest of the body may still trickle in
        raise GatewayError(
            408, f"request body not received within {timeout_s:g} s (--body-timeout)",
            "invalid_request_error", code="request_timeout",
        ) from None


async def _read(request: web.Request) -> bytes:
    """The body as received, joined in one copy (none if it came in one piece): aiohttp's own
    `read` grows a bytearray and then copies it, three copies of a 130 kB conversation."""
    limit = request.app[CONFIG].max_body_bytes
    chunks, size = [], 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if size > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
