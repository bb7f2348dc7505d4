"""Pure parts of the viewer, `rolltap inspect` and `rolltap export`: page cursors, session
cookies, filter SQL, terminal escaping and message rows (hypothesis properties)."""

from __future__ import annotations

import datetime as dt
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.store import listing
from gateway.inspect import safe
from gateway.viewer import session
from stack.export import message_row

aware = st.datetimes(timezones=st.just(dt.UTC))


@given(aware, st.uuids())
def test_cursor_round_trips(when, rid):
    cursor = listing.decode_cursor(listing.encode_cursor(when, rid))
    assert (cursor.created_at, cursor.id) == (when, rid)


@given(st.text(max_size=40))
def test_a_garbled_cursor_is_a_value_error(text):
    try:
        listing.decode_cursor(text)
    except ValueError:
        pass


@given(st.text(min_size=1, max_size=64), st.integers(0, 10**9))
def test_session_cookie_opens_only_for_its_key_and_time(key, now):
    cookie = session.issue(key, now=now)
    assert session.valid(cookie, key, now=now)
    assert not session.valid(cookie, key, now=now + session.LIFETIME_S + 1)
    assert not session.valid(cookie, key + "x", now=now)
    expires, mac = cookie.split(".")
    assert not session.valid(f"{int(expires) + 1}.{mac}", key, now=now)
    flipped = mac[:-1] + ("0" if mac[-1] != "0" else "1")
    assert not session.valid(f"{expires}.{flipped}", key, now=now)
    assert not session.valid(cookie, "", now=now)


filters = st.builds(
    listing.Filter,
    task=st.none() | st.text(max_size=8),
    group=st.none() | st.text(max_size=8),
    status=st.none() | st.sampled_from(listing.STATUSES),
    harness=st.none() | st.text(max_size=8),
    min_reward=st.none() | st.floats(-10, 10),
    max_reward=st.none() | st.floats(-10, 10),
    since=st.none() | aware,
)


@given(filters, st.none() | st.tuples(aware, st.uuids()), st.integers(1, 200))
def test_every_placeholder_has_its_argument(f, after, limit):
    cursor = listing.Cursor(*after) if after else None
    sql, args = listing.page_query(f, cursor, limit)
    numbers = sorted({int(n) for n in re.findall(r"\$(\d+)", sql)})
    assert numbers == list(range(1, len(args) + 1))
    given_filters = sum(v is not None for v in (f.task, f.group, f.status, f.harness,
                                                 f.min_reward, f.max_reward, f.since))
    assert sql.count(" AND ") + ("WHERE" in sql) == given_filters + (after is not None)


def test_bad_filters_are_refused():
    with pytest.raises(ValueError, match="status"):
        listing.Filter(status="done")
    with pytest.raises(ValueError, match="not a number"):
        listing.Filter(min_reward=float("nan"))


@given(st.text())
def test_terminal_text_carries_no_control_characters(text):
    shown = safe(text)
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", shown)
    if not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", text):
        assert shown == text


def test_message_rows_keep_text_tool_calls_and_ids():
    row = message_row({"role": "assistant", "content": [{"type": "text", "text": "a"},
                                                        {"type": "text", "text": "b"}],
                       "tool_calls": [{"id": "c1", "type": "function",
                                       "function": {"name": "run", "arguments": {"x": 1}}}]})
    assert row["content"] == "ab"
    assert row["tool_calls"] == [{"id": "c1", "type": "function",
                                  "function": {"name": "run", "arguments": '{"x": 1}'}}]
    tool = message_row({"role": "tool", "tool_call_id": "c1", "content": "ok"})
    assert (tool["tool_call_id"], tool["content"], tool["tool_calls"]) == ("c1", "ok", None)

