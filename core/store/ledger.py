"""What a consumed rollout gave the trainer (`rollouts.ledger`): tokens trained, and tokens
excluded by cause, with one line saying why a rollout trained nothing.

Pure. The trainer bridge writes a ledger when it consumes a rollout (trainer_bridge/deliveries.py);
`rolltap inspect` and the viewer read it, or, before consumption, the merge's own counts.

Causes: the merge's (core/merge/ `EXCLUSION_CAUSES`: incomplete, aborted, abandoned,
constrained, auxiliary) and the bridge's:
- stale: trained tokens more than `--max-staleness` versions behind the trainer when it took them;
- too_long: sequences longer than `--token-budget`, never truncated;
- zero_advantage: tokens of a rollout whose advantage is 0 (every reward of its group equal, or
  its own reward unscorable): they reach the optimizer, but carry no gradient;
- dropped: the rollout's group was dropped (partial past its deadline, or late after release).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from core.merge.values import EXCLUSION_CAUSES, EXCLUSION_FLAGS

if TYPE_CHECKING:
    import asyncpg

BRIDGE_CAUSES = ("stale", "too_long", "zero_advantage", "dropped")
CAUSES = (*EXCLUSION_CAUSES, *BRIDGE_CAUSES)
FLAGS = {
    **EXCLUSION_FLAGS,
    "stale": "the bridge's --max-staleness (or the runner's --max-backlog, to train fresher)",
    "too_long": "the bridge's --token-budget",
    "zero_advantage": "tasks whose rollouts score differently (a group whose rewards are all "
    "equal has nothing to learn from), or a larger --num-generations",
    "dropped": "the bridge's --partial-groups train, or a longer --group-deadline",
}


class Ledger(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`trained_tokens` went to the loss with a nonzero advantage; every other token the engine
    sampled for the rollout is in `excluded_tokens` under the cause that kept it out."""

    trained_tokens: int
    excluded_tokens: dict[str, int]
    reason: str | None = None  # one line, when nothing trained


def account(
    merge_stats: Mapping,
    advantage: float | None,
    deliveries: Iterable[tuple[str, int, int]],
    *,
    dropped: bool = False,
) -> Ledger:
    """The ledger of a rollout being consumed. `deliveries`: (outcome, trained tokens, tokens
    masked or put aside) of each of its logged traces; `dropped`: its group was dropped."""
    excluded: dict[str, int] = dict.fromkeys(CAUSES, 0)
    for cause, tokens in (merge_stats.get("excluded_by_cause") or {}).items():
        excluded[cause] = excluded.get(cause, 0) + int(tokens)
    trained = 0
    if dropped:
        excluded["dropped"] = int(merge_stats.get("trained_tokens") or 0)
    for outcome, took, aside in deliveries:
        trained += int(took or 0)
        excluded["too_long" if outcome == "too_long" else "stale"] += int(aside or 0)
    if advantage == 0 and trained:
        excluded["zero_advantage"], trained = trained, 0
    return Ledger(trained, excluded, nothing_trained(trained, excluded))


def nothing_trained(trained: int, excluded: Mapping[str, int]) -> str | None:
    """Why nothing of a rollout trained, in one line that names what changes it; None when
    something trained."""
    if trained:
        return None
    causes = sorted(((n, c) for c, n in excluded.items() if n), key=lambda nc: (-nc[0], nc[1]))
    if not causes:
        return "trained nothing: no call of this rollout sampled a token"
    (tokens, cause), rest = causes[0], causes[1:]
    also = "; also " + ", ".join(f"{c} {n}" for n, c in rest) if rest else ""
    return (
        f"trained nothing: {tokens} sampled tokens excluded as {cause}{also}. "
        f"What changes it: {FLAGS.get(cause, cause)}"
    )


def merge_reason(merge_stats: Mapping | None) -> str | None:
    """A merged rollout's reason to train nothing, from its merge alone (before a bridge)."""
    if not merge_stats:
        return None
    return nothing_trained(
        int(merge_stats.get("trained_tokens") or 0), merge_stats.get("excluded_by_cause") or {}
    )


def rollout_reason(row: Mapping[str, Any] | asyncpg.Record) -> str | None:
    """A rollout's one line on why it trained nothing: its ledger's once a bridge consumed it,
    else what its merge left to train (None: something trains, or it is not merged)."""
    if row["ledger"]:
        return row["ledger"].get("reason")
    return merge_reason(row["merge_stats"])
