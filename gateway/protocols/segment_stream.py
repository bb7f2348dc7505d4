"""The stream plumbing every translating protocol shares: engine chunks go through one
`Accumulator` whose segment events the protocol turns into SSE events (`event:` and `data:`
lines), buffered until the chunk is read and sent as one write.

A protocol's stream says only what its events are: the ones that open the response
(`begin`), the segment events (`segments.Sink`), and `close` / `fail`."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import msgspec

from gateway import engine_ids
from gateway.protocols.adapter import Stream
from gateway.protocols.segments import Accumulator, Sink

_encode = msgspec.json.encode


def event_frame(event: bytes, data: dict[str, Any]) -> bytes:
    """One server-sent event: its name and its JSON data."""
    return b"".join((b"event: ", event, b"\ndata: ", _encode(data), b"\n\n"))


class SegmentStream(Stream, Sink):
    """Chat-completion chunks in, the protocol's events out. `acc` holds the output so far;
    `out` the events not yet sent."""

    __slots__ = ("acc", "out", "started")

    def __init__(self) -> None:
        self.acc = Accumulator()
        self.out: list[bytes] = []
        self.started = False

    @abstractmethod
    def begin(self, prompt_tokens: int) -> None:
        """Appends the events that open the response (once, before any segment's)."""

    def ensure_begun(self, prompt_tokens: int = 0) -> None:
        if not self.started:
            self.started = True
            self.begin(prompt_tokens)

    def flush(self) -> bytes:
        out = b"".join(self.out)
        self.out.clear()
        return out

    def feed(self, chunk: dict[str, Any]) -> bytes:
        if not self.started:
            self.started = True
            self.begin(engine_ids.count(chunk.get(engine_ids.KEY)))
        self.acc.feed(chunk, self)
        return self.flush()
