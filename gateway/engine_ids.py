"""The engine's token id arrays, from its JSON straight into numpy (or kept as JSON).

vLLM echoes the whole prompt (`prompt_token_ids`) in every response, or in a stream's first
chunk: at a long context that one array is most of the bytes. Decoded as JSON it becomes one
Python int per token, and then a numpy array: about a millisecond and a half at 20k tokens.
Here the array's bytes are cut out of the response before it is decoded and parsed in bulk;
when they are byte for byte the ids the gateway itself sent (an exact continuation), they are
not parsed at all.
"""

from __future__ import annotations

import re

import msgspec
import numpy as np

KEY = "prompt_token_ids"
_INT32_MAX = 2**31 - 1
_EMPTY = re.compile(rb"\[\s*\]")
_DIGITS = frozenset(b"%d" % d for d in range(10))


def split(raw: bytes, key: str = KEY) -> tuple[bytes, bytes | None]:
    """(`raw` with its first id array under `key` replaced by the number 0, the array's bytes),
    or (`raw`, None) if it has none. The key cannot be matched inside a JSON string (its quote
    before the colon would be escaped there); `holder` tells which object it belonged to."""
    field = b'"%s":[' % key.encode()
    at = raw.find(field)
    if at < 0:
        return raw, None
    start = at + len(field) - 1
    end = raw.find(b"]", start)  # an array of numbers holds no other bracket
    if end < 0:
        return raw, None
    return raw[:at] + field[:-1] + b"0" + raw[end + 1 :], raw[start : end + 1]


def holder(payload) -> dict | None:
    """The object of a decoded `split` response whose prompt ids were cut out: the response
    itself (chat completions) or its first choice (legacy completions); None if the array
    was nested anywhere else."""
    if not isinstance(payload, dict):
        return None
    if is_sentinel(payload.get(KEY)):
        return payload
    choices = payload.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        if is_sentinel(choices[0].get(KEY)):
            return choices[0]
    return None


def count(ids) -> int:
    """How many prompt ids a response holds: a list, or the int32 array the engine exchange puts
    in place of the engine's for protocols that only count them; 0 if it has none."""
    return 0 if ids is None or isinstance(ids, int) else len(ids)


def is_sentinel(value) -> bool:
    """Whether a decoded `split` response holds the cut-out array's placeholder here."""
    return type(value) is int and value == 0


def parse(span: bytes) -> np.ndarray:
    """A JSON array of token ids as int32, equal to decoding it into a list and converting
    that. Compact arrays of non-negative integers are parsed in bulk; anything else (or
    invalid JSON, which raises) goes through msgspec."""
    ids = _parse_plain(span)
    if ids is None:
        ids = np.asarray(msgspec.json.decode(span), dtype=np.int32)
    return ids


def _parse_plain(span: bytes) -> np.ndarray | None:
    """Compact arrays only (vLLM writes no whitespace): digits and commas between brackets."""
    if len(span) < 2 or span[:1] != b"[" or span[-1:] != b"]":
        return None
    inner = span[1:-1]
    if not inner:
        return np.zeros(0, dtype=np.int32)
    if inner.translate(None, b"0123456789,") or inner[:1] == b"," or inner[-1:] == b",":
        return None
    try:
        ids = np.fromstring(inner, dtype=np.int64, sep=",")
    except ValueError:  # an empty element: `,,`
        return None
    if ids.max() > _INT32_MAX:  # (int64 saturates)
        return None
    if _leading_zero(inner):  # not JSON, and parsing would hide it
        return None
    return ids.astype(np.int32)


# A long id array's JSON kept as the JSON arrays it was built from, oldest first: the calls of
# a conversation share the pieces of its prefix instead of each holding a copy of the whole.
Pieces = tuple[bytes, ...]
# Then merged into one, so a conversation of many calls stays a few pieces: every call sends
# its pieces (about half a µs each), and a merge copies the whole array once (about 50 µs at
# 32k tokens), every 8 calls or so (a call adds its new ids and its sampled ones).
_MAX_PIECES = 16


def extend(pieces: Pieces, array: bytes) -> Pieces:
    """`pieces` followed by the JSON array `array`."""
    out = (*pieces, array)
    return out if len(out) <= _MAX_PIECES else (concat(out),)


def items(pieces: Pieces) -> list[msgspec.Raw]:
    """`pieces` as a value that encodes as their one JSON array: each piece's items, which the
    encoder separates by commas, without copying them first."""
    return [
        msgspec.Raw(memoryview(p)[1:-1])
        for p in pieces
        if p[1:2] in _DIGITS or not _EMPTY.fullmatch(p)  # most open with a digit: no regex
    ]


def concat(pieces: Pieces) -> bytes:
    """The one JSON array of all `pieces`' items, in order, written in one copy without passing
    the ids through Python ints."""
    return pieces[0] if len(pieces) == 1 else msgspec.json.encode(items(pieces))


def _leading_zero(inner: bytes) -> bool:
    """Whether a number of `inner` (digits and commas) starts with 0 and goes on; a prompt
    holds few zeros, so few are looked at."""
    at = 0 if inner[:1] == b"0" else inner.find(b",0")
    while at >= 0:
        zero = at if inner[at : at + 1] == b"0" else at + 1
        if inner[zero + 1 : zero + 2] not in (b",", b""):
            return True
        at = inner.find(b",0", zero + 1)
    return False
