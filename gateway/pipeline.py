"""One model call, whatever the protocol, in straight-line stages: parse (`call_request`), plan
(where it goes and how the engine gets its prompt: `continuation.planner`, `engine_body`), the
engine exchange (`engine_exchange`), record (`recording`), and respond. Recording comes before
the response's end on every path, so a call the client saw finish is durable (invariant 2); this
module alone decides what the client is told once the exchange is over."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from core.store import calls as calls_store
from gateway import call_request, engine_body
from gateway.admission import RunningCall
from gateway.app_keys import STREAM_STARTED
from gateway.call_values import Outcome
from gateway.engine_exchange import UNSENT_LIMIT, Relay
from gateway.protocols.adapter import CHAT_PATH, Adapter
from gateway.protocols.errors import GatewayError
from gateway.stage_cpu import Clock, StageCpu

if TYPE_CHECKING:
    from core.store.conn import Pool
    from gateway.admission import Admission
    from gateway.config import GatewayConfig
    from gateway.continuation.planner import Continuer, Turn
    from gateway.engine_exchange import EngineExchange, Exchanged, Placement
    from gateway.metrics import Metrics
    from gateway.recording import Recording
    from gateway.rollout_memory import RolloutMemory
    from gateway.served_models import ServedModels

log = logging.getLogger(__name__)


class Pipeline:
    def __init__(
        self,
        config: GatewayConfig,
        pool: Pool,
        engine: EngineExchange,
        planner: Continuer,
        recording: Recording,
        memory: RolloutMemory,
        admission: Admission,
        models: ServedModels,
        metrics: Metrics,
    ) -> None:
        self._config = config
        self._pool = pool
        self._engine = engine
        self._planner = planner
        self._recording = recording
        self._recent = memory.recent
        self._admission = admission
        self._models = models
        self._metrics = metrics
        self.cpu = StageCpu()

    async def serve(
        self, request: web.Request, proto: Adapter[Any, Any], raw: bytes, rollout_id: uuid.UUID
    ) -> web.StreamResponse:
        """Serve one harness call through `proto`."""
        clock = self.cpu.clock()
        translated = await self._parse(request, proto, raw, rollout_id, clock)
        call = RunningCall(rollout_id)
        placement = await self._engine.place(rollout_id, clock)
        clock.lap("parse")
        plan, sent = await self._plan(proto, rollout_id, placement, translated, clock)
        clock.lap("plan")
        call.task = asyncio.current_task()
        self._admission.calls.add(call)
        try:
            done = await self._engine.exchange(
                call, placement, sent, self._opener(request, proto, translated, clock), clock
            )
            if done.gone is not None:
                await self._record_abandoned(call, translated, plan, done)
                raise done.gone
            out, state, failure = self._response(proto, translated, done)
            clock.lap("respond")
            failure = await self._recorded(call, translated, plan, done, failure, state, clock)
            return await _respond(done, out, failure, clock)
        finally:
            self._admission.calls.discard(call)

    async def _parse(
        self, request: web.Request, proto: Adapter[Any, Any], raw: bytes,
        rollout_id: uuid.UUID, clock: Clock,
    ) -> call_request.Translated:  # fmt: skip
        self._recording.admit()
        self._recording.admit_rollout(rollout_id)
        earlier = self._recent.entries(rollout_id) or ()
        req, layout = call_request.decode(
            proto, raw, [c.request for c in reversed(earlier) if c.request is not None]
        )
        self._metrics.request_decoded(proto.name, layout is not None and layout.resumed > 0)
        return await call_request.translate(
            proto, req, layout, raw, request.headers, self._response_state(rollout_id, clock),
            self._model_check(clock), self._config.temperature, self._config.default_max_tokens,
        )  # fmt: skip

    async def _plan(
        self, proto: Adapter[Any, Any], rollout_id: uuid.UUID, placement: Placement,
        translated: call_request.Translated, clock: Clock,
    ) -> tuple[Turn | None, engine_body.EngineRequest]:  # fmt: skip
        """How the engine gets the call's prompt, and the body it is sent."""
        plan = None
        if proto.upstream_path == CHAT_PATH:  # legacy completions has no messages
            plan = await self._planner.prepare(
                rollout_id, placement.upstream, translated.fields, clock
            )
        sent = engine_body.build(
            translated.fields, translated.sampling, proto.upstream_path,
            proto.passes_engine_ids, plan, translated.wants_ids,
        )  # fmt: skip
        return plan, sent

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

    def _opener(
        self, request: web.Request, proto: Adapter[Any, Any],
        translated: call_request.Translated, clock: Clock,
    ) -> Callable[[], Awaitable[Relay]]:  # fmt: skip
        """Starts a streamed call's response, once the engine answered."""

        async def open_stream() -> Relay:
            out = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await clock.wait("respond", out.prepare(request))
            request[STREAM_STARTED] = out
            # The engine is read at its own pace, whatever the client does (invariant 4; issue
            # #28): what the client has not taken waits in the transport, up to
            # `UNSENT_LIMIT`; past it the call fails.
            transport = request.transport
            if transport is not None:
                transport.set_write_buffer_limits(high=2 * UNSENT_LIMIT)
            return Relay(proto.stream(translated.ctx), out, transport)

        return open_stream

    def _response(
        self, proto: Adapter[Any, Any], translated: call_request.Translated, done: Exchanged
    ) -> tuple[bytes, dict[str, Any] | bytes | None, GatewayError | None]:
        """(a whole response's body, what a stateful protocol keeps of the response, the
        failure the client is to be told of)."""
        if done.failure is not None:
            return b"", None, done.failure
        if done.relay is not None:
            stream = done.relay.stream
            return b"", stream.response() if translated.stored_state is not None else None, None
        assert done.payload is not None  # a whole response that went well
        try:
            out = proto.from_upstream(done.payload, translated.ctx)
        except GatewayError as err:  # the protocol cannot express what the engine sent
            return b"", None, err
        return out, out, None

    async def _record(
        self, call: RunningCall, translated: call_request.Translated, plan: Turn | None,
        done: Exchanged, failure: GatewayError | None,
        state_source: dict[str, Any] | bytes | None, clock: Clock | None,
    ) -> None:  # fmt: skip
        """Freezes the call's outcome and returns once recording has made it durable."""
        call.recording = True
        stored = translated.stored_state
        status = "ok" if failure is None else "failed" if done.status == "ok" else done.status
        outcome = Outcome(
            call_id=call.id,
            rollout_id=call.rollout_id,
            status=status,
            error=None if failure is None else failure.message,
            started_at=call.started_at,
            latency_ms=(time.perf_counter() - call.started) * 1000,
            request=translated.call,
            plan=None if plan is None else plan.confirmed(done.result.prompt),
            result=done.result,
            stored_state=stored(state_source)
            if stored is not None and state_source is not None and status == "ok"
            else None,
            prompt_json=done.prompt_json,
        )
        if clock is None:
            await self._recording.record(outcome)
        else:
            await clock.wait("record", self._recording.record(outcome))
        res = done.result
        log.debug("recorded call %s of rollout %s: %s on %s%s", call.id, call.rollout_id,
                  status, res.upstream, f" (rerouted: {res.rerouted})" if res.rerouted
                  else "")  # fmt: skip

    async def _recorded(
        self, call: RunningCall, translated: call_request.Translated, plan: Turn | None,
        done: Exchanged, failure: GatewayError | None,
        state_source: dict[str, Any] | bytes | None, clock: Clock,
    ) -> GatewayError | None:  # fmt: skip
        """Records the call; the failure its client is to be told of (a call that could not be
        recorded must not end as a success)."""
        try:
            await self._record(call, translated, plan, done, failure, state_source, clock)
        except GatewayError as err:
            return err
        except Exception:  # noqa: BLE001 - a bug, but still never an end that looks like success
            log.exception("call %s not recorded", call.id)
            return GatewayError(
                500, "the call could not be recorded; see the gateway log", "api_error"
            )
        return failure

    async def _record_abandoned(
        self, call: RunningCall, translated: call_request.Translated, plan: Turn | None,
        done: Exchanged,
    ) -> None:  # fmt: skip
        """Records a call whose client went away; nobody is left to tell if that fails."""
        try:
            await self._record(call, translated, plan, done, done.failure, None, None)
        except GatewayError as err:
            log.warning("aborted call %s not recorded: %s", call.id, err.message)


async def _respond(
    done: Exchanged, out: bytes, failure: GatewayError | None, clock: Clock
) -> web.StreamResponse:
    """The response's end: a whole response or its error, or a stream's last event."""
    relay = done.relay
    if relay is None:
        if failure is not None:
            raise failure
        response = web.Response(body=out, content_type="application/json")
        clock.lap("respond")
        return response
    try:
        end = relay.stream.close() if failure is None else relay.stream.fail(failure)
        await clock.wait("respond", relay.out.write(end))
        await relay.out.write_eof()
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        pass  # recorded already; the client left after the last token
    transport = relay.transport
    if transport is not None and not transport.is_closing():
        transport.set_write_buffer_limits()  # the connection's next request: as before
    return relay.out
