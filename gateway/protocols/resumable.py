"""Request bodies decoded from where an earlier request of the conversation left off.

Every call of an agent resends the whole conversation: at 32k tokens a body is 130 kB, and
decoding it is the largest cost of a call that grows with the context. The body of a later
call usually opens with the very bytes of an earlier one's, up to and including its last
messages. So the earlier body's messages array is kept with its layout (where the array opens,
where each of its items ends), and a new body is decoded as the earlier items that lie wholly
inside the bytes the two share, followed by the decoding of a small body: the new one with
those items cut out of its array.

The result is the decoding of the whole body, not an approximation of it. Up to the end of the
last shared item both bodies are the same bytes, so a JSON parser is in the same state there
and has read the same items; what follows is read from the new body itself. msgspec keeps the
last of duplicate keys, so the cut array is checked to be the one the decoder kept (at the same
offset). Anything unexpected (no shared item, invalid JSON, the array not kept) falls back to
decoding the body whole, which also gives the error the client is told.

Decoded items are shared between the requests of a conversation and must not be modified.
The decoded type must not constrain the array's length (the cut array is shorter).
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Iterable
from typing import Any

import msgspec
import numpy as np

from core.byte_ends import shared

# Bodies shorter than this are decoded whole: there is little to save, and the bookkeeping
# would cost more than it saves.
MIN_BYTES = 16 << 10
_WS = re.compile(rb"[ \t\n\r]*")
_SEP = re.compile(rb"[ \t\n\r]*,[ \t\n\r]*")
_TAIL = re.compile(rb"[ \t\n\r]*\]")


class Layout(msgspec.Struct):
    """Where a decoded body's array lies in its bytes: `raw[opens]` is its `[`, and item `i`
    (`items[i]`, as decoded) ends just before `raw[ends[i]]`. `resumed`: how many items were
    taken from the earlier body's layout `parent` (0: the body was decoded whole). `derived`:
    what the protocol made of the items (its own type), which a request resumed from this one
    may take up for the items it shares (see `derived_from`)."""

    raw: bytes
    items: list
    opens: int
    ends: list[int]
    by: Any  # the Decoder that made it: items of one type of body are no other's
    resumed: int = 0
    parent: Layout | None = None
    derived: object = None  # each protocol checks it is its own resume cache

    def shared_with(self, body: bytes) -> int:
        """How many bytes this body is known to share with the start of `body`: those of the
        items it was resumed from, if `body` is their body (0 otherwise)."""
        parent = self.parent
        return self.ends[self.resumed - 1] if parent is not None and body is parent.raw else 0

    def derived_from(self) -> object:
        """The parent's `derived`, whose first `resumed` items are this body's: None if the
        body was decoded whole."""
        return None if self.parent is None else self.parent.derived

    def kept(self) -> Layout:
        """This layout without its reference to the earlier one, to be kept for later calls."""
        return Layout(
            self.raw, self.items, self.opens, self.ends, self.by, self.resumed, None, self.derived
        )


class Decoder:
    """Decodes request bodies of `type` (a dict or a msgspec Struct) whose array field `field`
    holds the conversation."""

    def __init__(self, field: str, type: Any = Any, min_bytes: int = MIN_BYTES) -> None:
        self.field = field
        self.type = type  # what a body decodes to
        self.min_bytes = min_bytes
        self._whole = msgspec.json.Decoder(type)
        self._items = msgspec.json.Decoder(
            msgspec.defstruct("Items", [(field, list[msgspec.Raw] | None, None)])
        )

    def decode(self, raw: bytes, earlier: Iterable[Layout] = ()) -> tuple[Any, Layout | None]:
        """(the decoded body, its layout: None if it is short or has no such array). `earlier`:
        layouts of the rollout's recent requests, the newest first (those of other decoders,
        another protocol's, are passed over). Raises msgspec's DecodeError or ValidationError
        as decoding `raw` whole does."""
        if len(raw) >= self.min_bytes:
            earlier = [e for e in earlier if e.by is self]
            # Usually the newest request's items all open this body: one memcmp tells.
            found = next((e for e in earlier if _opens_with(raw, e, len(e.ends))), None)
            k = len(found.ends) if found is not None else 0
            if found is None:  # a history edited, or another conversation's: the most shared
                for layout in earlier:
                    common = shared(layout.raw, raw, min(len(layout.raw), len(raw)))
                    n = bisect_right(layout.ends, common)
                    if n > k:
                        found, k = layout, n
            if found is not None:
                resumed = self._resume(raw, found, k)
                if resumed is not None:
                    return resumed
        body = self._whole.decode(raw)
        return body, (self._layout(raw, body) if len(raw) >= self.min_bytes else None)

    def _get(self, body: Any) -> Any:
        return body.get(self.field) if isinstance(body, dict) else getattr(body, self.field, None)

    def _raws(self, raw: bytes) -> list[msgspec.Raw] | None:
        """The items of the array the decoder keeps (the last of duplicate keys), as views."""
        try:
            return getattr(self._items.decode(raw), self.field)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None

    def _layout(self, raw: bytes, body: Any) -> Layout | None:
        items = self._get(body)
        if not isinstance(items, list) or not items:
            return None
        raws = self._raws(raw)
        if not raws or len(raws) != len(items):
            return None
        start = _offset(raws[0], raw)
        opens = raw.rfind(b"[", 0, start)
        if opens < 0 or _skip_ws(raw, opens + 1) != start:
            return None
        ends = _ends(raw, start, raws)
        return None if ends is None else Layout(raw, items, opens, ends, self)

    def _resume(self, raw: bytes, earlier: Layout, k: int) -> tuple[Any, Layout] | None:
        """`raw` decoded as `earlier`'s first `k` items (which it opens with, byte for byte)
        followed by the decoding of what comes after them."""
        if not k:
            return None
        comma = _SEP.match(raw, earlier.ends[k - 1])
        if comma is None:  # no item follows: nothing new to decode (a retry decodes whole)
            return None
        cut = comma.end()
        small = raw[: earlier.opens + 1] + raw[cut:]
        raws = self._raws(small)
        if not raws:
            return None
        start = _offset(raws[0], small)
        if start != _skip_ws(small, earlier.opens + 1):
            return None  # another array of the same key is the one decoded
        tail = _ends(small, start, raws)
        try:
            body = self._whole.decode(small)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        new = self._get(body)
        if tail is None or not isinstance(new, list) or len(new) != len(raws):
            return None
        items = earlier.items[:k] + new
        if isinstance(body, dict):
            body[self.field] = items
        else:
            setattr(body, self.field, items)
        shift = cut - (earlier.opens + 1)  # from `small`'s offsets to `raw`'s
        ends = earlier.ends[:k] + [end + shift for end in tail]
        return body, Layout(raw, items, earlier.opens, ends, self, k, earlier)


def _skip_ws(raw: bytes, at: int) -> int:
    """The offset of the first byte from `at` on that is not JSON white space."""
    match = _WS.match(raw, at)
    return at if match is None else match.end()


def _opens_with(raw: bytes, layout: Layout, k: int) -> bool:
    """Whether `raw` starts with the bytes of `layout`'s body up to the end of its item `k`."""
    return raw.startswith(memoryview(layout.raw)[: layout.ends[k - 1]])


def _offset(part: msgspec.Raw, whole: bytes) -> int:
    """Where `part`, a Raw msgspec decoded from `whole` (a view of its bytes), lies in it; -1
    if it is not a view of them after all."""
    at = np.frombuffer(part, np.uint8).ctypes.data - np.frombuffer(whole, np.uint8).ctypes.data
    if 0 <= at <= len(whole) - len(part) and whole.startswith(part, at):
        return at
    return -1


def _ends(raw: bytes, start: int, raws: list[msgspec.Raw]) -> list[int] | None:
    """The offsets just past each of `raws`, the items of one array of `raw` in order, the
    first at `start`: JSON allows only whitespace and one comma between items."""
    if start < 0:
        return None
    ends = []
    at = start
    for i, item in enumerate(raws):
        if i:
            sep = _SEP.match(raw, at)
            if sep is None:
                return None
            at = sep.end()
        if not raw.startswith(item, at):
            return None
        at += len(item)
        ends.append(at)
    return ends if _TAIL.match(raw, at) else None
