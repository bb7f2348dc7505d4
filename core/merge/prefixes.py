"""Shared token prefixes between calls: the longest one a prompt shares with earlier calls (a
call's delta base), and every call's parent in a rollout, found in memory linear in the calls."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

from core.merge.values import CallTokens

Id = TypeVar("Id")  # a call id: str in the merge, UUID when recording


def common_prefix_len(a: Any, b: Any) -> int:
    """Length of the common prefix of two token sequences.

    Compares in growing windows so that the cost follows the common prefix, not the lengths.
    """
    a, b = np.asarray(a), np.asarray(b)
    n = min(a.size, b.size)
    start, width = 0, 256
    while start < n:
        stop = min(n, start + width)
        diff = np.flatnonzero(a[start:stop] != b[start:stop])
        if diff.size:
            return start + int(diff[0])
        start, width = stop, width * 8
    return n


def best_base(
    prompt: Any, candidates: Sequence[tuple[Id, Any]], opens: int | None = None
) -> tuple[Id | None, int]:
    """The candidate (call id, that call's prompt + completion ids) sharing the longest prefix with
    `prompt`, and that length; (None, 0) if none shares a token.

    Ties go to the longer candidate, then the later one in `candidates`. Candidates are tried
    longest first, and one is compared in full only if its token right after the best prefix so far
    matches, so a linear conversation costs one comparison. `opens`: the index of a candidate
    whose ids are known to open `prompt` (the prompt was built from them), not compared at all.
    """
    prompt = np.asarray(prompt)
    arrays = [np.asarray(ids) for _, ids in candidates]
    order = sorted(range(len(arrays)), key=lambda k: (-arrays[k].size, -k))
    best_id, best = None, 0
    for k in order:
        if min(arrays[k].size, prompt.size) <= best:
            break
        if k == opens:
            shared = arrays[k].size
        elif arrays[k][best] != prompt[best]:
            continue
        else:
            shared = common_prefix_len(prompt, arrays[k])
        if shared > best:
            best_id, best = candidates[k][0], shared
    return best_id, best


class Packed:
    """Every call's prompt + completion in one buffer, so probes and comparisons are gathers."""

    def __init__(self, calls: Sequence[CallTokens]) -> None:
        self.P = np.array([c.prompt_ids.size for c in calls], dtype=np.int64)
        self.C = np.array([c.completion_ids.size for c in calls], dtype=np.int64)
        self.F = self.P + self.C
        self.off = np.concatenate(([0], np.cumsum(self.F)[:-1])).astype(np.int64)
        parts = [a for c in calls for a in (c.prompt_ids, c.completion_ids)]
        self.tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        self.tokens.flags.writeable = False

    def full(self, i: int) -> np.ndarray:
        return self.tokens[self.off[i] : self.off[i] + self.F[i]]

    def prompt(self, i: int) -> np.ndarray:
        return self.tokens[self.off[i] : self.off[i] + self.P[i]]


def find_parents(packed: Packed, prefixes: Prefixes) -> np.ndarray:
    """Index of each call's parent (-1 for a root); calls in (seq, id) order, none empty.

    One pass over the full sequences in lexicographic order keeps a stack of those that open
    the current one (a sequence's prefixes come before it, and what follows a sequence opens
    the next only as far as the two share): the parent is the longest of them that the
    current call's prompt holds whole. Identical sequences sit together in the stack.
    """
    n = packed.F.size
    parent = np.full(n, -1, dtype=np.int64)
    F, P = packed.F.tolist(), packed.P.tolist()
    adjacent = prefixes.adjacent.tolist()
    stack: list[int] = []
    for k, j in enumerate(prefixes.order.tolist()):
        while stack and F[stack[-1]] > adjacent[k]:
            stack.pop()
        top = len(stack)
        while top:
            length = F[stack[top - 1]]
            bottom = top - 1
            while bottom and F[stack[bottom - 1]] == length:
                bottom -= 1
            if length <= P[j]:
                # Its identical copies: before j first, then the latest; with an empty
                # completion, j's own copies only from before it (or two such calls would be
                # each other's parent).
                same = [i for i in stack[bottom:top] if length < F[j] or i < j]
                if same:
                    parent[j] = max(same, key=lambda i: (i < j, i))
                    break
            top = bottom
        stack.append(j)
    return parent


class Prefixes:
    """Common-prefix lengths between the calls' full sequences in memory linear in the calls:
    with the sequences sorted lexicographically, the common prefix of two is the smallest of
    the adjacent ones between them (not an n x n matrix: 13.5 GiB at 40,000 calls)."""

    def __init__(self, packed: Packed) -> None:
        n = packed.F.size
        self.F = packed.F
        # Fixed-width big-endian bytes order as the token sequences do, a prefix first.
        order = sorted(range(n), key=lambda i: packed.full(i).astype(">i4").tobytes())
        self.order = np.array(order, dtype=np.int64)
        self.rank = np.empty(n, dtype=np.int64)
        self.rank[order] = np.arange(n)
        self.adjacent = np.zeros(n, dtype=np.int64)  # [k]: sorted k-1 with sorted k
        for k in range(1, n):
            self.adjacent[k] = common_prefix_len(packed.full(order[k - 1]), packed.full(order[k]))

    def row(self, i: int) -> np.ndarray:
        """The common-prefix length of call i's full sequence with every call's (i's own: F)."""
        k, n = int(self.rank[i]), self.F.size
        by_rank = np.empty(n, dtype=np.int64)
        by_rank[k] = self.F[i]
        by_rank[:k] = np.minimum.accumulate(self.adjacent[1 : k + 1][::-1])[::-1]
        by_rank[k + 1 :] = np.minimum.accumulate(self.adjacent[k + 1 :])
        return by_rank[self.rank]
