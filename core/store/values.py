"""What Postgres will store: checks and the one sanitiser for values bound for jsonb and text.

Postgres refuses U+0000 in text and jsonb, lone surrogates, numbers jsonb cannot hold, and
nesting beyond its stack; a value that reaches it unchecked fails the whole statement. `problem`
runs at the edge, where a field the gateway acts on gets a 400 naming it; `storable` runs on
everything written (a call's row, a finish's metrics), so what passed the edge can never fail a
commit: it is escaped, and the record says so.
"""

from __future__ import annotations

import math
from typing import Any

MAX_DEPTH = 64
_INT64 = 2**63


def problem(value: Any, path: str = "", depth: int = 0) -> str | None:
    """Why `value` cannot be stored, naming the place (`path.to[3].field`), or None."""
    if depth > MAX_DEPTH:
        return f"{path or 'value'}: nested deeper than {MAX_DEPTH} levels"
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and "\x00" in key:
                return f"{path or 'value'}: a key contains a NUL character (U+0000)"
            found = problem(item, where, depth + 1)
            if found:
                return found
        return None
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = problem(item, f"{path}[{i}]", depth + 1)
            if found:
                return found
        return None
    return _scalar_problem(value, path or "value")


def _scalar_problem(value: Any, where: str) -> str | None:
    if isinstance(value, str):
        return f"{where}: contains a NUL character (U+0000)" if "\x00" in value else None
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return None if -_INT64 <= value < _INT64 else (
            f"{where}: integer out of range (beyond 64 bits)")
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{where}: number is not finite"
    return None


# What takes the place of a character Postgres cannot store (U+0000, a lone surrogate).
REPLACEMENT = "\ufffd"
# Integers whose decimal form Python refuses to write (its 4,300-digit guard) are beyond this.
_MAX_INT_BITS = 14_000


def storable(value: Any, depth: int = 0) -> tuple[Any, int]:
    """`value` as jsonb will take it whatever it holds, and how many places had to change.

    The one sanitiser of what the gateway writes: a U+0000 or a lone surrogate in a string (keys
    too) becomes U+FFFD, a number jsonb cannot hold (infinite, NaN, too many digits) and nesting
    deeper than MAX_DEPTH become null. Records say when the count is not 0 ("escaped"), so a
    changed value is never mistaken for what the client sent.
    """
    if isinstance(value, str):
        return storable_text(value)
    if isinstance(value, dict):
        if depth >= MAX_DEPTH:
            return None, 1
        out: dict[Any, Any] = {}
        total = 0
        for key, item in value.items():
            if isinstance(key, str):
                key, k = storable_text(key)
                total += k
            out[key], n = storable(item, depth + 1)
            total += n
        return out, total
    if isinstance(value, (list, tuple)):
        if depth >= MAX_DEPTH:
            return None, 1
        items = [storable(item, depth + 1) for item in value]
        return [v for v, _ in items], sum(n for _, n in items)
    if isinstance(value, float) and not math.isfinite(value):
        return None, 1
    if isinstance(value, int) and not isinstance(value, bool) and (
            value.bit_length() > _MAX_INT_BITS):
        return None, 1
    return value, 0


def storable_text(text: str) -> tuple[str, int]:
    """`text` as a text column takes it (see `storable`), and how many characters changed."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        fixed = "".join(REPLACEMENT if "\ud800" <= c <= "\udfff" else c for c in text)
        changed = sum(a != b for a, b in zip(text, fixed, strict=True))
        text, more = storable_text(fixed)
        return text, changed + more
    n = text.count("\x00")
    return (text.replace("\x00", REPLACEMENT), n) if n else (text, 0)


def clean_text(text: str | None) -> str | None:
    """Text the gateway itself stores (engine messages, headers), made storable (`storable`)."""
    return None if text is None else storable_text(text)[0]
