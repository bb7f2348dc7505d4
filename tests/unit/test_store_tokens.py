"""core.store.tokens: the order stored chains are resolved in, one call's ids rebuilt from
its chain, and the recent-calls index, bounded by bytes and exact in what it keeps."""

from __future__ import annotations

import json
import uuid

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.store.tokens import (
    StoredTokens,
    chain_ids,
    parents_first,
    reconstruct_prompts,
)
from gateway import engine_ids
from gateway.continuation.keys import RequestKeys
from gateway.protocols.normalize import normalize_messages
from gateway.protocols.resumable import Decoder
from gateway.rollout_memory import RecentCall, RecentCalls


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10**6), max_size=40), st.data())
def test_parents_come_first_whatever_the_order(order, data):
    # A forest: each call's parent is an earlier one (as bases are), listed in any order.
    calls = list(range(len(order)))
    parent_of = {c: (data.draw(st.sampled_from([None, *calls[:c]])) if c else None) for c in calls}
    shuffled = dict(sorted(parent_of.items(), key=lambda kv: order[kv[0]]))
    resolved = parents_first(shuffled)
    assert sorted(resolved) == calls
    position = {c: i for i, c in enumerate(resolved)}
    assert all(p is None or position[p] < position[c] for c, p in parent_of.items())


def _row(call_id, base_id, prefix_len, delta, completion) -> StoredTokens:
    raw = lambda a: np.asarray(a, dtype="<i4").tobytes()  # noqa: E731
    return StoredTokens(call_id, base_id, prefix_len, raw(delta), raw(completion))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_one_calls_ids_from_its_chain_are_the_reconstructed_ones(data):
    # A forest of stored calls: each cuts an earlier call's ids anywhere (even past their end,
    # as a corrupt row might) and adds its own; the rows come in any order.
    n = data.draw(st.integers(1, 12))
    calls = [uuid.UUID(int=i + 1) for i in range(n)]
    tokens = st.lists(st.integers(0, 99), max_size=6)
    rows = []
    for i, call in enumerate(calls):
        base = data.draw(st.sampled_from([None, *calls[:i]]))
        cut = data.draw(st.integers(0, 40)) if base is not None else 0
        rows.append(_row(call, base, cut, data.draw(tokens), data.draw(tokens)))
    rows = data.draw(st.permutations(rows))
    prompts = reconstruct_prompts(rows)
    for row in rows:
        expected = np.concatenate((prompts[row.id], row.completion_ids))
        assert chain_ids(rows, row.id).tolist() == expected.tolist()


def test_a_chain_of_bases_that_loops_is_refused():
    a, b = uuid.UUID(int=1), uuid.UUID(int=2)
    rows = [_row(a, b, 1, [1], [2]), _row(b, a, 1, [3], [4])]
    with pytest.raises(ValueError, match="loops"):
        chain_ids(rows, a)


def ids(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int32)


def kept_bytes(recent: RecentCalls) -> int:
    return sum(c.nbytes for r in recent.rollouts() for c in recent.entries(r))


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 20_000),
    st.lists(
        st.tuples(st.integers(0, 5), st.integers(0, 2000), st.binary(max_size=3000),
                  st.booleans()),
        max_size=60,
    ),
)
def test_never_above_the_bound_and_counts_what_it_keeps(max_bytes, calls):
    recent = RecentCalls(max_bytes, per_rollout=3, heavy=2)
    for n, (rollout, size, body, forget) in enumerate(calls):
        if forget:
            recent.forget(rollout)
        else:
            recent.add(rollout, n, ids(size), body=body, reply=body[:10])
        assert recent.nbytes == kept_bytes(recent) <= max_bytes
        for r in recent.rollouts():
            entries = recent.entries(r)
            assert len(entries) <= 3
            assert all(c.body is None and not c.reply for c in entries[:-2])


def test_least_recently_used_rollouts_go_first():
    one = RecentCall(0, ids(1000)).nbytes
    recent = RecentCalls(3 * one)
    for rollout in "abc":
        recent.add(rollout, 0, ids(1000))
    recent.get("a")  # used: now the newest
    recent.add("d", 0, ids(1000))
    assert recent.get("b") is None
    assert [r for r in "acd" if recent.get(r)] == ["a", "c", "d"]
    assert recent.find("a", 0).full.size == 1000 and recent.find("a", 1) is None


def test_a_zero_bound_keeps_nothing():
    recent = RecentCalls(0)
    recent.add("a", 0, ids(10), body=b"{}")
    recent.load("b", [(1, ids(10))])
    assert recent.get("a") is None and recent.get("b") is None and recent.nbytes == 0


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_calls_that_extend_the_newest_share_its_array_and_keep_their_ids(data):
    recent = RecentCalls(1 << 30, per_rollout=4, heavy=2)
    added: dict[int, list[int]] = {}
    newest: list[int] = []
    pieces: engine_ids.Pieces = ()
    for n in range(data.draw(st.integers(1, 14))):
        # A conversation going on (the newest call's ids and more), or a fork from anywhere;
        # its ids' JSON written on from the newest's pieces, or anew.
        going_on = data.draw(st.booleans())
        start = newest if going_on else newest[: data.draw(st.integers(0, 9))]
        more = data.draw(st.lists(st.integers(0, 9), max_size=5))
        newest = start + more
        if going_on and data.draw(st.booleans()):
            pieces = engine_ids.extend(pieces, json.dumps(more).encode())
        else:
            pieces = (json.dumps(newest).encode(),)
        added[n] = newest
        # Said to continue the newest call (then its ids are not compared), when it does.
        supersedes = n - 1 if going_on and n and data.draw(st.booleans()) else None
        recent.add(
            "r", n, np.asarray(newest, dtype=np.int32), full_json=pieces, supersedes=supersedes
        )
        entries = recent.entries("r")
        assert all(c.full.tolist() == added[c.id] for c in entries)
        assert all(
            json.loads(engine_ids.concat(c.full_json)) == added[c.id]
            for c in entries
            if c.full_json is not None
        )
        assert recent.nbytes == kept_bytes(recent)
        # What the arrays and JSON pieces really hold is no more than what is counted for them.
        owners = {id(c.full if c.full.base is None else c.full.base): c.full for c in entries}
        held = sum((a if a.base is None else a.base).nbytes for a in owners.values())
        assert held <= sum(c.full.nbytes for c in entries if not c.shared)
        texts = {id(p): len(p) for c in entries for p in c.full_json or ()}
        counted = sum(sum(map(len, c.full_json or ())) for c in entries if not c.shared)
        assert sum(texts.values()) <= counted


def test_a_continued_call_drops_its_body_and_keys_to_the_call_continuing_it():
    recent = RecentCalls(1 << 30, per_rollout=8, heavy=4)
    recent.add("r", 0, ids(10), keys=None, body=b"a" * 100, reply=b"r", full_json=(b"[0]",))
    recent.add("r", 1, ids(5), body=b"b" * 100)  # a side call: continues nothing
    recent.add("r", 2, ids(20), body=b"c" * 100, supersedes=0)
    first, side, newest = recent.entries("r")
    assert first.body is None and not first.reply and first.full_json is None
    assert side.body == b"b" * 100 and newest.body == b"c" * 100
    assert recent.nbytes == kept_bytes(recent)


def test_a_conversation_keeps_one_array_for_all_its_calls():
    recent = RecentCalls(1 << 30)
    for n in range(5):
        recent.add("r", n, ids(1000 * (n + 1)))
    entries = recent.entries("r")
    assert [c.shared for c in entries] == [True] * 4 + [False]
    assert all(c.full.base is entries[-1].full for c in entries[:-1])
    assert recent.nbytes == 5 * RecentCall(0, ids(0)).nbytes + 5000 * 4


def test_a_layout_counts_its_body_once_and_items_the_keys_do_not_hold():
    raw = msgspec.json.encode({"messages": [{"role": "user", "content": "x" * 1000}]})
    _, layout = Decoder("messages", min_bytes=0).decode(raw)
    keys = RequestKeys({"messages": normalize_messages(layout.items)})
    bare = RecentCall(0, ids(10), keys, body=raw).nbytes
    # Chat: the body is the layout's, the items the keys' messages: only the offsets more.
    assert RecentCall(0, ids(10), keys, body=raw, request=layout).nbytes == bare + 8
    # A translating protocol keeps other messages in its keys: its items count too.
    other = RequestKeys({"messages": [dict(m) for m in layout.items]})
    assert RecentCall(0, ids(10), other, body=raw, request=layout).nbytes == (
        RecentCall(0, ids(10), other, body=raw).nbytes + 8 + len(raw)
    )
    # Bodies not recorded: the layout's body counts in its place.
    assert RecentCall(0, ids(10), keys, request=layout).nbytes == bare + 8


@pytest.mark.parametrize("output_lines", [2, 60], ids=["short-messages", "long-tool-outputs"])
def test_the_index_counts_about_the_memory_it_holds(output_lines):
    # Its bound is in bytes: what it counts must be what the calls it keeps hold in memory
    # (ids, their JSON, bodies, decoded messages, keys, layouts), fed as the relay feeds it.
    import gc
    import tracemalloc

    from gateway.protocols import chat

    def body(rollout: int, turns: int) -> bytes:
        messages = [{"role": "user", "content": f"task {rollout} " * 3000}]
        for k in range(turns):
            call = {"id": f"c{k}", "type": "function",
                    "function": {"name": "run", "arguments": f'{{"n": {k}}}'}}  # fmt: skip
            messages += [
                {"role": "assistant", "content": f"step {k}", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": f"c{k}", "content": f"line {k}\n" * output_lines},
            ]
        return msgspec.json.encode({"model": "m", "messages": messages})

    recent = RecentCalls()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for r in range(8):
            full = ids(8000)
            for c in range(6):
                raw = body(r, 100 + c)
                calls = recent.entries(r) or []
                decoded, layout = chat.parse(raw, [e.request for e in calls[::-1] if e.request])
                keys = RequestKeys(
                    {"messages": normalize_messages(decoded["messages"], raw)},
                    [e.keys for e in calls[::-1] if e.keys is not None],
                )
                full = np.concatenate((full, ids(50)))
                pieces = (msgspec.json.encode(full.tolist()),)
                recent.add(r, c, full, keys, body=raw, full_json=pieces,
                           supersedes=c - 1 if c else None, request=layout.kept())  # fmt: skip
        del decoded, layout, keys, calls, full, raw, pieces
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0.75 <= held / recent.nbytes <= 1.33
