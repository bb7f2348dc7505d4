"""Bounded output capture keeps exactly the head and the tail, whatever the chunking."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sandbox.capture import BoundedBuffer


@given(st.lists(st.binary(max_size=300), max_size=40), st.integers(min_value=0, max_value=500))
def test_keeps_head_and_tail(chunks, limit):
    buf = BoundedBuffer(limit)
    for chunk in chunks:
        buf.feed(chunk)
    data = b"".join(chunks)
    assert buf.total == len(data)
    head, tail = limit // 2, limit - limit // 2
    if len(data) <= limit:
        assert buf.kept == data and not buf.truncated
    else:
        assert buf.kept == data[:head] + (data[-tail:] if tail else b"")
        assert buf.omitted == len(data) - limit and buf.truncated
    # Memory stays bounded by twice the limit, however much went through.
    assert len(buf.head) + len(buf.tail) <= 2 * limit + 300


@given(st.lists(st.text(max_size=50), max_size=30), st.integers(min_value=2, max_value=200))
def test_text_notes_truncation(parts, limit):
    buf = BoundedBuffer(limit)
    for part in parts:
        buf.feed(part.encode())
    text = buf.text()
    assert ("bytes omitted" in text) == buf.truncated
    if not buf.truncated:
        assert text == "".join(parts)
