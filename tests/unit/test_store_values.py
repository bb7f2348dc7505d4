"""What Postgres will store: the edge checks of core.store.values (issue 11, item 7)."""

import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from core.store.values import MAX_DEPTH, clean_text, problem, storable

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=20,
)


def _storable_by_postgres(value, depth=0) -> bool:
    """The rules, spelled out plainly: no NUL anywhere, 64-bit integers, finite numbers."""
    if depth > MAX_DEPTH:
        return False
    if isinstance(value, str):
        return "\x00" not in value
    if isinstance(value, bool) or value is None:
        return True
    if isinstance(value, int):
        return -(2**63) <= value < 2**63
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all("\x00" not in k and _storable_by_postgres(v, depth + 1)
                   for k, v in value.items())
    return all(_storable_by_postgres(v, depth + 1) for v in value)


@settings(max_examples=500)
@given(JSON)
def test_problem_names_exactly_what_postgres_refuses(value):
    found = problem(value, "field")
    assert (found is None) == _storable_by_postgres(value)
    if found is not None:
        assert found.startswith("field")
    else:
        json.dumps(value, allow_nan=False)  # jsonb takes it


SURROGATES = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1,
                     max_size=2)
WILD = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6) | SURROGATES,
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=4) | SURROGATES, inner, max_size=3),
    max_leaves=20,
)


def _deep(depth):
    value = []
    for _ in range(depth):
        value = [value]
    return value


@settings(max_examples=500)
@given(st.one_of(WILD, st.integers(MAX_DEPTH - 2, 3 * MAX_DEPTH).map(_deep)))
def test_storable_makes_anything_storable_and_counts_what_it_changed(value):
    cleaned, changed = storable(value)
    text = json.dumps(cleaned, allow_nan=False, ensure_ascii=False)
    text.encode("utf-8")  # no lone surrogate
    assert "\x00" not in text and "\\u0000" not in text
    assert problem(cleaned) is None or "64 bits" in problem(cleaned)
    if changed == 0:
        assert json.dumps(value, ensure_ascii=False) == text
    else:
        assert json.dumps(value, ensure_ascii=False) != text


def test_depth_and_text():
    deep = []
    for _ in range(MAX_DEPTH + 2):
        deep = [deep]
    assert "deeper" in problem({"m": deep}, "metrics")
    assert clean_text("a\x00b") == "a\ufffdb" and clean_text(None) is None
    assert clean_text("a\ud800b\x00") == "a\ufffdb\ufffd"
    assert storable({"k\x00": ["\udfff", float("inf")]}) == ({"k\ufffd": ["\ufffd", None]}, 3)
    assert storable([10**5000]) == ([None], 1)  # beyond what Python writes as decimal
