"""Merging one rollout's recorded model calls into token-faithful training sequences.

Pure: no I/O. The gateway feeds it the engine's token ids of every call of a finished rollout and
stores what comes back.

Structure (invariant 3, "same conditioning"). A call's parent is the call, earlier or later in
arrival order, whose prompt + completion is the longest exact token prefix of the call's prompt.
Ties between calls with identical full sequences go to one that arrived before the child, then to
the latest; a call with an empty completion never points back at a call whose full sequence equals
its own, so the forest has no cycles. Every root-to-leaf path is one sequence: the leaf's prompt +
completion, with the sampled span of every call on the path at its own prompt's length, so each
trained token is preceded by exactly the tokens the engine conditioned on. A call on several paths
is trained in the first of them (depth-first, earliest fork first) and is context elsewhere.

Forks. Every sequence exists because of exactly one fork, and its `cause` names it:
- "start": the rollout's first root.
- "abandoned": the path ends in an abandoned retry. Retries are siblings (same parent, or both
  roots) with identical prompts; in such a group the members with descendants are kept, or, when
  all are leaves, the latest one; the others are abandoned.
- "drift" / "rewrite" / "independent": any other root, and any child after the first of its parent
  (children ordered by arrival, a retry group at its first member's place). It is classified by the
  earlier call c* whose full sequence shares the longest prefix with the fork's prompt, at the
  divergence position p: inside a sampled span of c*'s path -> drift (the harness re-serialised an
  assistant turn); in context after the path's first sampled token -> rewrite (compaction, edited
  history); before it -> independent (sub-agents, side calls). When several earlier calls tie, the
  most specific reading wins (drift, then rewrite). A retry whose answers were both continued
  counts as drift: its prompt ends where the other answer's sampled tokens begin.
The other paths' cause is inherited from the nearest fork above their leaf.

Why forks and not only roots: under exact-prefix parents a root can only diverge inside its
nearest tree root's prompt or completion, never after one of its calls ends, so "rewrite" could
never be observed at a root; and a drift in any turn but the first makes the re-rendered call a
sibling of the call it re-rendered, which must not be mistaken for a retry (its tokens were used).

Exclusion. Abandoned calls (unless `train_abandoned`) and aborted or failed calls (unless
`train_aborted`) are never trained: they stay context in their path, and the calls before them are
still trained (an agent killed mid-stream keeps every turn it completed). Paths ending in a
trainable call are built first, so shared calls train where the conversation went on; a path that
then adds nothing to train is excluded, and so is an auxiliary path unless `train_auxiliary`.
Calls without any token (a request that failed before the engine saw it) are counted but form no
sequence.

Side calls (`side_calls`). A harness calls the model beside the agent's work for titles and
summaries: toolless calls with prompts of their own, not the policy's work. A path none of whose
calls offered tools is auxiliary (a side call) only where the rollout says so:
- "auto" (the default): only beside agent work, i.e. when another call of the rollout offered
  tools. A rollout that never offered tools is a plain chat rollout (single-turn QA, a chat-only
  agent), and all of it is the policy's work.
- "toolless": always. The rollout's creator knows its harness is a tool-using agent, so a rollout
  left with nothing but toolless calls (the harness failed before its first agent turn) holds only
  side calls and trains nothing.
- "none": never.
Every sampled token not trained is counted under the first reason that keeps it out
(`EXCLUSION_CAUSES`), so a rollout that trains nothing can say why.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import msgspec
import numpy as np

CAUSES = ("drift", "rewrite", "independent", "abandoned")
# Calls one rollout's merge takes: its memory is linear in the tokens, but its time grows with
# calls times forks (about 10 s at 40,000 calls of a re-forking agent).
MAX_CALLS = 50_000
STATUSES = ("ok", "aborted", "failed")
SIDE_CALLS = ("auto", "toolless", "none")
SideCalls = Literal["auto", "toolless", "none"]
# Why a sampled token is not trained, in the order a call's reason is picked: the merge's own
# causes here, the trainer bridge adds its own (gateway/store/ledger.py).
EXCLUSION_CAUSES = ("incomplete", "aborted", "abandoned", "constrained", "auxiliary")
# The setting that trains tokens excluded for each cause, for messages that say what to do.
EXCLUSION_FLAGS = {
    "incomplete": "none: the engine's record of these tokens is incomplete",
    "aborted": "the gateway's --train-aborted",
    "abandoned": "the gateway's --train-abandoned",
    "constrained": "the gateway's --train-constrained",
    "auxiliary": "the gateway's --train-auxiliary, or side_calls none on POST /admin/rollouts",
}
_NONE = np.iinfo(np.int64).max


class CallTokens(msgspec.Struct, frozen=True, eq=False):
    """One recorded model call, as the engine saw and sampled it.

    A Struct like every record type of the project; numpy fields are fine because a Struct does not
    validate on construction, and __post_init__ normalises them (lists or other widths from the
    store) to the dtypes the merge relies on.
    """

    id: str
    seq: int
    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    status: str
    offered_tools: bool
    # Sampled under a grammar or banned/forced tokens: not the free policy's logprobs.
    constrained: bool = False
    # Stored tokens that cannot be trained at all (e.g. logprobs that do not line up): the
    # call is context for its successors and never trained, whatever the options.
    context_only: bool = False
    # Retry evidence: the request body's digest, the SDK's retry count, and when the call
    # started (seconds, any epoch) to order attempts.
    digest: bytes | None = None
    retry_count: int = 0
    started: float = 0.0

    def __post_init__(self) -> None:
        for name, dtype in (
            ("prompt_ids", np.int32),
            ("completion_ids", np.int32),
            ("logprobs", np.float32),
            ("versions", np.int32),
        ):
            array = np.ascontiguousarray(getattr(self, name), dtype=dtype)
            if array.ndim != 1:
                raise ValueError(f"call {self.id}: {name} must be one-dimensional")
            msgspec.structs.force_setattr(self, name, array)
        sampled = self.completion_ids.size
        if self.logprobs.size != sampled or self.versions.size != sampled:
            raise ValueError(
                f"call {self.id}: {sampled} completion ids but {self.logprobs.size} logprobs "
                f"and {self.versions.size} versions"
            )
        if self.status not in STATUSES:
            raise ValueError(f"call {self.id}: status {self.status!r} not in {STATUSES}")


class MergeOptions(msgspec.Struct, frozen=True, kw_only=True):
    train_constrained: bool = False
    train_auxiliary: bool = False
    train_abandoned: bool = False
    train_aborted: bool = False
    # Which toolless calls are side calls (see the module doc); set per rollout by its creator.
    side_calls: SideCalls = "auto"

    def __post_init__(self) -> None:
        if self.side_calls not in SIDE_CALLS:
            raise ValueError(f"side_calls must be one of {SIDE_CALLS}, not {self.side_calls!r}")


class MergedSequence(msgspec.Struct, frozen=True, eq=False):
    input_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    call_ids: list[str]
    cause: str
    auxiliary: bool
    excluded: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "input_ids": self.input_ids.tolist(),
            "loss_mask": self.loss_mask.tolist(),
            "logprobs": self.logprobs.tolist(),
            "versions": self.versions.tolist(),
            "call_ids": list(self.call_ids),
            "cause": self.cause,
            "auxiliary": self.auxiliary,
            "excluded": self.excluded,
        }


class MergeStats(msgspec.Struct, frozen=True):
    calls: int
    sequences: int
    trained_tokens: int
    sampled_tokens: int
    lost_tokens: int
    excluded_tokens: int
    causes: dict[str, int]
    excluded_sequences: int
    auxiliary_sequences: int
    constrained_calls: int = 0
    constrained_tokens: int = 0  # sampled under constraints, not trained unless configured
    retried_calls: int = 0  # earlier attempts of a retried request, marked abandoned
    context_only_calls: int = 0  # calls whose tokens could not be trained at all
    # Sampled tokens not trained, by the first reason (EXCLUSION_CAUSES) that keeps each call out.
    excluded_by_cause: dict[str, int] = {}


class MergeResult(msgspec.Struct, frozen=True, eq=False):
    sequences: list[MergedSequence]
    stats: MergeStats
    parents: dict[str, str | None]
    options: MergeOptions
    abandoned: list[str] = []  # calls marked abandoned (retried, or a dropped retry sibling)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sequences": [s.to_dict() for s in self.sequences],
            "stats": msgspec.structs.asdict(self.stats),
            "parents": dict(self.parents),
            "options": msgspec.structs.asdict(self.options),
        }


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
    prompt: Any, candidates: Sequence[tuple[str, Any]], opens: int | None = None
) -> tuple[str | None, int]:
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


class TooManyCalls(ValueError):
    """A rollout with more calls than the merge takes (MAX_CALLS)."""


def merge(calls: Sequence[CallTokens], options: MergeOptions = MergeOptions()) -> MergeResult:
    """Merge one rollout's calls (any order) into training sequences; see the module docstring.
    Raises TooManyCalls past MAX_CALLS: the rollout is then marked merge_failed with the reason."""
    if len(calls) > MAX_CALLS:
        raise TooManyCalls(f"{len(calls)} calls, more than the {MAX_CALLS} one rollout's merge "
                           "takes: end rollouts sooner (a harness in a loop?) or split the task")
    ordered = sorted(calls, key=lambda c: (c.seq, c.id))
    if len({c.id for c in ordered}) != len(ordered):
        raise ValueError("duplicate call ids")
    live = [c for c in ordered if c.prompt_ids.size or c.completion_ids.size]
    packed = Packed(live)
    prefixes = Prefixes(packed)
    parent = _find_parents(packed, prefixes)
    forest = _Forest(packed, parent, prefixes,
                     np.array([c.offered_tools for c in live], dtype=bool))
    retried = _retried(live, parent)
    abandoned = forest.abandoned | retried
    constrained = np.array([c.constrained for c in live], dtype=bool)
    blocked = abandoned & (not options.train_abandoned)
    if not options.train_aborted:
        blocked |= np.array([c.status != "ok" for c in live], dtype=bool)
    if not options.train_constrained:
        blocked |= constrained
    blocked |= np.array([c.context_only for c in live], dtype=bool)
    side = options.side_calls == "toolless" or (
        options.side_calls == "auto" and any(c.offered_tools for c in live)
    )
    sequences, trained_calls = _sequences(live, packed, forest, blocked, side, options)

    excluded_call = ~trained_calls
    reasons = (
        np.array([c.context_only for c in live], dtype=bool),
        np.array([c.status != "ok" for c in live], dtype=bool),
        abandoned,
        constrained,
        np.ones(len(live), dtype=bool),  # not blocked, yet on no trained path: a side call
    )
    left = excluded_call.copy()
    excluded_by_cause = {}
    for cause, reason in zip(EXCLUSION_CAUSES, reasons, strict=True):
        excluded_by_cause[cause] = int(packed.C[left & reason].sum())
        left &= ~reason
    trained = sum(int(np.count_nonzero(s.loss_mask)) for s in sequences)
    sampled = int(packed.C[~excluded_call].sum())
    causes = dict.fromkeys(CAUSES, 0)
    for s in sequences:
        if s.cause in causes:
            causes[s.cause] += 1
    stats = MergeStats(
        calls=len(ordered),
        sequences=len(sequences),
        trained_tokens=trained,
        sampled_tokens=sampled,
        # From the masks actually built: a merge that drops or double-trains a token shows here.
        lost_tokens=sampled - trained,
        excluded_tokens=int(packed.C[excluded_call].sum()),
        causes=causes,
        excluded_sequences=sum(s.excluded for s in sequences),
        auxiliary_sequences=sum(s.auxiliary for s in sequences),
        constrained_calls=int(constrained.sum()),
        constrained_tokens=int(packed.C[constrained].sum()),
        retried_calls=int(retried.sum()),
        context_only_calls=sum(c.context_only for c in live),
        excluded_by_cause=excluded_by_cause,
    )
    parents: dict[str, str | None] = {c.id: None for c in ordered}
    for i, c in enumerate(live):
        if parent[i] >= 0:
            parents[c.id] = live[parent[i]].id
    return MergeResult(
        sequences=sequences,
        stats=stats,
        parents=parents,
        options=options,
        abandoned=[c.id for c, a in zip(live, abandoned) if a],
    )


def _retried(calls: Sequence[CallTokens], parent: np.ndarray) -> np.ndarray:
    """Earlier attempts of retried requests. A request whose body repeats an earlier call's
    retries that call; one that carries the SDK's retry count (its body may differ) retries the
    latest earlier call. Only a call nothing continued counts: a client retries only what it
    never used."""
    n = len(calls)
    retried = np.zeros(n, dtype=bool)
    usable = np.ones(n, dtype=bool)
    usable[parent[parent >= 0]] = False
    order = sorted(range(n), key=lambda i: (calls[i].started, calls[i].seq))
    latest: dict[bytes, int] = {}
    for k, j in enumerate(order):
        c = calls[j]
        earlier = latest.get(c.digest) if c.digest is not None else None
        if earlier is None and c.retry_count > 0:
            earlier = next((i for i in reversed(order[:k]) if usable[i]), None)
        if earlier is not None and usable[earlier]:
            retried[earlier] = True
            usable[earlier] = False
        if c.digest is not None:
            latest[c.digest] = j
    return retried


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


def _find_parents(packed: Packed, prefixes: Prefixes) -> np.ndarray:
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


class _Forest:
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


def _sequences(
    live: Sequence[CallTokens],
    packed: Packed,
    forest: _Forest,
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
