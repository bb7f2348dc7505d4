"""The engine's output as Anthropic Messages: the whole `message` object and the stream of SSE
events, both a mapping of the engine's output segments (see segments.py)."""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.protocols import segments
from gateway.protocols.anthropic.errors import error_body
from gateway.protocols.anthropic.types import Context, new_id
from gateway.protocols.errors import GatewayError
from gateway.protocols.segment_stream import SegmentStream, event_frame
from gateway.protocols.segments import REASONING, TEXT, TOOL_CALL, Accumulator, Segment


def _stop(acc: Accumulator, ctx: Context) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    reason = acc.finish_reason()
    if reason == segments.LENGTH:
        return "max_tokens", None
    if reason == segments.TOOL_CALLS:
        return "tool_use", None
    if reason == segments.STOP:
        if isinstance(acc.matched, str) and acc.matched in ctx.stop_sequences:
            return "stop_sequence", acc.matched
        return "end_turn", None
    raise GatewayError(502, f"upstream finished with reason {acc.raw_finish!r}", "upstream_error")


def _output_tokens(acc: Accumulator) -> int:
    completion = (acc.usage or {}).get("completion_tokens")
    return acc.output_tokens if completion is None else completion


def _tool_input(arguments: str) -> dict[str, Any]:
    if not arguments:
        return {}
    try:
        value = msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _block(seg: Segment) -> dict[str, Any]:
    """The content block of `seg` as a whole response holds it."""
    if seg.kind == REASONING:
        return {"type": "thinking", "thinking": seg.text(), "signature": ""}
    if seg.kind == TEXT:
        return {"type": "text", "text": seg.text()}
    return {
        "type": "tool_use",
        "id": seg.call_id or new_id("toolu_"),
        "name": seg.name,
        "input": _tool_input(seg.text()),
    }


def from_upstream(resp: dict[str, Any], ctx: Context) -> bytes:
    acc = Accumulator()
    acc.feed(resp)
    stop_reason, stop_sequence = _stop(acc, ctx)
    input_tokens = (acc.usage or {}).get("prompt_tokens")
    return msgspec.json.encode(
        {
            "id": ctx.message_id,
            "type": "message",
            "role": "assistant",
            "model": ctx.model,
            "content": [_block(seg) for seg in acc.segments],
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {
                "input_tokens": acc.prompt_tokens if input_tokens is None else input_tokens,
                "output_tokens": _output_tokens(acc),
            },
        }
    )


# -- stream events: pure builders of one event's bytes each --------------------------------------

_PING = event_frame(b"ping", {"type": "ping"})
_MESSAGE_STOP = event_frame(b"message_stop", {"type": "message_stop"})
_EMPTY_BLOCK = {
    REASONING: {"type": "thinking", "thinking": "", "signature": ""},
    TEXT: {"type": "text", "text": ""},
}


def message_start(ctx: Context, prompt_tokens: int) -> bytes:
    """`message_start` with the empty message, then a `ping`, as Anthropic opens a stream."""
    message = {
        "id": ctx.message_id,
        "type": "message",
        "role": "assistant",
        "model": ctx.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
    }
    return event_frame(b"message_start", {"type": "message_start", "message": message}) + _PING


def block_start(index: int, seg: Segment) -> bytes:
    if seg.kind == TOOL_CALL:
        block = {
            "type": "tool_use",
            "id": seg.call_id or new_id("toolu_"),
            "name": seg.name,
            "input": {},
        }
    else:
        block = _EMPTY_BLOCK[seg.kind]
    return event_frame(
        b"content_block_start",
        {"type": "content_block_start", "index": index, "content_block": block},
    )


def block_stop(index: int) -> bytes:
    return event_frame(b"content_block_stop", {"type": "content_block_stop", "index": index})


def message_delta(acc: Accumulator, ctx: Context) -> bytes:
    stop_reason, stop_sequence = _stop(acc, ctx)
    return event_frame(
        b"message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": _output_tokens(acc)},
        },
    )


def error_event(err: GatewayError) -> bytes:
    return event_frame(b"error", error_body(err)[1])


# -- the stream ------------------------------------------------------------------------------


class Stream(SegmentStream):
    """vLLM chat-completion chunks in, Anthropic SSE events out.

    Each segment is a content block, with consecutive indices; at most one is open, and the
    next segment or the finish closes it. `message_delta` goes out with the upstream usage
    chunk (the core always asks for it); `message_stop` only from `close()`.
    """

    __slots__ = ("_ctx", "_index", "_open", "_delta_sent")

    def __init__(self, ctx: Context) -> None:
        super().__init__()
        self._ctx = ctx
        self._index = -1  # index of the newest block
        self._open: Segment | None = None  # the segment whose block is open
        self._delta_sent = False

    def begin(self, prompt_tokens: int) -> None:
        self.out.append(message_start(self._ctx, prompt_tokens))

    def _close_block(self) -> None:
        if self._open is not None:
            self.out.append(block_stop(self._index))
            self._open = None

    def start(self, seg: Segment) -> None:
        self._close_block()
        self._index += 1
        self._open = seg
        self.out.append(block_start(self._index, seg))

    def delta(self, seg: Segment, text: str) -> None:
        if seg is not self._open:
            if seg.kind == TOOL_CALL:
                # Blocks cannot interleave; vLLM's parsers finish one call before the next.
                raise GatewayError(
                    502, "upstream interleaved the arguments of two tool calls", "upstream_error"
                )
            self.start(seg)  # text after the finish: a block of its own
        # The per-chunk event, built here rather than by a builder: one call less per chunk.
        kind = seg.kind
        if kind == TEXT:
            delta = {"type": "text_delta", "text": text}
        elif kind == REASONING:
            delta = {"type": "thinking_delta", "thinking": text}
        else:
            delta = {"type": "input_json_delta", "partial_json": text}
        self.out.append(
            event_frame(
                b"content_block_delta",
                {"type": "content_block_delta", "index": self._index, "delta": delta},
            )
        )

    def end(self, seg: Segment) -> None:
        if seg is self._open:
            self._close_block()

    def finish(self) -> None:
        self._close_block()

    def usage(self) -> None:
        if self.acc.raw_finish and not self._delta_sent:
            self._message_delta()

    def _message_delta(self) -> None:
        self._close_block()
        self.out.append(message_delta(self.acc, self._ctx))
        self._delta_sent = True

    def close(self) -> bytes:
        self.ensure_begun()
        if not self._delta_sent:
            self._message_delta()
        self.out.append(_MESSAGE_STOP)
        return self.flush()

    def fail(self, err: GatewayError) -> bytes:
        return error_event(err)
