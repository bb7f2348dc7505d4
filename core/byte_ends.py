"""How far two byte strings agree from their start or from their end."""

from __future__ import annotations


def shared(a: bytes, b: bytes, limit: int, at_end: bool = False, known: int = 0) -> int:
    """Length of the common prefix (or suffix) of `a` and `b`, at most `limit`, by halving:
    each step is one C-level comparison of `a` against a view into `b` (no copies), so the cost
    is a few memcmps over the bytes rather than a Python loop over them. `known`: a length
    they are known to share already (the search starts there)."""
    view = memoryview(b)
    lo, hi = min(known, limit), limit
    # Invariant: the first (last) `lo` bytes agree; the answer is in [lo, hi].
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if at_end:
            same = a.endswith(view[len(b) - mid : len(b) - lo], 0, len(a) - lo)
        else:
            same = a.startswith(view[lo:mid], lo)
        if same:
            lo = mid
        else:
            hi = mid - 1
    return lo


def shared_ends(a: bytes, b: bytes, known: int = 0) -> tuple[int, int]:
    """(shared prefix, shared suffix) lengths; the suffix never overlaps the prefix. `known`: a
    prefix length they are known to share."""
    shortest = min(len(a), len(b))
    pre = shared(a, b, shortest, known=known)
    return pre, shared(a, b, shortest - pre, at_end=True)
