"""What Postgres will store: the edge checks of core.store.values (issue 11, item 7)."""

import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from core.store.values import MAX_DEPTH, clean_text, problem, without_nul

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


@settings(max_examples=300)
@given(JSON)
def test_without_nul_removes_and_counts_every_nul(value):
    cleaned, removed = without_nul(value)
    assert "\x00" not in json.dumps(cleaned)
    assert removed == json.dumps(value).count("\\u0000")
    if not removed:
        assert cleaned == value or value != value  # NaN is not equal to itself


def test_depth_and_text():
    deep = []
    for _ in range(MAX_DEPTH + 2):
        deep = [deep]
    assert "deeper" in problem({"m": deep}, "metrics")
    assert clean_text("a\x00b") == "a\ufffdb" and clean_text(None) is None
