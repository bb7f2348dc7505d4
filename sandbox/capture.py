"""Bounded capture of a process's output: the first and the last bytes, and how many were dropped.

A harness that prints without end must cost neither memory nor disk: the head shows how it
started, the tail how it ended, and everything between is counted and discarded.
"""

from __future__ import annotations

import asyncio


class BoundedBuffer:
    def __init__(self, limit: int) -> None:
        self.head_limit = limit // 2
        self.tail_limit = limit - self.head_limit
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data and self.tail_limit:
            self.tail += data
            # Trim in place only when the tail has doubled, so feeding stays amortised O(n).
            if len(self.tail) > 2 * self.tail_limit:
                del self.tail[: len(self.tail) - self.tail_limit]

    @property
    def kept(self) -> bytes:
        return bytes(self.head) + bytes(self.tail[-self.tail_limit :] if self.tail_limit else b"")

    @property
    def omitted(self) -> int:
        return self.total - len(self.kept)

    @property
    def truncated(self) -> bool:
        return self.omitted > 0

    def text(self) -> str:
        tail = bytes(self.tail[-self.tail_limit :]) if self.tail_limit else b""
        if not self.truncated:
            return (bytes(self.head) + tail).decode(errors="replace")
        return (
            bytes(self.head).decode(errors="replace")
            + f"\n[... {self.omitted} bytes omitted ...]\n"
            + tail.decode(errors="replace")
        )


async def drain(stream: asyncio.StreamReader, buffer: BoundedBuffer, chunk: int = 65536) -> None:
    while data := await stream.read(chunk):
        buffer.feed(data)
