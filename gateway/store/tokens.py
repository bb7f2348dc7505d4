"""Token arrays on disk: 4-byte little-endian values, and the exact reconstruction of a call's
full prompt from its base call and its stored delta (linear storage, invariant 5)."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from uuid import UUID

import numpy as np

IDS = np.dtype("<i4")
LOGPROBS = np.dtype("<f4")


def ids_from_bytes(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=IDS)


def logprobs_from_bytes(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=LOGPROBS)


class StoredTokens:
    """The token columns of one stored call."""

    __slots__ = ("id", "base_id", "prefix_len", "prompt_delta", "completion_ids")

    def __init__(
        self,
        id: UUID,
        base_id: UUID | None,
        prefix_len: int,
        prompt_delta: bytes,
        completion_ids: bytes,
    ) -> None:
        self.id = id
        self.base_id = base_id
        self.prefix_len = prefix_len
        self.prompt_delta = ids_from_bytes(prompt_delta)
        self.completion_ids = ids_from_bytes(completion_ids)


def reconstruct_prompts(rows: Iterable[StoredTokens]) -> dict[UUID, np.ndarray]:
    """Full prompt ids of every call: its base's prompt + completion, cut at `prefix_len`,
    followed by its own delta. Bases are resolved first whatever the order of `rows`."""
    by_id: Mapping[UUID, StoredTokens] = {r.id: r for r in rows}
    prompts: dict[UUID, np.ndarray] = {}

    def full(call_id: UUID) -> np.ndarray:
        # Iterative walk down to a resolved call: chains are as long as the rollout.
        chain = []
        cur: UUID | None = call_id
        while cur is not None and cur not in prompts:
            chain.append(by_id[cur])
            cur = by_id[cur].base_id
        for row in reversed(chain):
            if row.base_id is None:
                prompts[row.id] = row.prompt_delta
            else:
                base = by_id[row.base_id]
                base_full = np.concatenate((prompts[base.id], base.completion_ids))
                prompts[row.id] = np.concatenate((base_full[: row.prefix_len], row.prompt_delta))
        return prompts[call_id]

    for call_id in by_id:
        full(call_id)
    return prompts


class RecentCalls:
    """Prompt + completion ids of each running rollout's latest calls, the candidates a new
    call's prompt is delta-encoded against. Bounded: the newest calls of a rollout are almost
    always the best base, and a miss only costs storage, never correctness."""

    def __init__(self, per_rollout: int = 8, rollouts: int = 4096) -> None:
        self.per_rollout = per_rollout
        self._rollouts = rollouts
        self._calls: OrderedDict[UUID, deque[tuple[UUID, np.ndarray]]] = OrderedDict()

    def get(self, rollout_id: UUID) -> list[tuple[UUID, np.ndarray]] | None:
        calls = self._calls.get(rollout_id)
        if calls is None:
            return None
        self._calls.move_to_end(rollout_id)
        return list(calls)

    def load(self, rollout_id: UUID, calls: Iterable[tuple[UUID, np.ndarray]]) -> None:
        self._calls[rollout_id] = deque(calls, maxlen=self.per_rollout)
        self._calls.move_to_end(rollout_id)
        while len(self._calls) > self._rollouts:
            self._calls.popitem(last=False)

    def add(self, rollout_id: UUID, call_id: UUID, full_ids: np.ndarray) -> None:
        calls = self._calls.get(rollout_id)
        if calls is None:
            self.load(rollout_id, [(call_id, full_ids)])
        else:
            calls.append((call_id, full_ids))

    def forget(self, rollout_id: UUID) -> None:
        self._calls.pop(rollout_id, None)
