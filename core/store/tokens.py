"""Token arrays on disk: 4-byte little-endian values, and the exact reconstruction of a call's
full prompt from its base call and its stored delta (linear storage, invariant 5)."""

from __future__ import annotations

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


def parents_first(parent_of: Mapping[UUID, UUID | None]) -> list[UUID]:
    """Every call of `parent_of` (call -> the call it is stored against), each after its parent.
    Iterative: chains are as long as the rollout."""
    order: list[UUID] = []
    placed: set[UUID] = set()
    for call_id in parent_of:
        chain = []
        cur: UUID | None = call_id
        while cur is not None and cur not in placed:
            chain.append(cur)
            placed.add(cur)
            cur = parent_of[cur]
        order.extend(reversed(chain))
    return order


def reconstruct_prompts(rows: Iterable[StoredTokens]) -> dict[UUID, np.ndarray]:
    """Full prompt ids of every call: its base's prompt + completion, cut at `prefix_len`,
    followed by its own delta. Bases are resolved first whatever the order of `rows`."""
    by_id: Mapping[UUID, StoredTokens] = {r.id: r for r in rows}
    prompts: dict[UUID, np.ndarray] = {}
    for call_id in parents_first({r.id: r.base_id for r in by_id.values()}):
        row = by_id[call_id]
        if row.base_id is None:
            prompts[row.id] = row.prompt_delta
        else:
            base = by_id[row.base_id]
            base_full = np.concatenate((prompts[base.id], base.completion_ids))
            prompts[row.id] = np.concatenate((base_full[: row.prefix_len], row.prompt_delta))
    return prompts


def chain_ids(rows: Iterable[StoredTokens], call_id: UUID) -> np.ndarray:
    """Prompt + completion ids of `call_id`, from it and its chain of bases among `rows`, equal
    to `reconstruct_prompts` followed by the completion. Built from the pieces that survive each
    call's cut of its base, joined once: the cost follows the call's length plus its chain's,
    where building every prompt of the chain would copy the conversation once per call."""
    by_id: Mapping[UUID, StoredTokens] = {r.id: r for r in rows}
    chain: list[StoredTokens] = []
    cur: UUID | None = call_id
    while cur is not None:
        if len(chain) > len(by_id):
            raise ValueError(f"the chain of bases of call {call_id} loops")
        row = by_id[cur]
        chain.append(row)
        cur = row.base_id
    pieces: list[np.ndarray] = []
    length = 0
    for row in reversed(chain):  # the root first
        if row.base_id is not None:
            while length > row.prefix_len:  # keep the base's first prefix_len ids
                last = pieces.pop()
                length -= last.size
                if length < row.prefix_len:
                    pieces.append(last[: row.prefix_len - length])
                    length = row.prefix_len
        pieces += (row.prompt_delta, row.completion_ids)
        length += row.prompt_delta.size + row.completion_ids.size
    return np.concatenate(pieces) if pieces else np.zeros(0, IDS)
