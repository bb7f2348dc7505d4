"""Oversampling with straggler abort: a group starts G + k members and trains the first G to end.

The runner starts `keep + extra` members per group. Each member whose sandbox ends on its own
asks `GroupQuota.take`: the first `keep` are kept (they finish as usual and train); once a group
is full, every member still running is a straggler, stopped by the runner (its sandbox killed,
its calls in flight ended at the gateway, the rollout finished `aborted`: never trained), and a
member not started yet is not started at all.

Keeping the fastest G biases a group toward short rollouts (a slow success is dropped for a
fast failure): the kept members carry `selection_note` in their metadata, the aborted ones say
it in their ledger, and `--oversample 0` (no extra members) turns it off.

Pure: the runner holds the tasks; this only counts.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec


class Oversampling(msgspec.Struct, frozen=True):
    keep: int  # G: members a group trains
    extra: int  # k: members started beyond G

    def __post_init__(self) -> None:
        if self.keep < 1 or self.extra < 0:
            raise ValueError("a group keeps at least 1 member and starts 0 or more extra")

    @property
    def started(self) -> int:
        return self.keep + self.extra

    def note(self) -> dict[str, object]:
        """What every member's metadata says about its group's selection."""
        return {"started": self.started, "trains": self.keep, "selection": "fastest",
                "note": selection_note(self.keep, self.started)}


def selection_note(keep: int, started: int) -> str:
    return (f"the fastest {keep} of {started} members train (length bias: slow rollouts are "
            "under-represented); rolltap rollouts --oversample 0 turns this off")


class GroupQuota:
    """Members kept per group, up to `keep`."""

    def __init__(self, keep: int, kept: Iterable[str] = ()) -> None:
        """`kept`: the group id of every member already kept (a resumed run's)."""
        self.keep = keep
        self.kept: dict[str, int] = {}
        for group in kept:
            self.kept[group] = self.kept.get(group, 0) + 1

    def full(self, group_id: str) -> bool:
        return self.kept.get(group_id, 0) >= self.keep

    def take(self, group_id: str) -> bool:
        """A member of `group_id` ended on its own: True if it is kept, False if its group was
        full already (a straggler)."""
        if self.full(group_id):
            return False
        self.kept[group_id] = self.kept.get(group_id, 0) + 1
        return True
