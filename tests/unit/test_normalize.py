"""The nonce normalisers (gateway/protocols/normalize.py): given the request body, they skip
only bodies that cannot need them, and they work message by message, which the protocols
that normalise only a conversation's new turns rely on."""

from __future__ import annotations

import json

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from gateway.protocols.normalize import normalize_messages

_BILLING = st.sampled_from([
    "x-anthropic-billing-header: cc_version=2.1.197.abc; cc_entrypoint=cli; cch=0f3a1;",
    "x-anthropic-billing-header:cch=1",
])  # fmt: skip
_text = st.one_of(
    st.text(max_size=30),
    st.builds(lambda a, line, b: f"{a}\n{line}\n{b}", st.text(max_size=10), _BILLING,
              st.text(max_size=10)),  # fmt: skip
    _BILLING,
)
_part = st.fixed_dictionaries({"type": st.just("text"), "text": _text})
_content = st.one_of(_text, st.lists(_part, max_size=2))
_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": _content}
    ),
    max_size=5,
)
_WRITERS = (
    msgspec.json.encode,
    lambda o: json.dumps(o).encode(),
    lambda o: json.dumps(o, indent=1, ensure_ascii=False).encode(),
)


@given(_messages, st.sampled_from(_WRITERS))
def test_the_body_only_spares_the_work_where_nothing_would_change(messages, write):
    before = json.dumps(messages)
    raw = write({"model": "m", "messages": messages})
    out = normalize_messages(messages, raw)
    assert out == normalize_messages(messages)
    assert out is not messages and json.dumps(messages) == before  # a new list, input kept


@given(_messages, _messages)
def test_a_conversation_normalises_as_its_parts(head, tail):
    assert normalize_messages(head + tail) == normalize_messages(head) + normalize_messages(tail)
