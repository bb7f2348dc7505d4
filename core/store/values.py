"""What Postgres will store: checks for values bound for jsonb and text columns.

Postgres refuses U+0000 in text and jsonb, numbers jsonb cannot hold, and nesting beyond its
stack; a value that reaches it unchecked fails the whole statement. These pure checks run at
the edge, so bad input gets a 400 naming the field instead.
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


def without_nul(value: Any) -> tuple[Any, int]:
    """`value` with every U+0000 in its strings (keys too) removed, and how many were."""
    if isinstance(value, str):
        n = value.count("\x00")
        return (value.replace("\x00", ""), n) if n else (value, 0)
    if isinstance(value, dict):
        out, total = {}, 0
        for key, item in value.items():
            key, k = without_nul(key)
            out[key], n = without_nul(item)
            total += k + n
        return out, total
    if isinstance(value, list):
        items = [without_nul(item) for item in value]
        return [v for v, _ in items], sum(n for _, n in items)
    return value, 0


def clean_text(text: str | None) -> str | None:
    """Text the gateway itself stores (engine messages, headers): NUL replaced, not refused."""
    if text is None or "\x00" not in text:
        return text
    return text.replace("\x00", "\ufffd")
