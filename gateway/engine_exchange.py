"""The engine side of one model call: the body as the replica is sent it (with the prompt ids
of an exact continuation), its response or stream decoded into a `Capture`, and what that comes
to (`EngineResult`). The engine's id arrays are handed to the capture as arrays, never as
Python ints (`gateway.engine_ids`): a speed device private to this stage."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
import numpy as np

from core.store.tokens import IDS, LOGPROBS
from gateway import engine_ids
from gateway.call_values import EngineResult
from gateway.capture import Capture
from gateway.protocols.errors import GatewayError

if TYPE_CHECKING:
    from gateway.continuation.planner import Turn

_decode = msgspec.json.decode
_encode = msgspec.json.encode


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


def stale_connection(exc: BaseException | None) -> bool:
    """The request met a kept-alive connection the engine had just closed (it was reset while
    the request was written, or closed before any answer): a race with the engine's idle
    timeout, not a failing replica. Whatever the engine might have started on it was aborted
    when the connection went, and nothing of it reached the call: asking again is safe."""
    return isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError) and not (
        isinstance(exc, aiohttp.ClientConnectorError)
    )


class EngineCall:
    """One call's exchange with its replica, from the body sent to the result."""

    __slots__ = (
        "capture", "plan", "upstream", "rerouted", "ttft_ms", "prompt_json", "_sent_prompt",
        "_passes_ids", "_started",
    )  # fmt: skip

    def __init__(
        self,
        passes_ids: bool,  # the protocol passes the engine's prompt ids on unread
        plan: Turn | None,
        upstream: str,
        rerouted: str | None,
        started: float,  # the call's start (perf_counter), its time to first token counts from
    ) -> None:
        self.capture = Capture()
        self.plan = plan
        self.upstream = upstream
        self.rerouted = rerouted
        self.ttft_ms: float | None = None
        # The engine's prompt ids as JSON pieces: as it echoed them, or as they were sent.
        self.prompt_json: engine_ids.Pieces | None = None
        self._sent_prompt: bytes | None = None  # the prompt ids sent, as JSON, if echoed back
        self._passes_ids = passes_ids
        self._started = started

    def body(self, body: dict[str, Any], requested: dict[str, Any], client_ids: bool) -> bytes:
        """The body the engine is sent, encoded: with the plan's prompt ids, if it has them."""
        plan = self.plan
        if plan is not None and plan.prompt_ids is not None:
            self.prompt_json = plan.prompt_pieces or (_encode(plan.prompt_ids.tolist()),)
            body["kv_transfer_params"] = {"prompt_token_ids": engine_ids.items(self.prompt_json)}
            if client_ids or requested.get("logprobs") or requested.get("top_logprobs"):
                self._sent_prompt = engine_ids.concat(self.prompt_json)  # to know the echo by
            else:
                # The engine would echo the prompt the gateway just sent (at 32k tokens, 200 kB
                # to write, read and compare per call): only the sampled ids are asked for, as
                # logprob tokens. Its prompt token count still checks that it used these ids.
                del body["return_token_ids"]
                body["return_tokens_as_token_ids"] = True
                self.capture.ids_in_logprobs = True
        if plan is not None and "messages" in body:
            body = {**body, "messages": plan.engine_messages(body["messages"])}
        return _encode(body)

    def whole(self, raw: bytes, version: int) -> dict[str, Any]:
        """A whole response, captured; its tokens stamped with `version`."""
        payload = self.payload(raw)
        self.capture.add_response(payload, version)
        self.ttft_ms = (time.perf_counter() - self._started) * 1000
        return payload

    def chunk(self, data: bytes) -> dict[str, Any]:
        """A streamed chunk, decoded (not yet captured: it may be an error)."""
        return _decode(data) if self.capture.prompt_ids is not None else self.payload(data)

    def captured(self, chunk: dict[str, Any], version: int) -> bool:
        """Captures `chunk`; whether it brought the call's first sampled token."""
        cap = self.capture
        cap.add_chunk(chunk, version)
        first = self.ttft_ms is None and len(cap.completion_ids) > 0
        if first:
            self.ttft_ms = (time.perf_counter() - self._started) * 1000
        return first

    def payload(self, raw: bytes) -> dict:
        """The engine's response (or a chunk) decoded, its prompt ids handed to the capture as
        an array without passing through Python ints. Ids byte for byte those the gateway sent
        (an exact continuation: vLLM echoes them) are not parsed again; ids it was not asked to
        echo are the ones sent."""
        cap = self.capture
        if cap.ids_in_logprobs:
            payload = _decode(raw)
            if isinstance(payload, dict) and cap.prompt_ids is None:
                assert self.plan is not None and self.prompt_json is not None
                cap.set_prompt(self.plan.prompt_ids)
                self._hand_over(payload, engine_ids.items(self.prompt_json), cap.prompt_ids)
            return payload
        rest, span = engine_ids.split(raw)
        if span is None:
            return _decode(raw)
        payload = _decode(rest)
        holder = engine_ids.holder(payload)
        if holder is None:  # an id array nested where the engine puts none: decoded as it came
            return _decode(raw)
        if self._sent_prompt is not None and span == self._sent_prompt:
            assert self.plan is not None
            ids = self.plan.prompt_ids  # `prompt_json` holds them as sent
        else:
            ids = engine_ids.parse(span)
            if cap.prompt_ids is None:
                self.prompt_json = (span,)
        cap.set_prompt(ids)
        self._hand_over(holder, msgspec.Raw(span), ids)
        return payload

    def _hand_over(self, holder: dict, text, ids) -> None:
        """Puts the prompt ids where the engine's response holds them, as the protocol takes
        them: as their JSON `text` (encoded as it is) if it passes them on unread
        (`Adapter.passes_engine_ids`), or as the array it counts."""
        holder[engine_ids.KEY] = text if self._passes_ids else ids

    def result(self) -> EngineResult:
        """What the capture holds, as the values recording stores; the plan is told the
        engine's prompt, which it checks its splice against."""
        cap = self.capture
        prompt = cap.prompt_ids if cap.prompt_ids is not None else np.zeros(0, IDS)
        prompt = prompt.astype(IDS, copy=False)
        if self.plan is not None:
            self.plan.confirm(prompt)
        return EngineResult(
            upstream=self.upstream,
            rerouted=self.rerouted,
            prompt=prompt,
            completion=np.frombuffer(cap.completion_ids, dtype=np.int32).astype(IDS, copy=False),
            logprobs=np.frombuffer(cap.logprobs, dtype=np.float32).astype(LOGPROBS, copy=False),
            versions=cap.versions().astype(IDS, copy=False),
            message=cap.message(),
            finish_reason=cap.finish_reason,
            usage=cap.usage,
            ttft_ms=self.ttft_ms,
        )
