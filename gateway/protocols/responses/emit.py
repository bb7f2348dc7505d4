"""The engine's output as the Responses API's `response` object, whole or as a stream of SSE
events, both a mapping of the engine's output segments (see segments.py)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import msgspec

from gateway.protocols import segments
from gateway.protocols.errors import GatewayError
from gateway.protocols.responses.types import Context
from gateway.protocols.segment_stream import SegmentStream, event_frame
from gateway.protocols.segments import REASONING, TEXT, TOOL_CALL, Accumulator, Segment

_encode = msgspec.json.encode

_PREFIX = {REASONING: "rs", TEXT: "msg", TOOL_CALL: "fc"}


def _item_id(ctx: Context, prefix: str, index: int) -> str:
    return f"{prefix}_{ctx.response_id[5:]}{index:04x}"


def _item(ctx: Context, seg: Segment, status: str) -> dict:
    """The output item of `seg` as the response object holds it."""
    item_id = _item_id(ctx, _PREFIX[seg.kind], seg.index)
    text = seg.text()
    if seg.kind == TEXT:
        return {
            "id": item_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }
    if seg.kind == REASONING:
        return {
            "id": item_id,
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
            "encrypted_content": None,
            "status": status,
        }
    item = {
        "id": item_id,
        "type": "function_call",
        "call_id": seg.call_id or _item_id(ctx, "call", seg.index),
        "name": seg.name,
        "arguments": text,
        "status": status,
    }
    mapped = ctx.namespaced.get(seg.name)
    if mapped is not None:
        item["namespace"], item["name"] = mapped
    return item


def _output(
    ctx: Context, acc: Accumulator, cut: str, rest: str, closed: Collection[int] = ()
) -> list[dict]:
    """Every item in its final form. Items not `closed` yet close as `cut` if last (the one
    being generated when the output stopped), else as `rest`."""
    last = len(acc.segments) - 1
    return [
        _item(
            ctx,
            seg,
            "completed" if seg.index in closed else cut if seg.index == last else rest,
        )
        for seg in acc.segments
    ]


def _status(acc: Accumulator) -> tuple[str, dict | None]:
    reason = acc.finish_reason()
    if reason == segments.LENGTH:
        return "incomplete", {"reason": "max_output_tokens"}
    if reason == segments.CONTENT_FILTER:
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def _usage(u: dict | None) -> dict | None:
    if not u:
        return None
    prompt = u.get("prompt_tokens") or 0
    completion = u.get("completion_tokens") or 0
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (u.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": u.get("total_tokens") or prompt + completion,
    }


def _response(
    ctx: Context,
    status: str,
    output: list[dict],
    usage: dict | None,
    incomplete: dict | None = None,
    error: dict | None = None,
) -> dict:
    return {
        "id": ctx.response_id,
        "object": "response",
        "created_at": ctx.created_at,
        "status": status,
        "error": error,
        "incomplete_details": incomplete,
        "model": ctx.model,
        "output": output,
        "usage": usage,
        **ctx.echo,
    }


def _final_response(ctx: Context, acc: Accumulator) -> dict:
    # Only the last item can still be open when the output ends: a new item closes the one
    # before, except function calls, which the stream closes last (see `Stream`).
    status, incomplete = _status(acc)
    output = _output(ctx, acc, status, "completed")
    return _response(ctx, status, output, _usage(acc.usage), incomplete)


def from_upstream(resp: dict[str, Any], ctx: Context) -> bytes:
    acc = Accumulator()
    acc.feed(resp)
    return _encode(_final_response(ctx, acc))


# -- streaming -----------------------------------------------------------------------------------

_DELTA = {
    REASONING: "response.reasoning_text.delta",
    TEXT: "response.output_text.delta",
    TOOL_CALL: "response.function_call_arguments.delta",
}
_DELTA_EVENT = {kind: name.encode() for kind, name in _DELTA.items()}
_DONE = {
    REASONING: "response.reasoning_text.done",
    TEXT: "response.output_text.done",
}
_ADDED = {
    REASONING: ("reasoning", {"type": "reasoning_text", "text": ""}),
    TEXT: ("message", {"type": "output_text", "text": "", "annotations": []}),
}


class Stream(SegmentStream):
    """Chat chunks in, Responses SSE events out; each segment is an output item. Function calls
    stay open until `close()`: a harness runs a call when its `output_item.done` arrives, which
    must not happen before the call is recorded."""

    __slots__ = ("_ctx", "_seq", "_ids", "_closed")

    def __init__(self, ctx: Context) -> None:
        super().__init__()
        self._ctx = ctx
        self._seq = 0
        self._ids: list[str] = []  # item id per segment
        self._closed: set[int] = set()  # segments whose item is done

    def _event(self, kind: str, fields: dict) -> None:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        self.out.append(event_frame(kind.encode(), payload))

    def begin(self, prompt_tokens: int) -> None:
        resp = _response(self._ctx, "in_progress", [], None)
        self._event("response.created", {"response": resp})
        self._event("response.in_progress", {"response": resp})

    def start(self, seg: Segment) -> None:
        item_id = _item_id(self._ctx, _PREFIX[seg.kind], seg.index)
        self._ids.append(item_id)
        if seg.kind == TOOL_CALL:
            added = _item(self._ctx, seg, "in_progress")
            self._event("response.output_item.added", {"output_index": seg.index, "item": added})
            return
        kind, part = _ADDED[seg.kind]
        added = {"id": item_id, "type": kind, "status": "in_progress", "content": []}
        if seg.kind == TEXT:
            added["role"] = "assistant"
        else:
            added["summary"] = []
        self._event("response.output_item.added", {"output_index": seg.index, "item": added})
        self._event(
            "response.content_part.added",
            {"item_id": item_id, "output_index": seg.index, "content_index": 0, "part": part},
        )

    def delta(self, seg: Segment, text: str) -> None:
        # The per-chunk event: one dict, built in its final key order.
        kind, index = seg.kind, seg.index
        seq = self._seq
        self._seq = seq + 1
        payload = {
            "type": _DELTA[kind],
            "sequence_number": seq,
            "item_id": self._ids[index],
            "output_index": index,
        }
        if kind != TOOL_CALL:
            payload["content_index"] = 0
        payload["delta"] = text
        if kind == TEXT:
            payload["logprobs"] = []
        self.out.append(event_frame(_DELTA_EVENT[kind], payload))

    def end(self, seg: Segment) -> None:
        if seg.kind != TOOL_CALL:
            self._close_item(seg, "completed")

    def _close_item(self, seg: Segment, status: str) -> None:
        self._closed.add(seg.index)
        final = _item(self._ctx, seg, status)
        where = {"item_id": final["id"], "output_index": seg.index}
        if seg.kind == TOOL_CALL:
            self._event(
                "response.function_call_arguments.done", {**where, "arguments": final["arguments"]}
            )
        else:
            part = final["content"][0]
            done = {**where, "content_index": 0, "text": part["text"]}
            if seg.kind == TEXT:
                done["logprobs"] = []
            self._event(_DONE[seg.kind], done)
            self._event("response.content_part.done", {**where, "content_index": 0, "part": part})
        self._event("response.output_item.done", {"output_index": seg.index, "item": final})

    def response(self) -> dict:
        """The response object `close()` will send, for the core to store before it does."""
        return _final_response(self._ctx, self.acc)

    def close(self) -> bytes:
        self.ensure_begun()
        resp = self.response()
        for seg, final in zip(self.acc.segments, resp["output"]):
            if seg.index not in self._closed:
                self._close_item(seg, final["status"])
        self._event(f"response.{resp['status']}", {"response": resp})
        return self.flush()

    def fail(self, err: GatewayError) -> bytes:
        """`error`, then `response.failed` with what was generated so far. Open items are not
        closed: a harness would run a half-streamed function call."""
        self.out.clear()  # events of a chunk the protocol could not take
        self.ensure_begun()
        code = err.code or (
            "context_length_exceeded" if err.kind == "context_length_exceeded" else "server_error"
        )
        self._event("error", {"code": code, "message": err.message, "param": err.param})
        resp = _response(
            self._ctx,
            "failed",
            _output(self._ctx, self.acc, "incomplete", "incomplete", self._closed),
            _usage(self.acc.usage),
            error={"code": code, "message": err.message},
        )
        self._event("response.failed", {"response": resp})
        return self.flush()
