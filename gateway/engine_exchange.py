"""The engine stage of one model call, in one place: where it goes (`place`), and the exchange
with the replica (`exchange`): the body sent, a retry on a stale connection, a reroute when the
replica refuses it, the answer read (a whole response, or the stream pumped to the client as it
comes), and what came of it (`Exchanged`, with the `EngineResult`).

When a replica is ejected: a call's failure counts against its replica here alone
(`ReplicaExchange.blame`), the prober's in `upstream.Upstreams.health`, and `routing.Health`
decides when the count ejects it. The stream is read at the engine's pace whatever the client
does, each token stamped with the policy version live when its chunk arrives (invariant 4).
Nothing here records or ends the client's response: the pipeline does, in that order."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol
from uuid import UUID

import aiohttp
import msgspec

from core.store import calls as calls_store
from gateway.call_values import EngineResult
from gateway.engine_client import EngineResponse
from gateway.engine_reading import EngineReading
from gateway.protocols.errors import GatewayError
from gateway.upstream import StreamStalled, sse_batches

if TYPE_CHECKING:
    from aiohttp import web

    from core.store.conn import Pool
    from gateway.capture import Capture
    from gateway.config import GatewayConfig
    from gateway.engine_body import EngineRequest
    from gateway.engine_ids import Pieces
    from gateway.policy_version import PolicyVersion
    from gateway.protocols.adapter import Stream
    from gateway.stage_cpu import Clock
    from gateway.upstream import Upstreams

_decode = msgspec.json.decode
_encode = msgspec.json.encode

# A streamed response's bytes its client has not taken yet, at most: about 80,000 tokens of
# chat chunks, far beyond what a harness that reads leaves behind.
UNSENT_LIMIT = 16 << 20


class Placement(NamedTuple):
    upstream: str
    rerouted: str | None  # why the call left its rollout's replica


class Relay(NamedTuple):
    """The client's side of a streamed call, opened once the engine answered."""

    stream: Stream  # the protocol's translation of the engine's chunks
    out: web.StreamResponse
    transport: asyncio.Transport | None  # its write buffer is what the client has not taken


@dataclass(frozen=True, slots=True)
class Exchanged:
    """What came of a call's exchange with the engine."""

    result: EngineResult
    status: str  # ok | failed | aborted
    failure: GatewayError | None  # what the client is to be told (None: it went well)
    prompt_json: Pieces | None  # the engine's prompt ids as JSON pieces (gateway.engine_ids)
    payload: dict[str, Any] | None = None  # a whole response, decoded
    relay: Relay | None = None  # the client's stream, if it was opened
    # The client went away mid-stream: re-raised once the call is recorded.
    gone: BaseException | None = None


class RunningCall(Protocol):
    """What the exchange sees of a running call (`gateway.admission.RunningCall`)."""

    rollout_id: UUID
    started: float  # perf_counter; its time to first token counts from it
    aborted: tuple[str, str] | None  # (status to record, why) once ended from outside

    def abort(self, status: str, reason: str) -> None: ...


class EngineExchange(Protocol):
    """The engine stage as the pipeline sees it."""

    async def place(self, rollout_id: UUID, clock: Clock) -> Placement:
        """The replica a rollout's next call goes to."""
        ...

    async def exchange(
        self,
        call: RunningCall,
        placement: Placement,
        sent: EngineRequest,
        open_stream: Callable[[], Awaitable[Relay]],
        clock: Clock,
    ) -> Exchanged:
        """`sent` to the replica and its answer read; a streamed answer is relayed to the client
        (`open_stream` starts its response) up to, not including, its last event. Raises only
        what cancels the call from outside (not an abort: that is an outcome)."""
        ...


class _ErrorDetail(msgspec.Struct):
    message: str | None = None


class _ErrorBody(msgspec.Struct):
    """An engine's error body: `{"error": {"message": ...}}`, or the message at the top."""

    error: _ErrorDetail | None = None
    message: str | None = None


def upstream_error(status: int, raw: bytes) -> GatewayError:
    """An engine error, in the gateway's neutral form, keeping the engine's message."""
    try:
        body = _decode(raw, type=_ErrorBody)
        message = (body.error.message if body.error is not None else body.message) or (
            raw.decode(errors="replace"))
    except msgspec.DecodeError:  # not JSON, or not an error body
        message = raw.decode(errors="replace")[:2000]
    lowered = message.lower()
    if any(w in lowered for w in ("context length", "maximum context", "too long", "input length")):
        return GatewayError(400, message, "context_length_exceeded", code="context_length_exceeded")
    if 400 <= status < 500:
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        return GatewayError(status, message, kind)
    return GatewayError(502, f"upstream error {status}: {message}", "upstream_error")


def stale_connection(exc: BaseException | None) -> bool:
    """The request met a kept-alive connection the engine had just closed (it was reset while
    the request was written, or closed before any answer): a race with the engine's idle
    timeout, not a failing replica. Whatever the engine might have started on it was aborted
    when the connection went, and nothing of it reached the call: asking again is safe."""
    return isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError) and not (
        isinstance(exc, aiohttp.ClientConnectorError)
    )


def abort_error(call: RunningCall) -> GatewayError:
    """What the client of a call ended from outside is told."""
    assert call.aborted is not None
    return GatewayError(503, call.aborted[1], "overloaded_error")


def unusable(cap: Capture) -> GatewayError | None:
    """Why an answer that ended without an error cannot be trained on, or None."""
    if cap.finish_reason in ("abort", "error"):
        return GatewayError(
            502, f"engine ended the response with {cap.finish_reason!r}", "upstream_error"
        )
    problem = cap.check()
    if problem is not None:
        return GatewayError(
            502, f"engine response unusable for training: {problem}", "upstream_error"
        )
    return None


_CLIENT_GONE = GatewayError(499, "client disconnected", "api_error")


class _Attempt(NamedTuple):
    """One try of a call on one replica."""

    call: RunningCall
    sent: EngineRequest
    reading: EngineReading
    upstream: str
    rerouted: str | None
    clock: Clock
    version_at_start: int  # the policy version live when the engine was asked

    def ended(
        self, status: str, failure: GatewayError | None, payload: dict[str, Any] | None = None,
        relay: Relay | None = None, gone: BaseException | None = None,
    ) -> Exchanged:  # fmt: skip
        reading = self.reading
        return Exchanged(reading.result(self.upstream, self.rerouted), status, failure,
                         reading.prompt_json, payload, relay, gone)  # fmt: skip


class ReplicaExchange:
    """The engine stage over the vLLM replicas."""

    def __init__(
        self, config: GatewayConfig, pool: Pool, upstreams: Upstreams, policy: PolicyVersion
    ) -> None:
        self._config = config
        self._pool = pool
        self._upstreams = upstreams
        self._policy = policy

    async def place(self, rollout_id: UUID, clock: Clock) -> Placement:
        previous = self._upstreams.placed(rollout_id)
        if previous is None:  # first call here: continue where another gateway placed it
            previous = await clock.wait("parse", self._last_upstream(rollout_id))
        return Placement(*self._upstreams.route(rollout_id, previous))

    async def _last_upstream(self, rollout_id: UUID) -> str | None:
        async with self._pool.acquire() as conn:
            return await calls_store.last_upstream(conn, rollout_id)

    def blame(
        self, upstream: str, exc: BaseException | None, reason: str, call: RunningCall
    ) -> None:
        """A call's failure on `upstream` counts against it, unless it was a timeout: a long
        generation (or prompt) runs past --upstream-timeout on a healthy engine, and a frozen
        one fails the prober's probes."""
        if not isinstance(exc, TimeoutError):
            self._upstreams.failed(upstream, reason, call.rollout_id)

    def _moved(self, err: GatewayError, call: RunningCall, upstream: str) -> Placement | None:
        """Where a call whose replica refused the connection goes now, if anywhere: the engine
        took nothing, so another replica can take the call as is."""
        if not isinstance(err.__cause__, aiohttp.ClientConnectorError):
            return None
        try:
            return Placement(*self._upstreams.route(call.rollout_id, upstream, avoid=upstream))
        except GatewayError:
            return None

    async def exchange(
        self,
        call: RunningCall,
        placement: Placement,
        sent: EngineRequest,
        open_stream: Callable[[], Awaitable[Relay]],
        clock: Clock,
    ) -> Exchanged:
        reading = EngineReading(sent, call.started)
        upstreams = self._upstreams
        # A frozen engine never answers a whole-response call; ejecting its replica ends it.
        on_eject: Callable[[str], None] | None = (
            None if sent.streamed else (lambda why: call.abort("failed", why))
        )
        for attempt in range(2):
            at = _Attempt(call, sent, reading, *placement, clock, self._policy.value)
            upstreams.begin(at.upstream, on_eject)
            try:
                try:
                    post = upstreams.post if sent.streamed else upstreams.post_whole
                    resp = await clock.wait("engine", post(at.upstream, sent.path, sent.encoded))
                except GatewayError as err:
                    if attempt == 0 and stale_connection(err.__cause__):
                        continue  # once more, on a new connection
                    self.blame(at.upstream, err.__cause__, err.message, call)
                    moved = self._moved(err, call, at.upstream) if attempt == 0 else None
                    if moved is not None:
                        placement = moved
                        continue
                    return at.ended("failed", err)
                async with resp:
                    return await self._answer(at, resp, open_stream)
            except asyncio.CancelledError:
                if call.aborted is None:
                    raise
                task = asyncio.current_task()
                assert task is not None  # a coroutine runs in a task
                task.uncancel()
                return at.ended(call.aborted[0], abort_error(call))
            finally:
                upstreams.end(at.upstream, on_eject)
        raise AssertionError("unreachable")

    async def _answer(
        self, at: _Attempt, resp: aiohttp.ClientResponse | EngineResponse,
        open_stream: Callable[[], Awaitable[Relay]],
    ) -> Exchanged:  # fmt: skip
        if resp.status != 200:
            if resp.status >= 500:
                self.blame(at.upstream, None, f"HTTP {resp.status}", at.call)
            return at.ended("failed", upstream_error(resp.status, await resp.read()))
        if not at.sent.streamed:
            return await self._whole(at, resp)
        assert isinstance(resp, aiohttp.ClientResponse)  # streams go through aiohttp's client
        return await self._streamed(at, resp, await open_stream())

    async def _whole(
        self, at: _Attempt, resp: aiohttp.ClientResponse | EngineResponse
    ) -> Exchanged:
        try:
            raw = await at.clock.wait("engine", resp.read())
        except (TimeoutError, aiohttp.ClientError) as exc:
            message = f"upstream response broke: {exc or type(exc).__name__}"
            self.blame(at.upstream, exc, message, at.call)
            return at.ended("failed", GatewayError(502, message, "upstream_error"))
        # The tokens were sampled under the version live at the start or the one at the end:
        # stamp the older, so staleness is never underestimated.
        payload = at.reading.whole(raw, min(at.version_at_start, self._policy.value))
        problem = at.reading.capture.check()
        at.clock.lap("engine")
        self._upstreams.succeeded(at.upstream)
        if problem is None:
            return at.ended("ok", None, payload)
        failure = GatewayError(
            502, f"engine response unusable for training: {problem}", "upstream_error"
        )
        return at.ended("failed", failure, payload)

    async def _streamed(
        self, at: _Attempt, resp: aiohttp.ClientResponse, relay: Relay
    ) -> Exchanged:
        call, upstream = at.call, at.upstream
        status = "failed"  # if it fails
        try:
            failure = await self._pump(at.reading, resp, relay, at.clock)
        except asyncio.CancelledError as exc:
            if call.aborted is None:  # the client went away
                resp.close()  # closing the upstream response aborts the engine's request
                return at.ended("aborted", _CLIENT_GONE, relay=relay, gone=exc)
            task = asyncio.current_task()
            assert task is not None  # a coroutine runs in a task
            task.uncancel()
            status, failure = call.aborted[0], abort_error(call)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError) as exc:
            resp.close()
            return at.ended("aborted", _CLIENT_GONE, relay=relay, gone=exc)
        except StreamStalled as exc:
            failure = GatewayError(504, f"upstream {upstream}: {exc}", "upstream_error")
            self.blame(upstream, exc, str(exc), call)
        except (TimeoutError, aiohttp.ClientError) as exc:
            failure = GatewayError(
                502, f"upstream stream broke: {exc or type(exc).__name__}", "upstream_error"
            )
            self.blame(upstream, exc, failure.message, call)
        failure = failure or unusable(at.reading.capture)
        if failure is None:
            self._upstreams.succeeded(upstream)
            return at.ended("ok", None, relay=relay)
        resp.close()  # stop the engine if it is still generating
        return at.ended(status, failure, relay=relay)

    async def _pump(
        self, reading: EngineReading, resp: aiohttp.ClientResponse, relay: Relay, clock: Clock
    ) -> GatewayError | None:
        """Engine chunks to the client until the engine's end; the failure that stopped it, if
        any (the engine's error event, a chunk the protocol cannot express, a client that
        leaves too much unread)."""
        cfg = self._config
        transport = relay.transport
        batches = sse_batches(resp, cfg.ttft_timeout_s, cfg.stream_idle_timeout_s)
        try:
            while True:
                try:
                    batch = await clock.wait("stream", anext(batches))
                except StopAsyncIteration:
                    return None
                done, failure = await self._relay_batch(batch, reading, relay, clock)
                if not done and transport is not None and transport.is_closing():
                    # The client left (the batch is captured all the same). A write would say
                    # so, but chunks whose text is empty write nothing, and the engine would
                    # generate on for no one.
                    raise ConnectionResetError("the client closed its connection")
                if failure is None and transport is not None and (
                    transport.get_write_buffer_size() > UNSENT_LIMIT
                ):
                    failure = GatewayError(
                        408, f"the client read too slowly: over {UNSENT_LIMIT >> 20} MiB of "
                        "the response waited for it", "api_error")
                if done or failure is not None:
                    return failure
        finally:
            await batches.aclose()  # stops its timer now, not when the generator is collected

    async def _relay_batch(
        self, batch: list[bytes], reading: EngineReading, relay: Relay, clock: Clock
    ) -> tuple[bool, GatewayError | None]:
        """One read's chunks captured (stamped with the version live now) and written to the
        client; (the engine's end was among them, the failure that stopped them)."""
        stream, out = relay.stream, relay.out
        pieces: list[bytes] = []
        done, failure = False, None
        for data in batch:
            if data == b"[DONE]":
                done = True
                break
            chunk = reading.chunk(data)
            if "error" in chunk and not chunk.get("choices"):
                e = chunk["error"]
                failure = upstream_error(e.get("code") or 500, _encode(chunk))
                break
            first_token = reading.captured(chunk, self._policy.value)
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
                    await clock.wait("stream", out.write(first))
        joined = b"".join(pieces)
        if joined:  # an empty write could read as the end of a chunked body
            await clock.wait("stream", out.write(joined))
        return done, failure
