"""The engine's answer to one call read into a `Capture` as it arrives (a whole response, or
a stream's chunks), and what that comes to (`EngineResult`). The engine's id arrays are handed to
the capture as arrays, never as Python ints (`gateway.engine_ids`): a speed device private to
this stage."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from core.store.tokens import IDS, LOGPROBS
from gateway import engine_ids
from gateway.call_values import EngineResult
from gateway.capture import Capture

if TYPE_CHECKING:
    from gateway.engine_body import EngineRequest

_decode = msgspec.json.decode


class EngineReading:
    """One call's answer from its replica, read as it arrives."""

    __slots__ = ("capture", "ttft_ms", "prompt_json", "_sent", "_started")

    def __init__(
        self,
        sent: EngineRequest,
        started: float,  # the call's start (perf_counter), its time to first token counts from
    ) -> None:
        self.capture = Capture()
        self.capture.ids_in_logprobs = sent.ids_in_logprobs
        self.ttft_ms: float | None = None
        # The engine's prompt ids as JSON pieces: as it echoed them, or as they were sent.
        self.prompt_json: engine_ids.Pieces | None = sent.prompt_json
        self._sent = sent
        self._started = started

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
                assert self.prompt_json is not None
                cap.set_prompt(self._sent.prompt_ids)
                self._hand_over(payload, engine_ids.items(self.prompt_json), cap.prompt_ids)
            return payload
        rest, span = engine_ids.split(raw)
        if span is None:
            return _decode(raw)
        payload = _decode(rest)
        holder = engine_ids.holder(payload)
        if holder is None:  # an id array nested where the engine puts none: decoded as it came
            return _decode(raw)
        sent = self._sent
        if sent.echo_expected is not None and span == sent.echo_expected:
            ids = sent.prompt_ids  # `prompt_json` holds them as sent
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
        holder[engine_ids.KEY] = text if self._sent.passes_ids else ids

    def result(self, upstream: str | None, rerouted: str | None) -> EngineResult:
        """What the capture holds, as the values recording stores."""
        cap = self.capture
        prompt = cap.prompt_ids if cap.prompt_ids is not None else np.zeros(0, IDS)
        return EngineResult(
            upstream=upstream,
            rerouted=rerouted,
            prompt=prompt.astype(IDS, copy=False),
            completion=np.frombuffer(cap.completion_ids, dtype=np.int32).astype(IDS, copy=False),
            logprobs=np.frombuffer(cap.logprobs, dtype=np.float32).astype(LOGPROBS, copy=False),
            versions=cap.versions().astype(IDS, copy=False),
            message=cap.message(),
            finish_reason=cap.finish_reason,
            usage=cap.usage,
            ttft_ms=self.ttft_ms,
        )
