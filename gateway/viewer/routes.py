"""The viewer's routes: its pages, static files, login, and the JSON it draws from.

Everything the browser shows comes from recorded bodies a hostile agent may have written; the
pages build the DOM with textContent only, and a strict Content-Security-Policy (scripts from
this origin, no inline script) backs that up."""

from __future__ import annotations

import datetime as dt
import hmac
import importlib.resources
import math
import time
import uuid

import msgspec
import numpy as np
from aiohttp import web

from core.store import calls as calls_store
from core.store import listing
from core.store import rollouts as rollouts_store
from core.store import traces as traces_store
from core.store.ledger import rollout_reason
from gateway.app_keys import CONFIG, POOL
from gateway.protocols.errors import GatewayError
from gateway.ratelimit import TokenBuckets
from gateway.viewer import session, vocab

routes = web.RouteTableDef()

_STATIC = importlib.resources.files("gateway.viewer") / "static"
_TYPES = {".html": "text/html", ".css": "text/css", ".js": "text/javascript"}
_ASSETS = ("viewer.css", "viewer.js")
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "connect-src 'self'; img-src 'self'; form-action 'self'; base-uri 'none'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
MAX_PAGE = 200
# Wrong keys at the login form, per client address: 5 at once, then one every 12 s. A key
# chosen by the operator may be guessable; this makes guessing it slow. The admin key sent as
# a header (scripts, the API) is not throttled: it needs no form.
LOGIN_FAILURES = web.AppKey("login_failures", TokenBuckets)


def install(app: web.Application) -> None:
    app[LOGIN_FAILURES] = TokenBuckets(rate=1 / 12, burst=5)
    app.router.add_routes(routes)


def _file(name: str) -> bytes:
    return (_STATIC / name).read_bytes()


def _page(name: str, status: int = 200, message: str = "") -> web.Response:
    body = _file(name)
    if message:  # fixed texts of this module only, never request data
        body = body.replace(b"<!--message-->", message.encode())
    return web.Response(body=body, status=status, content_type="text/html", headers=_HEADERS)


def _json(obj) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(obj), content_type="application/json", headers=_HEADERS
    )


def _authorised(request: web.Request) -> web.Application:
    app = request.app
    session.check(request.headers, request.cookies, app[CONFIG].admin_key)
    return app


@routes.get("/ui")
async def index(request: web.Request) -> web.Response:
    try:
        _authorised(request)
    except GatewayError as err:
        return _page("login.html", err.status)
    return _page("index.html")


@routes.get("/ui/static/{name}")
async def static(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in _ASSETS:
        raise GatewayError(404, "no such file", "not_found_error")
    return web.Response(
        body=_file(name),
        content_type=_TYPES["." + name.rpartition(".")[2]],
        headers={"X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"},
    )


@routes.post("/ui/login")
async def login(request: web.Request) -> web.Response:
    config = request.app[CONFIG]
    failures = request.app[LOGIN_FAILURES]
    client = request.remote
    wait = failures.wait(client, time.monotonic())
    if wait > 0:
        resp = _page("login.html", 429, "Too many wrong keys from here: wait a minute, then "
                     "try again.")
        resp.headers["Retry-After"] = str(math.ceil(wait))
        return resp
    form = await request.post()
    key = form.get("key")
    if not isinstance(key, str) or not hmac.compare_digest(
        key.encode(), config.admin_key.encode()
    ):
        failures.spend(client, time.monotonic())
        return _page("login.html", 401, "That is not the admin key.")
    resp = web.HTTPSeeOther("/ui")
    resp.set_cookie(
        session.COOKIE,
        session.issue(config.admin_key),
        max_age=session.LIFETIME_S,
        path="/ui",
        httponly=True,
        samesite="Strict",
        secure=request.secure,
    )
    return resp


@routes.post("/ui/logout")
async def logout(request: web.Request) -> web.Response:
    resp = web.HTTPSeeOther("/ui")
    resp.del_cookie(session.COOKIE, path="/ui")
    return resp


def _float(query, name: str) -> float | None:
    text = query.get(name, "").strip()
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        raise GatewayError(400, f"{name} must be a number, not {text!r}", param=name) from None


def filter_from_query(query) -> listing.Filter:
    """The list's filters from a query string; empty fields mean no filter."""
    def text(name: str) -> str | None:
        return query.get(name, "").strip() or None

    since = text("since")
    try:
        return listing.Filter(
            task=text("task"),
            group=text("group"),
            status=text("status"),
            harness=text("harness"),
            min_reward=_float(query, "min_reward"),
            max_reward=_float(query, "max_reward"),
            since=dt.datetime.fromisoformat(since) if since else None,
        )
    except ValueError as exc:
        raise GatewayError(400, str(exc)) from None


@routes.get("/ui/api/rollouts")
async def list_rollouts(request: web.Request) -> web.Response:
    app = _authorised(request)
    q = request.query
    filt = filter_from_query(q)
    try:
        after = listing.decode_cursor(q["after"]) if q.get("after") else None
        limit = int(q.get("limit", "50"))
    except ValueError as exc:
        raise GatewayError(400, str(exc)) from None
    if not 1 <= limit <= MAX_PAGE:
        raise GatewayError(400, f"limit must be 1 to {MAX_PAGE}", param="limit")
    async with app[POOL].acquire() as conn:
        rows, nxt = await listing.page(conn, filt, after, limit)
    return _json({"rollouts": rows, "next": nxt})


def _sequence(trace: traces_store.StoredTrace, calls: dict[str, dict]) -> dict:
    out = trace.to_dict()
    # Where each call's sampled tokens sit: a sequence extends call by call, so call k's
    # completion starts where its prompt ends.
    out["boundaries"] = [
        {
            "seq": calls[c]["seq"],
            "start": calls[c]["prompt_tokens"],
            "end": calls[c]["prompt_tokens"] + calls[c]["completion_tokens"],
        }
        for c in trace.call_ids
        if c in calls
    ]
    return out


@routes.get("/ui/api/rollouts/{rollout_id}")
async def rollout_detail(request: web.Request) -> web.Response:
    app = _authorised(request)
    try:
        rollout_id = uuid.UUID(request.match_info["rollout_id"])
    except ValueError:
        raise GatewayError(404, "no such rollout", "not_found_error") from None
    async with app[POOL].acquire() as conn:
        row = await rollouts_store.get(conn, rollout_id)
        if row is None:
            raise GatewayError(404, f"no rollout {rollout_id}", "not_found_error")
        calls = await calls_store.rollout_calls(
            conn, rollout_id, with_tokens=False, with_bodies=True
        )
        traces = await traces_store.fetch(conn, rollout_id) if row["merged_at"] else []
    by_id = {c["call_id"]: c for c in calls}
    texts, tokenizer_note = None, None
    model_dir = app[CONFIG].tokenizer or app[CONFIG].local_template
    if model_dir is None:
        tokenizer_note = "start the gateway with --tokenizer MODEL_DIR to see token text"
    elif traces:
        try:
            ids = np.unique(np.concatenate([t.input_ids for t in traces]))
            texts = vocab.load(model_dir).texts(ids.tolist())
        except ValueError as exc:
            tokenizer_note = str(exc)
    return _json(
        {
            "rollout": {
                **rollouts_store.identity(row),
                "metrics": row["metrics"],
                "metadata": row["metadata"],
                "created_at": row["created_at"].isoformat(),
                "finished_at": row["finished_at"] and row["finished_at"].isoformat(),
                "merge_stats": row["merge_stats"],
                "ledger": row["ledger"],
                "trained_nothing": rollout_reason(row),
            },
            "calls": calls,
            "sequences": [_sequence(t, by_id) for t in traces],
            "merged": row["merged_at"] is not None,
            "token_text": texts,
            "tokenizer_note": tokenizer_note,
        }
    )
