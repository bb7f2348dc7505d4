"""The one reader of the engine's chat-completion output, for every protocol that answers from
it: chunks of a stream in, protocol-neutral segment events out. A whole response is read the
same way, fed once as if it were one chunk, so a protocol renders a streamed and a whole reply
from the same state and the two cannot drift apart.

A segment is one run of output of one kind: reasoning, text, or one tool call. A new segment
starts when the kind changes (or another tool call starts), which ends the one before; the
engine's `finish_reason` does not end a segment (the Responses API closes its last item only
once the whole response is known). Events go to a `Sink`'s methods: no event objects are made
on the per-chunk path.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway import engine_ids

REASONING = "reasoning"
TEXT = "text"
TOOL_CALL = "tool_call"

# Neutral finish reasons; `finish_reason()` returns None for one no protocol can express.
STOP = "stop"  # end of turn, a stop token or a stop string (see `Accumulator.matched`)
LENGTH = "length"
TOOL_CALLS = "tool_calls"
CONTENT_FILTER = "content_filter"


def reasoning_of(message: dict[str, Any]) -> str | None:
    """The reasoning text of a chat message or delta. vLLM 0.32 names it `reasoning`; earlier
    releases `reasoning_content`."""
    return message.get("reasoning") or message.get("reasoning_content")


class Segment:
    """One reasoning run, text run or tool call, with everything received for it so far."""

    __slots__ = ("kind", "index", "parts", "call_id", "name")

    def __init__(self, kind: str, index: int, call_id: str | None = None, name: str = "") -> None:
        self.kind = kind
        self.index = index  # position among the segments, in arrival order
        self.parts: list[str] = []  # text, reasoning or argument fragments
        self.call_id = call_id  # the engine's tool-call id; None if it sent none
        self.name = name  # tool name

    def text(self) -> str:
        return "".join(self.parts)


class Sink:
    """What a protocol maps to its wire format; every event defaults to nothing."""

    __slots__ = ()

    def start(self, seg: Segment) -> None:
        """`seg` begins (a tool call with its id and the first part of its name)."""

    def delta(self, seg: Segment, text: str) -> None:
        """`text` was appended to `seg` (for a tool call: an argument fragment). The segment is
        not necessarily the newest one if the engine interleaves tool calls."""

    def end(self, seg: Segment) -> None:
        """`seg` is over: the next segment started."""

    def finish(self) -> None:
        """The engine reported why it stopped (`Accumulator.finish_reason()`)."""

    def usage(self) -> None:
        """The engine's token counts arrived (`Accumulator.usage`)."""


_SILENT = Sink()


def _fragment(value: Any) -> str:
    # Argument fragments are JSON text; a whole response from another engine may hold an object.
    return value if isinstance(value, str) else msgspec.json.encode(value).decode()


class Accumulator:
    """The output of one model call so far, built from chat-completion chunks (`choices[0]`
    `delta`s) or from a whole chat completion (its `message`)."""

    __slots__ = (
        "segments",
        "_open",
        "_calls",
        "raw_finish",
        "matched",
        "usage",
        "output_tokens",
        "prompt_tokens",
    )

    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self._open: Segment | None = None
        self._calls: dict[int, Segment] = {}  # the engine's tool-call index -> segment
        self.raw_finish: str | None = None  # the engine's finish_reason
        # vLLM's `stop_reason`: the stop string that ended the output, a stop token id, or None.
        self.matched: Any = None
        self.usage: dict[str, Any] | None = None  # the latest usage the engine sent
        self.output_tokens = 0  # completion token ids seen
        self.prompt_tokens: int | None = None  # prompt token ids of the first chunk

    def feed(self, chunk: dict[str, Any], sink: Sink = _SILENT) -> None:
        if self.prompt_tokens is None:
            self.prompt_tokens = engine_ids.count(chunk.get(engine_ids.KEY))
        choices = chunk.get("choices")
        if choices:
            choice = choices[0]
            token_ids = choice.get("token_ids")
            if token_ids:
                self.output_tokens += len(token_ids)
            delta = choice.get("delta") or choice.get("message")
            if delta:
                reasoning = reasoning_of(delta)
                if reasoning:
                    self._text(REASONING, reasoning, sink)
                text = delta.get("content")
                if text:
                    self._text(TEXT, text, sink)
                calls = delta.get("tool_calls")
                if calls:
                    for position, call in enumerate(calls):
                        # A whole response's calls carry no index: their order is it.
                        self._call(call.get("index", position), call, sink)
            finish = choice.get("finish_reason")
            if finish:
                self.raw_finish = finish
                self.matched = choice.get("stop_reason")
                sink.finish()
        usage = chunk.get("usage")
        if usage:
            self.usage = usage
            sink.usage()

    def _begin(self, kind: str, sink: Sink, call_id: str | None = None, name: str = "") -> Segment:
        if self._open is not None:
            sink.end(self._open)
        seg = self._open = Segment(kind, len(self.segments), call_id, name)
        self.segments.append(seg)
        sink.start(seg)
        return seg

    def _text(self, kind: str, text: str, sink: Sink) -> None:
        seg = self._open
        if seg is None or seg.kind != kind:
            seg = self._begin(kind, sink)
        seg.parts.append(text)
        sink.delta(seg, text)

    def _call(self, position: int, call: dict[str, Any], sink: Sink) -> None:
        function = call.get("function") or {}
        seg = self._calls.get(position)
        if seg is None:
            name = function.get("name") or ""
            seg = self._calls[position] = self._begin(TOOL_CALL, sink, call.get("id"), name)
        elif function.get("name"):  # a parser that streams the name in pieces
            seg.name += function["name"]
        arguments = function.get("arguments")
        if arguments:
            arguments = _fragment(arguments)
            seg.parts.append(arguments)
            sink.delta(seg, arguments)

    def finish_reason(self) -> str | None:
        """The neutral reason the output ended (STOP while no reason came yet), or None for an
        engine reason no protocol can express (`raw_finish` says which)."""
        raw = self.raw_finish
        if raw == "length":
            return LENGTH
        if raw == "content_filter":
            return CONTENT_FILTER
        if self._calls or raw == "tool_calls":
            return TOOL_CALLS  # vLLM reports a call forced by tool_choice as a plain stop
        if raw in ("stop", "repetition", None):
            return STOP
        return None
