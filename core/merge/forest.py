"""The parent forest of one rollout's calls: retries, forks and their causes, the root-to-leaf
paths, and the training sequences built along them (see the package docstring)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from core.merge.values import CallTokens, MergedSequence, MergeOptions

if TYPE_CHECKING:
    from core.merge.prefixes import Packed, Prefixes

_NONE = np.iinfo(np.int64).max


class Forest:
    """The parent forest with retries, forks, their causes and the root-to-leaf paths."""

    def __init__(
        self, packed: Packed, parent: np.ndarray, prefixes: Prefixes, tools: np.ndarray
    ) -> None:
        n = parent.size
        self.packed, self.parent, self.prefixes = packed, parent, prefixes
        self.children: list[list[int]] = [[] for _ in range(n)]
        roots: list[int] = []
        for i in range(n):
            (self.children[parent[i]] if parent[i] >= 0 else roots).append(i)
        self.abandoned = np.zeros(n, dtype=bool)
        # A retry group takes its first member's place among siblings and in fork classification.
        self.anchor = np.arange(n)
        for siblings in [roots, *self.children]:
            self._group_retries(siblings)
        rank = self.anchor.__getitem__
        roots.sort(key=rank)
        for kids in self.children:
            kids.sort(key=rank)
        self.continuation = [
            next((k for k in kids if not self.abandoned[k]), -1) for kids in self.children
        ]
        self.preorder = _preorder(roots, self.children)
        self.first_sampled = np.full(n, _NONE, dtype=np.int64)
        self.tools = tools.copy()
        for i in self.preorder:
            up = parent[i]
            if up >= 0:
                self.first_sampled[i] = self.first_sampled[up]
                self.tools[i] |= self.tools[up]
            if self.first_sampled[i] == _NONE and packed.C[i]:
                self.first_sampled[i] = packed.P[i]
        self.cause: list[str] = [""] * n
        for i in self.preorder:
            self.cause[i] = self._fork_cause(i)

    def _group_retries(self, siblings: list[int]) -> None:
        by_prompt: dict[bytes, list[int]] = {}
        for s in siblings:
            by_prompt.setdefault(self.packed.prompt(s).tobytes(), []).append(s)
        for group in by_prompt.values():
            kept = [m for m in group if self.children[m]] or [group[-1]]
            self.abandoned[[m for m in group if m not in kept]] = True
            self.anchor[kept[0]] = group[0]

    def _fork_cause(self, i: int) -> str:
        """Own fork cause, or the inherited one when the call continues its parent's path."""
        if self.abandoned[i]:
            return "abandoned"
        up = self.parent[i]
        if up >= 0 and i == self.continuation[up]:
            return self.cause[up]
        return self._classify(i)

    def _classify(self, f: int) -> str:
        packed, anchor = self.packed, int(self.anchor[f])
        if anchor == 0:
            return "start"
        reach = np.minimum(self.prefixes.row(f)[:anchor], packed.P[f])
        p = int(reach.max())
        tied = np.flatnonzero(reach == p)
        is_tied = np.zeros(packed.F.size, dtype=bool)
        is_tied[tied] = True
        up = np.maximum(self.parent[tied], 0)
        # A tied call whose parent ties too and still covers position p has the parent's tokens
        # and origin there: only the topmost tied calls need a look.
        inherited = (self.parent[tied] >= 0) & is_tied[up] & (packed.F[up] > p)
        looked = tied[~inherited]
        # Most own position p themselves; only the rest climb to the call that does.
        climbs = (self.parent[looked] >= 0) & (packed.F[np.maximum(self.parent[looked], 0)] > p)
        owners = looked[~climbs].tolist()
        for r in looked[climbs]:
            owner = r
            while self.parent[owner] >= 0 and packed.F[self.parent[owner]] > p:
                owner = self.parent[owner]
            owners.append(owner)
        owners = np.array(owners, dtype=np.int64)
        if ((packed.P[owners] <= p) & (p < packed.F[owners])).any():
            return "drift"
        return "rewrite" if (self.first_sampled[looked] < p).any() else "independent"

    def leaf_paths(self) -> list[list[int]]:
        """Root-to-leaf paths in depth-first order, earliest fork first."""
        paths = []
        for i in self.preorder:
            if not self.children[i]:
                path = [i]
                while self.parent[path[-1]] >= 0:
                    path.append(int(self.parent[path[-1]]))
                paths.append(path[::-1])
        return paths


def _preorder(roots: list[int], children: list[list[int]]) -> list[int]:
    order: list[int] = []
    stack = roots[::-1]
    while stack:
        i = stack.pop()
        order.append(i)
        stack.extend(children[i][::-1])
    return order


def build_sequences(
    live: Sequence[CallTokens],
    packed: Packed,
    forest: Forest,
    blocked: np.ndarray,
    side: bool,
    options: MergeOptions,
) -> tuple[list[MergedSequence], np.ndarray]:
    """Build one sequence per path; also which calls were trained somewhere. `side`: toolless
    paths are side calls in this rollout."""
    seen = np.zeros(packed.F.size, dtype=bool)
    sequences = []
    paths = forest.leaf_paths()
    bounds = np.cumsum([0] + [int(packed.F[path[-1]]) for path in paths])
    # One block per array for all sequences, each sequence a view: a rollout re-rendered at
    # every turn has as many sequences as calls, and allocating each alone dominated the merge.
    masks = np.zeros(bounds[-1], dtype=np.uint8)
    all_logprobs = np.zeros(bounds[-1], dtype=np.float32)
    all_versions = np.full(bounds[-1], -1, dtype=np.int32)
    # Paths ending in a call that may be trained go first, so a call shared with a path that
    # ends in an aborted call or an abandoned retry is trained where its conversation went on.
    order = sorted(range(len(paths)), key=lambda k: bool(blocked[paths[k][-1]]))
    built: dict[int, MergedSequence] = {}
    for k in order:
        path = paths[k]
        start, stop = int(bounds[k]), int(bounds[k + 1])
        leaf = path[-1]
        auxiliary = side and not forest.tools[leaf]
        mask = masks[start:stop]
        logprobs = all_logprobs[start:stop]
        versions = all_versions[start:stop]
        trained_here = False
        if not auxiliary or options.train_auxiliary:
            # Walking up stops at the first call an earlier path already handled: its ancestors
            # were handled with it. Untrainable calls (an agent killed mid-stream, a retry the
            # harness dropped) stay context, and the calls before them are still trained.
            for i in reversed(path):
                if seen[i]:
                    break
                seen[i] = True
                if not blocked[i]:
                    trained_here = True
                    span = slice(int(packed.P[i]), int(packed.F[i]))
                    mask[span] = 1
                    logprobs[span] = live[i].logprobs
                    versions[span] = live[i].versions
        built[k] = MergedSequence(
            input_ids=packed.full(leaf),
            loss_mask=mask,
            logprobs=logprobs,
            versions=versions,
            call_ids=[live[i].id for i in path],
            cause=forest.cause[leaf],
            auxiliary=auxiliary,
            # An ended-early path that adds nothing to train is only a record of its last call.
            excluded=not trained_here and (bool(blocked[leaf]) or auxiliary),
        )
    sequences.extend(built[k] for k in range(len(paths)))
    return sequences, seen & ~blocked
