"""Request bodies on disk: each stored as a delta against its parent call's body, so a rollout's
body storage grows with what its calls add, not with their length times their number (every
call of an agent resends the whole conversation).

Byte-exact: a reconstructed body is the very bytes the harness sent (the `body_digest` of the
row is their hash), not a re-encoding of their JSON value, so whitespace, key order, number
spelling and escapes survive, and any bytes at all round-trip (a body the gateway refused, a
non-object body).

A delta keeps what the two bodies share at both ends: the parent's bytes up to the end of its
last message usually open the child too (the child adds messages), and the fields after the
messages array (`tools`, `stream`, …) usually close both. What lies between (the new messages,
plus whatever changed earlier: a moved cache breakpoint, an edited system prompt) is
zstd-compressed with the parent's own middle and the parent's reply (its stored response
summary, which the harness sends back in its next request) as a raw-content dictionary, so text
carried over from either costs a reference, not a copy. Finding the shared ends is a memcmp over
the body, and the compression sees only the middle.

Layout: 8-byte little-endian shared prefix length, 8-byte shared suffix length, then the zstd
frame of the child's middle. A row without a parent (`request_base` NULL, every row written
before deltas) holds the whole body as one zstd frame, as does every response summary.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterable
from typing import NamedTuple
from uuid import UUID

import xxhash
import zstandard

from core.byte_ends import shared_ends
from core.store.tokens import parents_first

LEVEL = 3  # fast, and JSON conversations still shrink 5-10x
_HEADER = struct.Struct("<QQ")
# A raw-content dictionary shorter than this gives zstd nothing to match against.
_MIN_DICT = 8


# zstd contexts are costly to make (tens of microseconds, more than a small body's compression)
# and not safe to share between threads: one of each per thread, for frames without dictionary.
_contexts = threading.local()


def _plain() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    pair = getattr(_contexts, "pair", None)
    if pair is None:
        pair = (zstandard.ZstdCompressor(level=LEVEL), zstandard.ZstdDecompressor())
        _contexts.pair = pair
    return pair


def digest(body: bytes) -> bytes:
    """A body's `body_digest`. Retries are told by it (the merge marks the earlier attempt of a
    retried call abandoned), so it needs no resistance to forgery: a body made to collide could
    only mark an earlier call of its own rollout abandoned, as sending that body again does.
    xxh3 takes 2 µs for a 32k-token body, blake2b took 200."""
    return xxhash.xxh3_128_digest(body)


def whole(body: bytes) -> bytes:
    return _plain()[0].compress(body)


def unwhole(stored: bytes) -> bytes:
    return _plain()[1].decompress(stored)


def _dict(content: bytes) -> zstandard.ZstdCompressionDict | None:
    if len(content) < _MIN_DICT:
        return None
    return zstandard.ZstdCompressionDict(content, dict_type=zstandard.DICT_TYPE_RAWCONTENT)


def delta(parent: bytes, child: bytes, reply: bytes = b"", known: int = 0) -> bytes:
    """`child` stored against `parent`: `apply(parent, delta(parent, child, r), r) == child`.
    `reply`: what the parent call returned (its stored response summary), which the child
    usually sends back. `known`: a prefix length the two are known to share."""
    pre, suf = shared_ends(parent, child, known)
    d = _dict(parent[pre : len(parent) - suf] + reply)
    cctx = _plain()[0] if d is None else zstandard.ZstdCompressor(level=LEVEL, dict_data=d)
    return _HEADER.pack(pre, suf) + cctx.compress(child[pre : len(child) - suf])


def apply(parent: bytes, stored: bytes, reply: bytes = b"") -> bytes:
    """The child body a `delta` against `parent` (and its `reply`) was made from."""
    pre, suf = _HEADER.unpack_from(stored)
    if pre + suf > len(parent):
        raise ValueError("body delta does not fit its parent body")
    d = _dict(parent[pre : len(parent) - suf] + reply)
    dctx = _plain()[1] if d is None else zstandard.ZstdDecompressor(dict_data=d)
    middle = dctx.decompress(stored[_HEADER.size :])
    return parent[:pre] + middle + parent[len(parent) - suf :]


class StoredBody(NamedTuple):
    """The body columns of one stored call."""

    id: UUID
    request_base: UUID | None
    request_body: bytes | None  # whole, or a delta against request_base's body
    response_body: bytes | None  # the zstd response summary: a later delta's `reply`


def reconstruct(rows: Iterable[StoredBody]) -> dict[UUID, bytes | None]:
    """Every request body of `rows`, parents resolved first whatever the order of `rows`; None
    where no body was kept. Every request base must be among the rows."""
    by_id = {r.id: r for r in rows}
    out: dict[UUID, bytes | None] = {}
    for call_id in parents_first({r.id: r.request_base for r in by_id.values()}):
        row = by_id[call_id]
        if row.request_body is None:
            out[row.id] = None
        elif row.request_base is None:
            out[row.id] = unwhole(row.request_body)
        else:
            base = by_id[row.request_base]
            parent = out[base.id]
            if parent is None:
                raise ValueError(f"call {row.id}: its body's parent {base.id} has no body")
            reply = b"" if base.response_body is None else unwhole(base.response_body)
            out[row.id] = apply(parent, row.request_body, reply)
    return out
