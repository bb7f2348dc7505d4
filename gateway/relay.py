"""One model call, whatever the protocol: translate, pin sampling, forward to the rollout's
replica, stream back while capturing, commit the record, then end the response."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import aiohttp
import msgspec
import numpy as np
from aiohttp import web

from gateway import engine_ids
from gateway.capture import Capture
from gateway.constraints import CAPTURE_OFF, constraints
from gateway.continuation.planner import Turn
from gateway.protocols.errors import GatewayError
from gateway.protocols.normalize import normalize_messages
from gateway.protocols.resumable import Layout
from gateway.services import Services
from gateway.store import bodies, values
from gateway.store import calls as calls_store
from gateway.upstream import StreamStalled, sse_batches

log = logging.getLogger(__name__)

# Sampling parameters a harness may ask for. They are recorded as requested and replaced by the
# training policy's: the trainer's importance ratio is only right if the recorded logprobs are
# those of the policy being trained.
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "logit_bias",
    "top_logprobs",
    "logprobs",
)

# Set on a request once its response headers are sent: an error after that can only be told
# as the protocol's error event inside the stream, never as a new HTTP response.
STREAM_STARTED = "rolltap.stream_started"

_decode = msgspec.json.decode
_encode = msgspec.json.encode
# Protocols that pass the engine's id arrays through (or drop them) without reading them; the
# others only count the prompt ids, and are handed the array the capture holds.
_PASSES_IDS = frozenset({"chat", "completions"})


def sampling_policy(temperature: float) -> dict[str, Any]:
    """The sampling every call is pinned to: the training policy's temperature over the whole
    distribution (no truncation, no penalties). Published in `GET /admin/policy`, where the
    trainer bridge checks it against its own before it trains on a single token."""
    return {
        "temperature": temperature,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
    }


def pin_sampling(body: dict, temperature: float, upstream_path: str) -> tuple[dict, dict]:
    """Moves the harness's sampling fields out of `body` and sets the policy's; returns
    (requested, applied)."""
    requested = {k: body.pop(k) for k in SAMPLING_KEYS if k in body}
    applied = sampling_policy(temperature)
    body.update(applied)
    body["return_token_ids"] = True
    if upstream_path.endswith("/chat/completions"):
        body["logprobs"] = True
        body["top_logprobs"] = 0
    else:  # legacy completions: an integer count of alternatives, 0 = only the sampled token
        body["logprobs"] = 0
    if body.get("stream"):
        body["stream_options"] = {"include_usage": True}
    return requested, applied


def upstream_error(status: int, raw: bytes) -> GatewayError:
    """An engine error, in the gateway's neutral form, keeping the engine's message."""
    try:
        payload = _decode(raw)
        err = payload.get("error", payload) if isinstance(payload, dict) else {}
        message = err.get("message") or raw.decode(errors="replace")
    except msgspec.DecodeError:
        message = raw.decode(errors="replace")[:2000]
    lowered = message.lower()
    if any(w in lowered for w in ("context length", "maximum context", "too long", "input length")):
        return GatewayError(400, message, "context_length_exceeded", code="context_length_exceeded")
    if 400 <= status < 500:
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        return GatewayError(status, message, kind)
    return GatewayError(502, f"upstream error {status}: {message}", "upstream_error")


class _Call:
    """The state of one call while it runs."""

    def __init__(
        self,
        svc: Services,
        rollout_id: uuid.UUID,
        protocol: str,
        raw: bytes,
        user_agent: str | None,
    ) -> None:
        self.svc = svc
        self.id = uuid.uuid4()
        self.rollout_id = rollout_id
        self.protocol = protocol
        self.raw = raw
        self.user_agent = user_agent
        self.started = time.perf_counter()
        self.started_at = datetime.now(UTC)
        self.ttft_ms: float | None = None
        self.capture = Capture()
        self.upstream: str | None = None
        self.model: str | None = None
        self.requested: dict = {}
        self.applied: dict = {}
        self.offered_tools = False
        self.constraints: list[str] = []
        # A retry of an earlier call (same body, or the SDK's retry header) makes the merge
        # mark the earlier attempt abandoned.
        self.digest = bodies.digest(raw)
        self.layout: Layout | None = None  # where the body's messages lie, for the next call
        self.retry_count = 0
        self.turn: Turn | None = None  # the continuation step (chat-completions upstreams)
        self.sent_prompt: bytes | None = None  # the prompt ids sent, as JSON, if echoed back
        # The engine's prompt ids as JSON pieces: as it echoed them, or as they were sent.
        self.prompt_json: engine_ids.Pieces | None = None
        # For stateful protocols: response object -> what to store for later continuation.
        self.state = None
        self.state_source = None  # the response object (or its bytes) given to the client
        self.rerouted: str | None = None  # why this call left its rollout's replica
        # Set by `abort` (shutdown deadline, ejected replica): (status to record, why).
        self.aborted: tuple[str, str] | None = None
        self._task: asyncio.Task | None = None
        self._recording = False

    def abort(self, status: str, reason: str) -> None:
        """Ends the call from outside: it stops waiting on the engine, records `status` and
        answers with an error in its protocol. No-op once it is recording."""
        # A call whose own failure ejects its replica is already ending; it is not aborted.
        task = self._task
        if (
            self.aborted is None
            and not self._recording
            and task is not None
            and task is not asyncio.current_task()
        ):
            self.aborted = (status, reason)
            task.cancel()

    def abort_error(self) -> GatewayError:
        assert self.aborted is not None
        return GatewayError(503, self.aborted[1], "overloaded_error")

    async def record(self, status: str, error: str | None = None) -> None:
        self._recording = True
        rec = await self.svc.recording.record(self, status, error)
        self.svc.metrics.call_recorded(rec)
        log.debug("recorded call %s of rollout %s: %s on %s%s", self.id, self.rollout_id,
                  status, self.upstream, f" (rerouted: {self.rerouted})" if self.rerouted else "")


def retry_count(headers) -> int:
    """The OpenAI and Anthropic SDKs (both Stainless-generated) number their retries."""
    try:
        return max(0, min(int(headers.get("x-stainless-retry-count", "0")), 1_000_000))
    except ValueError:
        return 0


async def relay(
    request: web.Request, proto, raw: bytes, rollout_id: uuid.UUID
) -> web.StreamResponse:
    """Serve one harness call through `proto` (a module of gateway.protocols)."""
    svc: Services = request.app["services"]
    svc.recording.admit()
    recent = svc.recent.entries(rollout_id) or ()
    req, layout = proto.parse(raw, [c.request for c in reversed(recent) if c.request is not None])
    svc.metrics.request_decoded(proto.NAME, layout is not None and layout.resumed > 0)
    stateful = hasattr(proto, "stored_state")  # protocols with server-side conversations
    if stateful:
        prev_id = proto.previous_id(req)
        # A NUL cannot be in a stored id (nor be sent to Postgres): such an id is not found.
        known = prev_id and "\x00" not in prev_id
        history = await _conversation(svc, rollout_id, prev_id) if known else None
        body, ctx = proto.to_upstream(req, history)
    else:
        body, ctx = proto.to_upstream(req)
    await svc.check_model(ctx.model)
    call = _Call(svc, rollout_id, proto.NAME, raw, request.headers.get("User-Agent"))
    call.retry_count = retry_count(request.headers)
    call.layout = layout
    call.model = ctx.model
    if "messages" in body and not getattr(proto, "MESSAGES_NORMALISED", False):
        body["messages"] = normalize_messages(body["messages"], raw)
    if stateful:
        call.state = lambda resp_body: proto.stored_state(req, ctx, resp_body)
    call.offered_tools = bool(body.get("tools"))
    client_ids = bool(body.get("return_token_ids"))
    call.requested, call.applied = pin_sampling(body, svc.config.temperature, proto.UPSTREAM_PATH)
    for key in CAPTURE_OFF:
        if key in body:
            call.requested[key] = body.pop(key)
    bad = values.problem(call.requested)
    if bad:
        raise GatewayError(400, f"invalid request: {bad}", param=bad.partition(":")[0])
    call.constraints = constraints(body)
    if call.constraints:
        call.applied["constrained_by"] = call.constraints
    cap = svc.config.default_max_tokens
    if cap and not body.get("max_tokens") and not body.get("max_completion_tokens"):
        # Some harnesses (Codex) set no output cap; a random policy then writes until the
        # context is full.
        body["max_tokens"] = call.applied["max_tokens"] = cap
    body["model"] = ctx.model
    previous = svc.upstreams.placed(rollout_id)
    if previous is None:  # first call here: continue where another gateway placed it
        async with svc.pool.acquire() as conn:
            previous = await calls_store.last_upstream(conn, rollout_id)
    call.upstream, call.rerouted = svc.upstreams.route(rollout_id, previous)
    if proto.UPSTREAM_PATH == "/v1/chat/completions":  # legacy completions has no messages
        call.turn = await svc.continuer.prepare(rollout_id, call.upstream, body)
        if call.turn.prompt_ids is not None:
            call.prompt_json = call.turn.prompt_pieces or (_encode(call.turn.prompt_ids.tolist()),)
            body["kv_transfer_params"] = {"prompt_token_ids": engine_ids.items(call.prompt_json)}
            asked = call.requested
            if client_ids or asked.get("logprobs") or asked.get("top_logprobs"):
                call.sent_prompt = engine_ids.concat(call.prompt_json)  # to know the echo by
            else:
                # The engine would echo the prompt the gateway just sent (at 32k tokens, 200 kB
                # to write, read and compare per call): only the sampled ids are asked for, as
                # logprob tokens. Its prompt token count still checks that it used these ids.
                del body["return_token_ids"]
                body["return_tokens_as_token_ids"] = True
                call.capture.ids_in_logprobs = True
    call._task = asyncio.current_task()
    svc.calls.add(call)
    try:
        return await _forward(request, proto, ctx, call, body)
    finally:
        svc.calls.discard(call)


async def _forward(request, proto, ctx, call: _Call, body: dict) -> web.StreamResponse:
    svc = call.svc
    upstreams = svc.upstreams
    if call.turn is not None and "messages" in body:
        body = {**body, "messages": call.turn.engine_messages(body["messages"])}
    encoded = _encode(body)
    streamed = bool(body.get("stream"))
    # A frozen engine never answers a whole-response call; ejecting its replica ends it.
    on_eject = None if streamed else (lambda why: call.abort("failed", why))
    for attempt in range(2):
        version_at_start = svc.policy_version
        upstream = call.upstream
        upstreams.begin(upstream, on_eject)
        try:
            try:
                resp = await upstreams.post(upstream, proto.UPSTREAM_PATH, encoded)
            except GatewayError as err:
                if attempt == 0 and _stale_connection(err.__cause__):
                    continue  # once more, on a new connection
                upstreams.failed(upstream, err.message)
                if attempt == 0 and isinstance(err.__cause__, aiohttp.ClientConnectorError):
                    # Nothing reached the engine, so another replica can take the call as is.
                    try:
                        call.upstream, call.rerouted = upstreams.route(
                            call.rollout_id, upstream, avoid=upstream
                        )
                    except GatewayError:
                        pass
                    else:
                        continue
                await call.record("failed", err.message)
                raise
            async with resp:
                if resp.status != 200:
                    if resp.status >= 500:
                        upstreams.failed(upstream, f"HTTP {resp.status}")
                    err = upstream_error(resp.status, await resp.read())
                    await call.record("failed", err.message)
                    raise err
                if not streamed:
                    return await _whole(request, proto, ctx, call, resp, version_at_start)
                return await _streamed(request, proto, ctx, call, resp)
        except asyncio.CancelledError:
            if call.aborted is None:
                raise
            asyncio.current_task().uncancel()
            await call.record(*call.aborted)
            raise call.abort_error() from None
        finally:
            upstreams.end(upstream, on_eject)
    raise AssertionError("unreachable")


def _stale_connection(exc: BaseException | None) -> bool:
    """The request met a kept-alive connection the engine had just closed (it was reset while
    the request was written, or closed before any answer): a race with the engine's idle
    timeout, not a failing replica. Whatever the engine might have started on it was aborted
    when the connection went, and nothing of it reached the call: asking again is safe."""
    return isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError) and not (
        isinstance(exc, aiohttp.ClientConnectorError)
    )


async def _whole(request, proto, ctx, call: _Call, resp, version_at_start: int) -> web.Response:
    try:
        raw = await resp.read()
    except (TimeoutError, aiohttp.ClientError) as exc:
        message = f"upstream response broke: {exc or type(exc).__name__}"
        call.svc.upstreams.failed(call.upstream, message)
        await call.record("failed", message)
        raise GatewayError(502, message, "upstream_error") from None
    payload = _engine_payload(call, raw)
    # The tokens were sampled under the version live at the start or the one at the end: stamp
    # the older, so staleness is never underestimated.
    call.capture.add_response(payload, min(version_at_start, call.svc.policy_version))
    call.ttft_ms = (time.perf_counter() - call.started) * 1000
    problem = call.capture.check()
    out = proto.from_upstream(payload, ctx) if problem is None else b""
    call.state_source = out
    call.svc.upstreams.succeeded(call.upstream)
    await call.record("ok" if problem is None else "failed", problem)
    if problem is not None:
        raise GatewayError(
            502, f"engine response unusable for training: {problem}", "upstream_error"
        )
    return web.Response(body=out, content_type="application/json")


async def _streamed(request, proto, ctx, call: _Call, resp) -> web.StreamResponse:
    svc = call.svc
    out = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await out.prepare(request)
    request[STREAM_STARTED] = out
    stream = proto.Stream(ctx)
    cap = call.capture
    failure: GatewayError | None = None
    status = "failed"  # if it fails
    cfg = svc.config
    batches = sse_batches(resp, cfg.ttft_timeout_s, cfg.stream_idle_timeout_s)
    try:
        done = False
        async for batch in batches:
            pieces = []
            for data in batch:
                if data == b"[DONE]":
                    done = True
                    break
                chunk = _decode(data) if cap.prompt_ids is not None else _engine_payload(call, data)
                if "error" in chunk and not chunk.get("choices"):
                    e = chunk["error"]
                    failure = upstream_error(e.get("code") or 500, _encode(chunk))
                    break
                cap.add_chunk(chunk, svc.policy_version)
                first_token = call.ttft_ms is None and len(cap.completion_ids)
                if first_token:
                    call.ttft_ms = (time.perf_counter() - call.started) * 1000
                try:
                    pieces.append(stream.feed(chunk))
                except GatewayError as err:  # the protocol cannot express what the engine sent
                    failure = err
                    break
                if first_token:
                    # The first token leaves at once, not after the rest of its read is
                    # translated: an engine that is ahead sends many chunks in one read.
                    first = b"".join(pieces)
                    pieces.clear()
                    if first:
                        await out.write(first)
            joined = b"".join(pieces)
            if joined:  # an empty write could read as the end of a chunked body
                await out.write(joined)
            if done or failure is not None:
                break
    except asyncio.CancelledError:
        if call.aborted is None:  # the client went away
            resp.close()  # closing the upstream response aborts the engine's request
            await _record_abandoned(call)
            raise
        asyncio.current_task().uncancel()
        status, failure = call.aborted[0], call.abort_error()
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        resp.close()
        await _record_abandoned(call)
        raise
    except StreamStalled as exc:
        failure = GatewayError(504, f"upstream {call.upstream}: {exc}", "upstream_error")
        svc.upstreams.failed(call.upstream, str(exc))
    except (TimeoutError, aiohttp.ClientError) as exc:
        failure = GatewayError(
            502, f"upstream stream broke: {exc or type(exc).__name__}", "upstream_error"
        )
        svc.upstreams.failed(call.upstream, failure.message)
    finally:
        await batches.aclose()  # stops its timer now, not when the generator is collected
    if failure is None and cap.finish_reason in ("abort", "error"):
        failure = GatewayError(
            502, f"engine ended the response with {cap.finish_reason!r}", "upstream_error"
        )
    if failure is not None:
        resp.close()  # stop the engine if it is still generating
    if failure is None and call.state is not None:
        call.state_source = stream.response()
    if failure is None:
        problem = cap.check()
        if problem is not None:
            failure = GatewayError(
                502, f"engine response unusable for training: {problem}", "upstream_error"
            )
    if failure is None:
        svc.upstreams.succeeded(call.upstream)
    try:
        await call.record(
            "ok" if failure is None else status, None if failure is None else failure.message
        )
    except GatewayError as err:  # not recorded: the stream must not end as a success
        failure = err
    except Exception:  # noqa: BLE001 - a bug, but still never an end that looks like success
        log.exception("call %s not recorded", call.id)
        failure = GatewayError(
            500, "the call could not be recorded; see the gateway log", "api_error"
        )
    try:
        await out.write(stream.close() if failure is None else stream.fail(failure))
        await out.write_eof()
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        pass  # recorded already; the client left after the last token
    return out


def _engine_payload(call: _Call, raw: bytes) -> dict:
    """The engine's response (or a chunk) decoded, its prompt ids handed to the capture as an
    array without passing through Python ints. Ids byte for byte those the gateway sent (an
    exact continuation: vLLM echoes them) are not parsed again; ids it was not asked to echo
    are the ones sent."""
    if call.capture.ids_in_logprobs:
        payload = _decode(raw)
        if isinstance(payload, dict) and call.capture.prompt_ids is None:
            call.capture.set_prompt(call.turn.prompt_ids)
            _hand_over(call, payload, engine_ids.items(call.prompt_json), call.turn.prompt_ids)
        return payload
    rest, span = engine_ids.split(raw)
    if span is None:
        return _decode(raw)
    payload = _decode(rest)
    holder = engine_ids.holder(payload)
    if holder is None:  # an id array nested where the engine puts none: decoded as it came
        return _decode(raw)
    if call.sent_prompt is not None and span == call.sent_prompt:
        ids = call.turn.prompt_ids  # `prompt_json` holds them as sent
    else:
        ids = engine_ids.parse(span)
        if call.capture.prompt_ids is None:
            call.prompt_json = (span,)
    call.capture.set_prompt(ids)
    _hand_over(call, holder, msgspec.Raw(span), ids)
    return payload


def _hand_over(call: _Call, holder: dict, text, ids: np.ndarray) -> None:
    """Puts the prompt ids where the engine's response holds them, as the protocol takes them:
    as their JSON `text` (encoded as it is), or as the array."""
    holder[engine_ids.KEY] = text if call.protocol in _PASSES_IDS else ids


async def _record_abandoned(call: _Call) -> None:
    """Records a call whose client went away; nobody is left to tell if that fails."""
    try:
        await call.record("aborted", "client disconnected")
    except GatewayError as err:
        log.warning("aborted call %s not recorded: %s", call.id, err.message)


async def _conversation(svc: Services, rollout_id: uuid.UUID, response_id: str) -> list | None:
    """The stored items of a response chain, oldest first; None if `response_id` is not a
    response of this rollout (a rollout never reads another's records)."""
    chain: list[list] = []
    async with svc.pool.acquire() as conn:
        while response_id:
            state = await calls_store.response_state(conn, rollout_id, response_id)
            if state is None:
                return None if not chain else [i for items in reversed(chain) for i in items]
            chain.append(state["items"])
            response_id = state.get("previous_response_id")
    return [item for items in reversed(chain) for item in items]
