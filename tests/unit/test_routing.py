"""Rendezvous placement and replica health: pure functions, property tests."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.protocols.errors import GatewayError
from gateway.routing import Health, place, replica_seed
from gateway.upstream import Upstreams

urls = st.lists(
    st.integers(1, 65535).map(lambda p: f"http://10.0.0.{p % 250}:{p}"), min_size=2,
    max_size=12, unique=True,
)


def _seeds(us: list[str]) -> np.ndarray:
    return np.array([replica_seed(u) for u in us], dtype=np.uint64)


def _placements(us: list[str], keys: list[int]) -> list[str]:
    seeds = _seeds(us)
    return [us[place(k, seeds)] for k in keys]


_rng = np.random.default_rng(11)
KEYS = [int.from_bytes(_rng.bytes(16), "little") for _ in range(3000)]


@settings(max_examples=30, deadline=None)
@given(urls, st.data())
def test_removing_a_replica_moves_only_its_own_rollouts(us, data):
    gone = data.draw(st.sampled_from(us))
    before = _placements(us, KEYS)
    after = _placements([u for u in us if u != gone], KEYS)
    for b, a in zip(before, after):
        if b != gone:
            assert a == b


@settings(max_examples=30, deadline=None)
@given(urls, st.integers(1, 65535))
def test_adding_a_replica_moves_about_one_nth_and_only_onto_it(us, port):
    new = f"http://10.9.9.9:{port}"
    before = _placements(us, KEYS)
    after = _placements([*us, new], KEYS)
    moved = [a for b, a in zip(before, after) if a != b]
    assert all(a == new for a in moved)
    share = 1 / (len(us) + 1)
    # 3000 keys: the binomial's standard deviation is under 0.01; allow a wide margin.
    assert abs(len(moved) / len(KEYS) - share) < 0.04


def test_adding_a_third_replica_moves_about_a_third():
    two = ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    before = _placements(two, KEYS)
    after = _placements([*two, "http://127.0.0.1:8003"], KEYS)
    moved = sum(a != b for a, b in zip(before, after)) / len(KEYS)
    assert 0.29 < moved < 0.38, moved


@settings(max_examples=30, deadline=None)
@given(urls)
def test_placement_is_balanced_and_ignores_list_order(us):
    counts = {u: 0 for u in us}
    for u in _placements(us, KEYS):
        counts[u] += 1
    expected = len(KEYS) / len(us)
    assert all(abs(c - expected) < 0.35 * expected for c in counts.values()), counts
    assert _placements(list(reversed(us)), KEYS[:200]) == _placements(us, KEYS[:200])


@given(urls, st.lists(st.booleans(), min_size=12, max_size=12), st.integers(0, 2**128 - 1))
def test_ineligible_replicas_are_never_chosen(us, mask, key):
    eligible = np.array(mask[: len(us)], dtype=bool)
    i = place(key, _seeds(us), eligible)
    if eligible.any():
        assert eligible[i]
        # The best eligible replica: the same one a list of only the eligible ones picks.
        only = [u for u, ok in zip(us, eligible) if ok]
        assert us[i] == only[place(key, _seeds(only))]
    else:
        assert i == -1


@given(st.lists(st.sampled_from("fs"), max_size=40), st.integers(1, 5))
def test_health_ejects_after_k_consecutive_failures_and_returns_on_success(events, k):
    h = Health(eject_after=k)
    run = 0
    for t, e in enumerate(events):
        if e == "f":
            run += 1
            h.failure(float(t), "x")
        else:
            run = 0
            h.success(float(t))
        assert h.ejected == (run >= k)


@given(st.lists(st.tuples(st.sampled_from("fs"), st.sampled_from(["probe", "r1", "r2", "r3"])),
                max_size=60), st.integers(1, 4))
def test_one_rollout_alone_never_ejects_a_replica(events, k):
    """Issue #28, attack 10: in a run of failures, each rollout's calls count once and each
    probe counts; so a replica is ejected only when k sources (probes, or distinct rollouts)
    failed on it since it last worked."""
    h = Health(eject_after=k)
    probes, rollouts = 0, set()
    for t, (e, source) in enumerate(events):
        if e == "f":
            if source == "probe":
                probes += 1
            else:
                rollouts.add(source)
            h.failure(float(t), "x", None if source == "probe" else source)
        else:
            probes, rollouts = 0, set()
            h.success(float(t))
        assert h.ejected == (probes + len(rollouts) >= k)
    one = Health(eject_after=2)
    for t in range(100):
        one.failure(float(t), "its own long calls", "the same rollout")
    assert not one.ejected


def test_a_placed_rollout_stays_unless_its_replica_is_unavailable():
    ups = Upstreams(["http://a:1", "http://b:2"], 10)
    rid = uuid.uuid4()
    home, why = ups.route(rid, None)
    assert why is None
    other = next(u for u in ups.urls if u != home)
    ups.add("http://c:3")  # a new replica does not take placed rollouts
    assert ups.route(rid, home) == (home, None)
    for _ in range(3):
        ups.failed(home, "connect refused")
    moved, why = ups.route(rid, home)
    assert moved != home and "ejected" in why and "connect refused" in why
    ups.succeeded(home)  # back: new rollouts reach it again, the moved one stays put
    assert ups.route(rid, moved) == (moved, None)
    assert ups.replicas[home].available
    ups.drain(other)
    assert all(ups.route(uuid.uuid4(), None)[0] != other for _ in range(50))
    ups.remove("http://c:3")
    assert "removed" in ups.route(rid, "http://c:3")[1]


def test_with_every_replica_ejected_calls_still_go_somewhere_but_never_to_a_draining_one():
    ups = Upstreams(["http://a:1", "http://b:2"], 10, eject_after=1)
    rid = uuid.uuid4()
    home, _ = ups.route(rid, None)
    for url in ups.urls:
        ups.failed(url, "probe timed out")
    assert ups.route(rid, home) == (home, None)  # no better place: it stays
    ups.drain("http://b:2")
    assert all(ups.route(uuid.uuid4(), None)[0] == "http://a:1" for _ in range(20))
    ups.drain("http://a:1")
    with pytest.raises(GatewayError) as info:
        ups.route(uuid.uuid4(), None)
    assert info.value.status == 503 and "draining" in info.value.message


def test_new_rollouts_avoid_a_replica_at_its_in_flight_cap_while_another_has_room():
    ups = Upstreams(["http://a:1", "http://b:2"], 10, replica_max_inflight=1)
    rids = [uuid.uuid4() for _ in range(40)]
    on_a = [r for r in rids if ups.route(r, None)[0] == "http://a:1"]
    assert on_a and len(on_a) < 40
    ups.begin("http://a:1")  # a is at its cap now
    assert all(ups.route(uuid.uuid4(), None)[0] == "http://b:2" for _ in range(20))
    assert ups.route(on_a[0], "http://a:1") == ("http://a:1", None)  # placed ones stay
    ups.begin("http://b:2")  # both full: placement falls back to plain rendezvous
    assert {ups.route(r, None)[0] for r in rids} == {"http://a:1", "http://b:2"}
    ups.end("http://a:1")
    assert ups.replicas["http://a:1"].in_flight == 0
