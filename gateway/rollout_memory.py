"""What the gateway remembers of each running rollout between its calls, in memory: its recent
calls (ids, bodies, continuation keys, request layout) and the reply keys of its calls. Recording
alone adds a call to it, once the call's row is committed; the continuation planner reads it and
fills the reply index with what it read from the database on a miss; request parsing reads it.
A miss costs a database read (or a whole body stored), never correctness."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple
from uuid import UUID

import numpy as np

if TYPE_CHECKING:
    from gateway.continuation.keys import RequestKeys
    from gateway.protocols.resumable import Layout


# What an entry costs besides its arrays and bytes (the tuple, the array and bytes headers).
_ENTRY_OVERHEAD = 256


class RecentCall(NamedTuple):
    """One recent call as later calls of its rollout use it."""

    id: UUID
    full: np.ndarray  # prompt + completion ids: a delta-encoding candidate, a continued parent
    keys: RequestKeys | None = None  # its continuation keys, resumed by a later request's
    # The request body as sent and the stored response summary (uncompressed): what a later
    # request body is a delta against (store/bodies).
    body: bytes | None = None
    reply: bytes = b""
    # `full` as JSON, in the pieces it was written in (gateway/engine_ids: the engine's text of
    # the prompt ids, then the sampled ids): a continuation's prompt is sent as this text
    # extended, not as its ids encoded again; the calls continuing it share its pieces.
    full_json: tuple[bytes, ...] | None = None
    # `full` is the start of a newer call's array, and `full_json` of its pieces (counted there).
    shared: bool = False
    # Where the request's conversation lies in its body (gateway/protocols/resumable): a later
    # request of the rollout is decoded from here. Its items are the keys' messages.
    request: Layout | None = None

    @property
    def nbytes(self) -> int:
        return (
            _ENTRY_OVERHEAD
            + (0 if self.shared else self.full.nbytes)
            + (len(self.body) if self.body is not None else 0)
            + len(self.reply)
            + (0 if self.shared or self.full_json is None else sum(map(len, self.full_json)))
            + (self.keys.nbytes if self.keys is not None else 0)
            + (0 if self.request is None else _layout_nbytes(self.request, self.body, self.keys))
        )


def _layout_nbytes(layout: Layout, body: bytes | None, keys: RequestKeys | None) -> int:
    """A layout's offsets, its body unless that is counted as the call's body already, and its
    decoded items (about as large as their JSON) unless they are the messages the keys hold:
    a protocol that translates its messages to chat keeps both."""
    n = 8 * len(layout.ends) + (0 if layout.raw is body else len(layout.raw))
    shared = keys is not None and keys.holds(layout.items)
    return n if shared else n + len(layout.raw)


class RecentCalls:
    """Each running rollout's latest calls: the candidates a new call's prompt is delta-encoded
    against, and what a continued or delta-stored call needs of its parent. The newest calls of
    a rollout are almost always the best base, and a miss only costs a database read (or a
    whole body stored), never correctness.

    Bounded by bytes (`max_bytes`): the least recently used rollouts are dropped first; a
    rollout whose calls alone exceed the bound is not kept at all. A call's body, its layout
    and its keys are as large as its conversation again, and needed only of the call a
    conversation's next request extends: a call continued by a newer one (`supersedes`) drops
    them (a retry of the newer call finds them there), and only the newest `heavy` calls of a
    rollout keep them.

    A call's ids usually open the next call's (a conversation goes on): the older calls then
    keep views of the newest call's array, and the pieces of its JSON, rather than their own,
    so a rollout's ids take the memory of its longest call, not of each of its calls."""

    def __init__(self, max_bytes: int = 512 << 20, per_rollout: int = 8, heavy: int = 4) -> None:
        self.max_bytes = max_bytes
        self.per_rollout = per_rollout
        self.heavy = heavy
        self.nbytes = 0
        self._calls: OrderedDict[UUID, deque[RecentCall]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._calls)

    def rollouts(self) -> list[UUID]:
        """The rollouts kept, least recently used first."""
        return list(self._calls)

    def entries(self, rollout_id: UUID) -> list[RecentCall] | None:
        calls = self._calls.get(rollout_id)
        if calls is None:
            return None
        self._calls.move_to_end(rollout_id)
        return list(calls)

    def get(self, rollout_id: UUID) -> list[tuple[UUID, np.ndarray]] | None:
        """(call id, prompt + completion ids) of the rollout's recent calls, oldest first."""
        calls = self.entries(rollout_id)
        return None if calls is None else [(c.id, c.full) for c in calls]

    def find(self, rollout_id: UUID, call_id: UUID) -> RecentCall | None:
        return next((c for c in self._calls.get(rollout_id) or () if c.id == call_id), None)

    def load(self, rollout_id: UUID, calls: Iterable[tuple[UUID, np.ndarray]]) -> None:
        self.forget(rollout_id)
        self._calls[rollout_id] = deque()
        for call_id, full in calls:
            self._append(rollout_id, RecentCall(call_id, full))
        self._bound()

    def add(
        self,
        rollout_id: UUID,
        call_id: UUID,
        full_ids: np.ndarray,
        keys: RequestKeys | None = None,
        body: bytes | None = None,
        reply: bytes = b"",
        full_json: tuple[bytes, ...] | None = None,
        supersedes: UUID | None = None,
        request: Layout | None = None,
    ) -> None:
        """`supersedes`: a call this one continues (its ids start with that call's)."""
        if rollout_id not in self._calls:
            self._calls[rollout_id] = deque()
        self._calls.move_to_end(rollout_id)
        self._append(
            rollout_id,
            RecentCall(call_id, full_ids, keys, body, reply, full_json, request=request),
            supersedes,
        )
        if supersedes is not None:
            self._lighten(rollout_id, supersedes)
        self._bound()

    def forget(self, rollout_id: UUID) -> None:
        for call in self._calls.pop(rollout_id, ()):
            self.nbytes -= call.nbytes

    def _append(self, rollout_id: UUID, call: RecentCall, supersedes: UUID | None = None) -> None:
        calls = self._calls[rollout_id]
        if calls:
            self._share(calls, call, known=calls[-1].id == supersedes)
        if len(calls) >= self.per_rollout:
            self.nbytes -= calls.popleft().nbytes
        calls.append(call)
        self.nbytes += call.nbytes
        if len(calls) > self.heavy:
            self._lighten(rollout_id, calls[-self.heavy - 1].id)

    def _lighten(self, rollout_id: UUID, call_id: UUID) -> None:
        """Drops a call's body, layout and keys, and its JSON unless a newer call's pieces hold
        it; the calls whose JSON is the start of its pieces then drop theirs too (counted
        nowhere)."""
        calls = self._calls[rollout_id]
        for i, old in enumerate(calls):
            if old.id != call_id or i == len(calls) - 1:
                continue
            light = old._replace(
                keys=None,
                body=None,
                reply=b"",
                full_json=old.full_json if old.shared else None,
                request=None,
            )
            self.nbytes += light.nbytes - old.nbytes
            calls[i] = light
            if not old.shared and old.full_json is not None:
                owner = _owner(old.full)
                for j, c in enumerate(calls):
                    if c.shared and c.full_json is not None and _owner(c.full) is owner:
                        calls[j] = c._replace(full_json=None)  # shared: counted as 0 before too

    def _share(self, calls: deque[RecentCall], new: RecentCall, known: bool = False) -> None:
        """When `new`'s ids extend the newest call's (`known`: they are said to), that call and
        the calls viewing its array view `new`'s instead, and keep their JSON where `new`'s
        pieces start with theirs. Views are always older than the call whose array they view, so
        dropping the oldest calls first never drops an array a kept call still views."""
        newest = calls[-1].full
        n = newest.size
        if n > new.full.size or not (known or np.array_equal(new.full[:n], newest)):
            return
        owner = _owner(newest)
        for i, c in enumerate(calls):
            if _owner(c.full) is owner:
                shared = c._replace(
                    full=new.full[: c.full.size],
                    shared=True,
                    full_json=c.full_json if _starts(new.full_json, c.full_json) else None,
                )
                self.nbytes += shared.nbytes - c.nbytes
                calls[i] = shared

    def _bound(self) -> None:
        while self.nbytes > self.max_bytes and self._calls:
            self.forget(next(iter(self._calls)))


def _starts(pieces: tuple[bytes, ...] | None, prefix: tuple[bytes, ...] | None) -> bool:
    """Whether `pieces` starts with the very pieces of `prefix` (not copies of them)."""
    if pieces is None or prefix is None or len(prefix) > len(pieces):
        return False
    return all(a is b for a, b in zip(prefix, pieces))


def _owner(ids: np.ndarray) -> object:
    """What holds an array's memory: the array itself, or what it is a view of."""
    return ids if ids.base is None else ids.base


class Replies:
    """One rollout's reply keys, and the keys the database did not know either."""

    __slots__ = ("calls", "missing")

    def __init__(self) -> None:
        self.calls: dict[bytes, UUID] = {}  # reply key -> call id, oldest first
        # Keys the database did not know either: a harness that sends the same unknown turn
        # again (a rewritten history) costs one query, not one per call.
        self.missing: dict[bytes, None] = {}


class ReplyIndex:
    """Reply key -> call id, per running rollout; bounded, newest rollouts kept. A miss costs a
    database query or an exact continuation, never correctness."""

    def __init__(self, per_rollout: int = 4096, rollouts: int = 4096) -> None:
        self._per_rollout = per_rollout
        self._rollouts = rollouts
        self._index: OrderedDict[UUID, Replies] = OrderedDict()

    def get(self, rollout_id: UUID) -> Replies:
        replies = self._index.get(rollout_id)
        if replies is None:
            replies = self._index[rollout_id] = Replies()
            while len(self._index) > self._rollouts:
                self._index.popitem(last=False)
        self._index.move_to_end(rollout_id)
        return replies

    def add(self, rollout_id: UUID, call_id: UUID, reply_keys: list[bytes]) -> None:
        replies = self.get(rollout_id)
        for key in reply_keys:
            replies.calls.pop(key, None)  # re-inserted as newest
            replies.calls[key] = call_id
            replies.missing.pop(key, None)
        _trim(replies.calls, self._per_rollout)

    def forget(self, rollout_id: UUID) -> None:
        self._index.pop(rollout_id, None)

    def add_missing(self, rollout_id: UUID, keys: list[bytes]) -> None:
        replies = self.get(rollout_id)
        replies.missing.update(dict.fromkeys(k for k in keys if k not in replies.calls))
        _trim(replies.missing, self._per_rollout)


def _trim(d: dict, limit: int) -> None:
    while len(d) > limit:
        del d[next(iter(d))]


class RolloutMemory:
    """The two per-rollout memories, forgotten together when a rollout ends."""

    def __init__(self, recent_bytes: int) -> None:
        self.recent = RecentCalls(recent_bytes)
        self.replies = ReplyIndex()

    def forget(self, rollout_id: UUID) -> None:
        self.recent.forget(rollout_id)
        self.replies.forget(rollout_id)
