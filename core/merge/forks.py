"""Every fork's cause at once, in time n log n for n calls (see the package docstring).

A fork f is classified by the earlier calls (before its retry group's first member, `anchor`)
whose full sequence shares the longest prefix, `p` tokens, with f's prompt. With the full
sequences sorted lexicographically, the calls sharing at least p tokens with f are one run of
ranks around f's, so every question about the tied calls becomes a range query:

- p: the longest prefix shared with the nearest earlier call on either side of f's rank;
- rewrite: some tied call's path sampled before p: a range minimum of `first_sampled` over the
  earlier calls;
- drift: position p lies in a sampled span [P, F) of a call on a tied call's path. Such a call
  o shares f's first p tokens (so its rank is in the run) and has an earlier call in its subtree;
  conversely any such o in the run with P[o] <= p < F[o] is that tied call's owner of position p.
  The calls of the run with F > p are the run less its leading copies of f's first p tokens, so
  this is a range minimum of P over the calls whose subtree has an earlier call.

The scan over all earlier calls per fork it replaces was quadratic: 66 s at 40,000 independent
calls. Forks are answered in anchor order while calls enter two minimum trees as they become
earlier.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_INF = np.iinfo(np.int64).max


class MinTree:
    """Minimum over a range of positions, while values are lowered one position at a time."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.t = [_INF] * (2 * n)

    def lower(self, i: int, value: int) -> None:
        t, i = self.t, i + self.n
        while i and t[i] > value:
            t[i] = value
            i >>= 1

    def min(self, lo: int, hi: int) -> int:
        """The minimum over positions lo..hi, both included."""
        t, best = self.t, _INF
        lo, hi = lo + self.n, hi + self.n + 1
        while lo < hi:
            if lo & 1:
                best = min(best, t[lo])
                lo += 1
            if hi & 1:
                hi -= 1
                best = min(best, t[hi])
            lo >>= 1
            hi >>= 1
        return best


class Sparse:
    """Static range minima of an array in O(1) after n log n preparation, and the farthest
    reach from a position over values at least some bound."""

    def __init__(self, values: np.ndarray) -> None:
        self.levels = [values.astype(np.int64)]
        width = 1
        while 2 * width <= values.size:
            prev = self.levels[-1]
            self.levels.append(np.minimum(prev[:-width], prev[width:]))
            width *= 2
        self.lists = [level.tolist() for level in self.levels]
        self.n = values.size

    def min(self, lo: int, hi: int) -> int:
        """Minimum over lo..hi, both included (lo <= hi)."""
        k = (hi - lo + 1).bit_length() - 1
        level = self.lists[k]
        return min(level[lo], level[hi - (1 << k) + 1])

    def reach_right(self, start: int, bound: int) -> int:
        """The first position from `start` on whose value is below `bound` (n if none)."""
        for k in range(len(self.lists) - 1, -1, -1):
            if start + (1 << k) <= self.n and self.lists[k][start] >= bound:
                start += 1 << k
        return start

    def reach_left(self, stop: int, bound: int) -> int:
        """The last position before `stop` whose value is below `bound` (-1 if none)."""
        for k in range(len(self.lists) - 1, -1, -1):
            if stop - (1 << k) >= 0 and self.lists[k][stop - (1 << k)] >= bound:
                stop -= 1 << k
        return stop - 1


def classify(
    forks: Sequence[int],
    anchor: np.ndarray,
    order: np.ndarray,
    adjacent: np.ndarray,
    P: np.ndarray,
    F: np.ndarray,
    first_sampled: np.ndarray,
    subtree_min: np.ndarray,
) -> dict[int, str]:
    """The cause of each fork. `order`: call indices by rank of full sequence, `adjacent[k]`:
    the prefix ranks k-1 and k share; `subtree_min[o]`: the earliest call in o's subtree."""
    n = order.size
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    shared = Sparse(adjacent)
    by_index = Sparse(order)
    F_by_rank = F[order].tolist()
    sampled_from, sampled_where = MinTree(n), MinTree(n)
    entering = np.argsort(subtree_min, kind="stable").tolist()
    subtree_min_l, first_l, P_l, rank_l = (subtree_min.tolist(), first_sampled.tolist(),
                                          P.tolist(), rank.tolist())
    joined = spanned = 0
    causes: dict[int, str] = {}
    for f in sorted(forks, key=lambda i: int(anchor[i])):
        a = int(anchor[f])
        if a == 0:
            causes[f] = "start"
            continue
        while joined < a:
            sampled_from.lower(rank_l[joined], first_l[joined])
            joined += 1
        while spanned < n and subtree_min_l[entering[spanned]] < a:
            o = entering[spanned]
            sampled_where.lower(rank_l[o], P_l[o])
            spanned += 1
        r = rank_l[f]
        # The nearest earlier calls by rank share the longest prefixes with f.
        longest = 0
        before = by_index.reach_left(r, a)
        if before >= 0:
            longest = shared.min(before + 1, r)
        after = by_index.reach_right(r + 1, a)
        if after < n:
            longest = max(longest, shared.min(r + 1, after))
        p = min(longest, P_l[f])
        lo = shared.reach_left(r + 1, p)  # adjacent[lo] < p: lo is the run's first rank
        lo = max(lo, 0)
        hi = shared.reach_right(r + 1, p) - 1
        if sampled_where.min(_first_longer(F_by_rank, lo, hi, p), hi) <= p:
            causes[f] = "drift"
        elif sampled_from.min(lo, hi) < p:
            causes[f] = "rewrite"
        else:
            causes[f] = "independent"
    return causes


def _first_longer(F_by_rank: list[int], lo: int, hi: int, p: int) -> int:
    """The first rank in lo..hi whose sequence is longer than p: the run opens with the copies of
    its shared p tokens (a prefix sorts first), so a bisection finds it (hi + 1 if none)."""
    hi += 1
    while lo < hi:
        mid = (lo + hi) // 2
        if F_by_rank[mid] > p:
            hi = mid
        else:
            lo = mid + 1
    return lo
