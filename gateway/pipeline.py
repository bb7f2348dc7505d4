"""One model call, whatever the protocol, in straight-line stages: parse (`call_request`), plan
(`continuation.planner`), the engine exchange (`engine_exchange`), record (`recording`), and
respond. Recording comes before the response's end on every path, so a call the client saw
finish is durable (invariant 2); this module alone decides what the client is told when
something fails, the call is aborted from outside, or the client goes away."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
from aiohttp import web

from core.store import calls as calls_store
from gateway import call_request
from gateway.admission import RunningCall
from gateway.app_keys import STREAM_STARTED
from gateway.call_values import Outcome
from gateway.engine_exchange import EngineCall, stale_connection, upstream_error
from gateway.protocols.adapter import CHAT_PATH, Adapter, Stream
from gateway.protocols.errors import GatewayError
from gateway.stage_cpu import Clock, StageCpu
from gateway.upstream import StreamStalled, sse_batches

if TYPE_CHECKING:
    from core.store.conn import Pool
    from gateway.admission import Admission
    from gateway.capture import Capture
    from gateway.config import GatewayConfig
    from gateway.continuation.planner import Continuer
    from gateway.metrics import Metrics
    from gateway.policy_version import PolicyVersion
    from gateway.recording import Recording
    from gateway.rollout_memory import RolloutMemory
    from gateway.served_models import ServedModels
    from gateway.upstream import Upstreams

log = logging.getLogger(__name__)

_encode = msgspec.json.encode

# A streamed response's bytes its client has not taken yet, at most: about 80,000 tokens of
# chat chunks, far beyond what a harness that reads leaves behind.
_UNSENT_LIMIT = 16 << 20


def _replica_fault(exc: BaseException | None) -> bool:
    """Whether a call's failure tells of its replica. A timeout does not: a long generation
    (or prompt) runs past --upstream-timeout on a healthy engine, and a frozen one fails the
    prober's probes."""
    return not isinstance(exc, TimeoutError)


def _abort_error(call: RunningCall) -> GatewayError:
    """What the client of a call ended from outside is told."""
    assert call.aborted is not None
    return GatewayError(503, call.aborted[1], "overloaded_error")


class Pipeline:
    def __init__(
        self,
        config: GatewayConfig,
        pool: Pool,
        upstreams: Upstreams,
        planner: Continuer,
        recording: Recording,
        memory: RolloutMemory,
        admission: Admission,
        policy: PolicyVersion,
        models: ServedModels,
        metrics: Metrics,
    ) -> None:
        self._config = config
        self._pool = pool
        self._upstreams = upstreams
        self._planner = planner
        self._recording = recording
        self._recent = memory.recent
        self._admission = admission
        self._policy = policy
        self._models = models
        self._metrics = metrics
        self.cpu = StageCpu()

    async def serve(
        self, request: web.Request, proto: Adapter[Any, Any], raw: bytes, rollout_id: uuid.UUID
    ) -> web.StreamResponse:
        """Serve one harness call through `proto`."""
        clock = self.cpu.clock()
        self._recording.admit()
        self._recording.admit_rollout(rollout_id)
        earlier = self._recent.entries(rollout_id) or ()
        req, layout = call_request.decode(
            proto, raw, [c.request for c in reversed(earlier) if c.request is not None]
        )
        self._metrics.request_decoded(proto.name, layout is not None and layout.resumed > 0)
        translated = await call_request.translate(
            proto, req, layout, raw, request.headers, self._response_state(rollout_id, clock),
            self._model_check(clock), self._config.temperature, self._config.default_max_tokens,
        )  # fmt: skip
        call = RunningCall(rollout_id)
        previous = self._upstreams.placed(rollout_id)
        if previous is None:  # first call here: continue where another gateway placed it
            previous = await clock.wait("parse", self._last_upstream(rollout_id))
        upstream, rerouted = self._upstreams.route(rollout_id, previous)
        clock.lap("parse")
        plan = None
        if proto.upstream_path == CHAT_PATH:  # legacy completions has no messages
            plan = await self._planner.prepare(rollout_id, upstream, translated.body, clock)
        engine = EngineCall(proto.passes_engine_ids, plan, upstream, rerouted, call.started)
        encoded = engine.body(translated.body, translated.call.requested, translated.client_ids)
        clock.lap("plan")
        call.task = asyncio.current_task()
        self._admission.calls.add(call)
        try:
            return await self._forward(request, proto, translated, call, engine, encoded, clock)
        finally:
            self._admission.calls.discard(call)

    def _response_state(
        self, rollout_id: uuid.UUID, clock: Clock
    ) -> Callable[[str], Awaitable[dict[str, Any] | None]]:
        async def lookup(response_id: str) -> dict[str, Any] | None:
            async with self._pool.acquire() as conn:
                return await clock.wait(
                    "parse", calls_store.response_state(conn, rollout_id, response_id)
                )

        return lookup

    def _model_check(self, clock: Clock) -> Callable[[str], Awaitable[None]]:
        return lambda model: clock.wait("parse", self._models.check(model))

    async def _last_upstream(self, rollout_id: uuid.UUID) -> str | None:
        async with self._pool.acquire() as conn:
            return await calls_store.last_upstream(conn, rollout_id)

    async def _record(
        self,
        call: RunningCall,
        translated: call_request.Translated,
        engine: EngineCall,
        status: str,
        error: str | None = None,
        state_source: dict[str, Any] | bytes | None = None,
        clock: Clock | None = None,
    ) -> None:
        """Freezes the call's outcome and returns once recording has made it durable."""
        call.recording = True
        stored = translated.stored_state
        outcome = Outcome(
            call_id=call.id,
            rollout_id=call.rollout_id,
            status=status,
            error=error,
            started_at=call.started_at,
            latency_ms=(time.perf_counter() - call.started) * 1000,
            request=translated.call,
            plan=engine.plan,
            result=engine.result(),
            stored_state=stored(state_source)
            if stored is not None and state_source is not None and status == "ok"
            else None,
            prompt_json=engine.prompt_json,
        )
        if clock is None:
            await self._recording.record(outcome)
        else:
            await clock.wait("record", self._recording.record(outcome))
        log.debug("recorded call %s of rollout %s: %s on %s%s", call.id, call.rollout_id,
                  status, engine.upstream, f" (rerouted: {engine.rerouted})" if engine.rerouted
                  else "")  # fmt: skip

    async def _forward(
        self, request: web.Request, proto: Adapter[Any, Any], translated: call_request.Translated,
        call: RunningCall, engine: EngineCall, encoded: bytes, clock: Clock,
    ) -> web.StreamResponse:  # fmt: skip
        upstreams = self._upstreams
        streamed = bool(translated.body.get("stream"))
        # A frozen engine never answers a whole-response call; ejecting its replica ends it.
        on_eject: Callable[[str], None] | None = (
            None if streamed else (lambda why: call.abort("failed", why))
        )
        for attempt in range(2):
            version_at_start = self._policy.value
            upstream = engine.upstream
            upstreams.begin(upstream, on_eject)
            try:
                try:
                    resp = await clock.wait(
                        "engine", upstreams.post(upstream, proto.upstream_path, encoded)
                    )
                except GatewayError as err:
                    if attempt == 0 and stale_connection(err.__cause__):
                        continue  # once more, on a new connection
                    if _replica_fault(err.__cause__):
                        upstreams.failed(upstream, err.message, call.rollout_id)
                    if attempt == 0 and self._rerouted(err, call, engine):
                        continue
                    await self._record(call, translated, engine, "failed", err.message)
                    raise
                async with resp:
                    if resp.status != 200:
                        if resp.status >= 500:
                            upstreams.failed(upstream, f"HTTP {resp.status}", call.rollout_id)
                        err = upstream_error(resp.status, await resp.read())
                        await self._record(call, translated, engine, "failed", err.message)
                        raise err
                    if not streamed:
                        return await self._whole(
                            proto, translated, call, engine, resp, version_at_start, clock
                        )
                    return await self._streamed(request, proto, translated, call, engine, resp,
                                                clock)  # fmt: skip
            except asyncio.CancelledError:
                if call.aborted is None:
                    raise
                task = asyncio.current_task()
                assert task is not None  # a coroutine runs in a task
                task.uncancel()
                await self._record(call, translated, engine, *call.aborted)
                raise _abort_error(call) from None
            finally:
                upstreams.end(upstream, on_eject)
        raise AssertionError("unreachable")

    def _rerouted(self, err: GatewayError, call: RunningCall, engine: EngineCall) -> bool:
        """Whether a call whose replica refused the connection now goes to another one: the
        engine took nothing, so another replica can take the call as is."""
        if not isinstance(err.__cause__, aiohttp.ClientConnectorError):
            return False
        try:
            engine.upstream, engine.rerouted = self._upstreams.route(
                call.rollout_id, engine.upstream, avoid=engine.upstream
            )
        except GatewayError:
            return False
        return True

    async def _whole(
        self, proto: Adapter[Any, Any], translated: call_request.Translated, call: RunningCall,
        engine: EngineCall, resp: aiohttp.ClientResponse, version_at_start: int, clock: Clock,
    ) -> web.Response:  # fmt: skip
        try:
            raw = await clock.wait("engine", resp.read())
        except (TimeoutError, aiohttp.ClientError) as exc:
            message = f"upstream response broke: {exc or type(exc).__name__}"
            if _replica_fault(exc):
                self._upstreams.failed(engine.upstream, message, call.rollout_id)
            await self._record(call, translated, engine, "failed", message)
            raise GatewayError(502, message, "upstream_error") from None
        # The tokens were sampled under the version live at the start or the one at the end:
        # stamp the older, so staleness is never underestimated.
        payload = engine.whole(raw, min(version_at_start, self._policy.value))
        problem = engine.capture.check()
        clock.lap("engine")
        out = proto.from_upstream(payload, translated.ctx) if problem is None else b""
        clock.lap("respond")
        self._upstreams.succeeded(engine.upstream)
        await self._record(call, translated, engine, "ok" if problem is None else "failed",
                           problem, out, clock)  # fmt: skip
        if problem is not None:
            raise GatewayError(
                502, f"engine response unusable for training: {problem}", "upstream_error"
            )
        response = web.Response(body=out, content_type="application/json")
        clock.lap("respond")
        return response

    async def _streamed(
        self, request: web.Request, proto: Adapter[Any, Any], translated: call_request.Translated,
        call: RunningCall, engine: EngineCall, resp: aiohttp.ClientResponse, clock: Clock,
    ) -> web.StreamResponse:
        out = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await clock.wait("respond", out.prepare(request))
        request[STREAM_STARTED] = out
        # The engine is read at its own pace, whatever the client does: each token is stamped
        # with the policy version live when it arrives, so a client that reads slowly across a
        # weight sync cannot move tokens to the new version (issue #28). What the client has not
        # taken waits in the transport, up to `_UNSENT_LIMIT`; past it the call fails.
        transport = request.transport
        if transport is not None:
            transport.set_write_buffer_limits(high=2 * _UNSENT_LIMIT)
        stream = proto.stream(translated.ctx)
        status = "failed"  # if it fails
        try:
            failure = await self._pump(engine, resp, stream, out, transport, clock)
        except asyncio.CancelledError:
            if call.aborted is None:  # the client went away
                resp.close()  # closing the upstream response aborts the engine's request
                await self._record_abandoned(call, translated, engine)
                raise
            task = asyncio.current_task()
            assert task is not None  # a coroutine runs in a task
            task.uncancel()
            status, failure = call.aborted[0], _abort_error(call)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            resp.close()
            await self._record_abandoned(call, translated, engine)
            raise
        except StreamStalled as exc:
            failure = GatewayError(504, f"upstream {engine.upstream}: {exc}", "upstream_error")
            self._upstreams.failed(engine.upstream, str(exc), call.rollout_id)
        except (TimeoutError, aiohttp.ClientError) as exc:
            failure = GatewayError(
                502, f"upstream stream broke: {exc or type(exc).__name__}", "upstream_error"
            )
            if _replica_fault(exc):
                self._upstreams.failed(engine.upstream, failure.message, call.rollout_id)
        failure = failure or _unusable(engine.capture)
        if failure is None:
            self._upstreams.succeeded(engine.upstream)
        else:
            resp.close()  # stop the engine if it is still generating
        state_source = None
        if failure is None and translated.stored_state is not None:
            state_source = stream.response()
        clock.lap("respond")
        failure = await self._record_stream(call, translated, engine, status, failure,
                                            state_source, clock)  # fmt: skip
        await _end_stream(out, stream, failure, clock)
        if transport is not None and not transport.is_closing():
            transport.set_write_buffer_limits()  # the connection's next request: as before
        return out

    async def _pump(
        self, engine: EngineCall, resp: aiohttp.ClientResponse, stream: Stream,
        out: web.StreamResponse, transport: asyncio.Transport | None, clock: Clock,
    ) -> GatewayError | None:  # fmt: skip
        """Engine chunks to the client until the engine's end; the failure that stopped it, if
        any (the engine's error event, a chunk the protocol cannot express, a client that
        leaves too much unread)."""
        cfg = self._config
        batches = sse_batches(resp, cfg.ttft_timeout_s, cfg.stream_idle_timeout_s)
        try:
            while True:
                try:
                    batch = await clock.wait("stream", anext(batches))
                except StopAsyncIteration:
                    return None
                done, failure = await self._relay_batch(batch, engine, stream, out, clock)
                if failure is None and transport is not None and (
                    transport.get_write_buffer_size() > _UNSENT_LIMIT
                ):
                    failure = GatewayError(
                        408, f"the client read too slowly: over {_UNSENT_LIMIT >> 20} MiB of "
                        "the response waited for it", "api_error")
                if done or failure is not None:
                    return failure
        finally:
            await batches.aclose()  # stops its timer now, not when the generator is collected

    async def _relay_batch(
        self, batch: list[bytes], engine: EngineCall, stream: Stream, out: web.StreamResponse,
        clock: Clock,
    ) -> tuple[bool, GatewayError | None]:  # fmt: skip
        """One read's chunks captured (stamped with the version live now) and written to the
        client; (the engine's end was among them, the failure that stopped them)."""
        pieces: list[bytes] = []
        done, failure = False, None
        for data in batch:
            if data == b"[DONE]":
                done = True
                break
            chunk = engine.chunk(data)
            if "error" in chunk and not chunk.get("choices"):
                e = chunk["error"]
                failure = upstream_error(e.get("code") or 500, _encode(chunk))
                break
            first_token = engine.captured(chunk, self._policy.value)
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

    async def _record_stream(
        self, call: RunningCall, translated: call_request.Translated, engine: EngineCall,
        status: str, failure: GatewayError | None, state_source: dict[str, Any] | bytes | None,
        clock: Clock,
    ) -> GatewayError | None:  # fmt: skip
        """Records the streamed call; the failure its client is to be told of (a call that
        could not be recorded must not end as a success)."""
        try:
            await self._record(
                call, translated, engine, "ok" if failure is None else status,
                None if failure is None else failure.message, state_source, clock,
            )  # fmt: skip
        except GatewayError as err:
            return err
        except Exception:  # noqa: BLE001 - a bug, but still never an end that looks like success
            log.exception("call %s not recorded", call.id)
            return GatewayError(
                500, "the call could not be recorded; see the gateway log", "api_error"
            )
        return failure

    async def _record_abandoned(
        self, call: RunningCall, translated: call_request.Translated, engine: EngineCall
    ) -> None:
        """Records a call whose client went away; nobody is left to tell if that fails."""
        try:
            await self._record(call, translated, engine, "aborted", "client disconnected")
        except GatewayError as err:
            log.warning("aborted call %s not recorded: %s", call.id, err.message)


def _unusable(cap: Capture) -> GatewayError | None:
    """Why a stream that ended without an error cannot be trained on, or None."""
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


async def _end_stream(out: web.StreamResponse, stream: Stream, failure: GatewayError | None,
                      clock: Clock) -> None:
    """The stream's last event: its end, or the failure in the protocol's terms."""
    try:
        end = stream.close() if failure is None else stream.fail(failure)
        await clock.wait("respond", out.write(end))
        await out.write_eof()
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        pass  # recorded already; the client left after the last token
