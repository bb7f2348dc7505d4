"""The token buckets behind the login throttle (hypothesis): whatever the timing, no client gets
more than its burst plus what the rate refills, and a client that waits as told gets in."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.ratelimit import TokenBuckets


@settings(max_examples=200, deadline=None)
@given(st.floats(0.01, 10), st.integers(1, 20),
       st.lists(st.floats(0, 5, allow_nan=False), min_size=1, max_size=200))
def test_token_buckets_never_allow_more_than_burst_plus_refill(rate, burst, gaps):
    buckets, now, allowed = TokenBuckets(rate=rate, burst=burst), 0.0, 0
    for gap in gaps:
        now += gap
        if buckets.wait("client", now) == 0.0:
            buckets.spend("client", now)
            allowed += 1
    assert allowed <= burst + rate * now + 1e-9
    # and a client that waits as told is let in
    assert buckets.wait("client", now + buckets.wait("client", now) + 1e-9) == 0.0


def test_forgotten_clients_only_get_a_full_bucket_back():
    buckets = TokenBuckets(rate=1, burst=1, max_keys=2)
    for client in ("a", "b", "c"):
        buckets.spend(client, 0.0)
    assert buckets.wait("b", 0.0) > 0 and buckets.wait("c", 0.0) > 0
    assert buckets.wait("a", 0.0) == 0.0  # pushed out: starts afresh
