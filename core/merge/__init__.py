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

import numpy as np

from core.merge import prefixes as prefix_search
from core.merge.forest import Forest, build_sequences
from core.merge.values import (
    CAUSES,
    EXCLUSION_CAUSES,
    CallTokens,
    MergeOptions,
    MergeResult,
    MergeStats,
)

# Calls one rollout's merge takes: its memory is linear in the tokens, but its time grows with
# calls times forks (about 10 s at 40,000 calls of a re-forking agent).
MAX_CALLS = 50_000


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
    packed = prefix_search.Packed(live)
    prefixes = prefix_search.Prefixes(packed)
    parent = prefix_search.find_parents(packed, prefixes)
    forest = Forest(packed, parent, prefixes,
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
    sequences, trained_calls = build_sequences(live, packed, forest, blocked, side, options)

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
    causes: dict[str, int] = dict.fromkeys(CAUSES, 0)
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
