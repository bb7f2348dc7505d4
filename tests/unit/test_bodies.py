"""Request bodies stored as deltas (core.store.bodies): every body comes back byte for byte."""

from __future__ import annotations

import json
import random
import uuid

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.byte_ends import shared_ends
from core.store import bodies

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"]),
                           "content": st.text(max_size=40) | json_values}),
    max_size=6,
)


@st.composite
def parent_and_child(draw):
    """A request body and the next one of its conversation as harnesses make it: messages
    added, and maybe an earlier message changed, a top-level field changed, added or removed,
    another encoding; or any JSON value at all."""
    parent = {"model": "m", "messages": draw(messages), "tools": draw(json_values),
              "stream": draw(st.booleans())}
    child = {**parent, "messages": [*parent["messages"], *draw(messages)]}
    if child["messages"] and draw(st.booleans()):
        i = draw(st.integers(0, len(child["messages"]) - 1))
        child["messages"][i] = {**child["messages"][i], "cache_control": {"type": "ephemeral"}}
    for key in draw(st.lists(st.sampled_from(["model", "tools", "stream", "max_tokens"]))):
        if draw(st.booleans()):
            child.pop(key, None)
        else:
            child[key] = draw(json_values)
    if draw(st.booleans()):
        child = draw(json_values)

    def encode(value) -> bytes:
        style = draw(st.sampled_from(["compact", "spaced", "msgspec"]))
        if style == "msgspec":
            return msgspec.json.encode(value)
        sep = (",", ":") if style == "compact" else (", ", ": ")
        return json.dumps(value, separators=sep, ensure_ascii=draw(st.booleans())).encode()

    return encode(parent), encode(child)


@settings(max_examples=300, deadline=None)
@given(parent_and_child(), json_values)
def test_delta_applies_to_the_same_bytes(pair, reply):
    parent, child = pair
    summary = msgspec.json.encode({"message": reply})
    assert bodies.apply(parent, bodies.delta(parent, child, summary), summary) == child


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=300), st.binary(max_size=100))
def test_any_bytes_round_trip(parent, child, reply):
    assert bodies.apply(parent, bodies.delta(parent, child)) == child
    assert bodies.apply(parent, bodies.delta(parent, child, reply), reply) == child
    assert bodies.unwhole(bodies.whole(child)) == child


def test_the_parents_reply_sent_back_costs_a_reference():
    rng = random.Random(2)
    history = [{"role": "user", "content": rng.randbytes(800).hex()}]
    reply = {"role": "assistant", "content": rng.randbytes(2000).hex()}
    parent = msgspec.json.encode({"messages": history})
    child = msgspec.json.encode({"messages": [*history, reply, {"role": "user", "content": "ok"}]})
    summary = msgspec.json.encode({"message": reply, "finish_reason": "stop"})
    stored = bodies.delta(parent, child, summary)
    assert bodies.apply(parent, stored, summary) == child
    assert len(stored) < 100 < len(bodies.delta(parent, child)) / 10


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=200), st.binary(max_size=50), st.binary(max_size=50))
def test_shared_ends_do_not_overlap(middle, head, tail):
    # A child that is the parent's own head and tail (overlapping ends) still comes back.
    parent = head + middle + tail
    child = head + tail
    assert bodies.apply(parent, bodies.delta(parent, child)) == child
    assert bodies.apply(child, bodies.delta(child, parent)) == parent


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=60), st.binary(max_size=60), st.binary(max_size=3))
def test_shared_ends_are_the_longest(a, b, common):
    # The halving search finds exactly the longest common prefix and (disjoint) suffix.
    a, b = common + a + common, common + b + common
    pre = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    rest = min(len(a), len(b)) - pre
    suf = next((i for i in range(rest) if a[-1 - i] != b[-1 - i]), rest)
    assert shared_ends(a, b) == (pre, suf)
    for known in range(pre + 1):  # a prefix known to be shared changes nothing
        assert shared_ends(a, b, known) == (pre, suf)


def test_a_delta_stores_only_what_the_child_adds():
    # Random text: what zstd alone could not shrink much.
    rng = random.Random(0)
    history = [{"role": "user", "content": rng.randbytes(800).hex()} for _ in range(50)]
    parent = msgspec.json.encode({"model": "m", "messages": history, "stream": True})
    new = {"role": "assistant", "content": "a short answer"}
    child = msgspec.json.encode({"model": "m", "messages": [*history, new], "stream": True})
    stored = bodies.delta(parent, child)
    assert len(stored) < 100 < len(bodies.whole(child))
    # An edited system prompt at the very front: the middle is nearly all, the parent's middle
    # (its dictionary) still saves most of it.
    edited = msgspec.json.encode({"model": "m", "messages": [{"role": "system", "content": "x"},
                                                              *history, new], "stream": True})
    assert len(bodies.delta(parent, edited)) < len(bodies.whole(edited)) / 5


def test_large_bodies_beyond_the_default_window():
    # Multi-megabyte conversations: matches reach far back into the dictionary.
    rng = random.Random(1)
    history = [{"role": "tool", "content": rng.randbytes(6000).hex()} for _ in range(700)]
    parent = msgspec.json.encode({"messages": history})
    child = msgspec.json.encode({"messages": [{"role": "system", "content": "now"}, *history]})
    assert len(parent) > 8 << 20
    stored = bodies.delta(parent, child)
    assert bodies.apply(parent, stored) == child
    assert len(stored) < len(bodies.whole(child)) / 5


def test_reconstruct_resolves_chains_in_any_order():
    a, b, c, d = (uuid.uuid4() for _ in range(4))
    raw = {a: b'{"messages":[1]}', b: b'{"messages":[1,"two",2]}', c: b'{"messages":[1,2,3]}'}
    reply = b'{"message":"two"}'
    rows = [
        bodies.StoredBody(c, b, bodies.delta(raw[b], raw[c]), None),
        bodies.StoredBody(a, None, bodies.whole(raw[a]), bodies.whole(reply)),
        bodies.StoredBody(d, None, None, None),
        bodies.StoredBody(b, a, bodies.delta(raw[a], raw[b], reply), None),
    ]
    assert bodies.reconstruct(rows) == {**raw, d: None}
    with pytest.raises(ValueError, match="has no body"):
        bodies.reconstruct([bodies.StoredBody(a, None, None, None),
                            bodies.StoredBody(b, a, bodies.delta(raw[a], raw[b]), None)])
