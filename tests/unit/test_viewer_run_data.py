"""The run page's series: groups' rewards, tokens by cause over time, staleness (from store
rows), and the history of the gateway's run gauges (from a Prometheus registry)."""

from __future__ import annotations

import datetime as dt

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from core.store.ledger import CAUSES
from gateway.viewer import run_data
from gateway.viewer.metric_history import MetricHistory

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def _at(s: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=s)


@st.composite
def rollout_rows(draw) -> dict:
    status = draw(st.sampled_from(["running", "finished", "failed", "timeout"]))
    ended = status != "running"
    finished = draw(st.floats(0, 1000)) if ended else None
    merged = ended and draw(st.booleans())
    consumed = merged and draw(st.booleans())
    excluded = draw(st.dictionaries(st.sampled_from(CAUSES), st.integers(0, 50), max_size=3))
    trained = draw(st.integers(0, 100))
    return {
        "id": draw(st.uuids()),
        "task_id": draw(st.sampled_from(["a", "b", None])),
        "group_id": draw(st.sampled_from(["g1", "g2", "g3", None])),
        "status": status,
        "reward": draw(st.none() | st.floats(0, 1)) if ended else None,
        "finished_at": _at(finished) if finished is not None else None,
        "merged_at": _at(finished + 1) if merged and finished is not None else None,
        "consumed_at": _at(finished + 5) if consumed and finished is not None else None,
        "merge_stats": {"trained_tokens": trained, "excluded_by_cause": excluded}
        if merged else None,
        "ledger": {"trained_tokens": trained, "excluded_tokens": excluded} if consumed else None,
    }


@given(st.lists(rollout_rows(), max_size=30))
def test_a_group_shows_once_all_its_members_ended(rows):
    points = run_data.groups(rows)
    ended = {r["group_id"] for r in rows if r["group_id"]} - {
        r["group_id"] for r in rows if r["status"] == "running"}
    assert sorted(p["group"] for p in points) == sorted(ended)
    assert [p["t"] for p in points] == sorted(p["t"] for p in points)
    for p in points:
        rewards = [r["reward"] for r in rows
                   if r["group_id"] == p["group"] and r["reward"] is not None]
        assert p["scored"] == len(rewards)
        assert p["reward"] == (sum(rewards) / len(rewards) if rewards else None)


@given(st.lists(rollout_rows(), max_size=30))
def test_token_totals_add_up_and_move_from_waiting_to_trained(rows):
    view = run_data.tokens(rows)
    columns, out = view["columns"], view["rows"]
    expected: dict[str, int] = {}
    for r in rows:
        if r["ledger"]:
            expected["trained"] = expected.get("trained", 0) + r["ledger"]["trained_tokens"]
            counts = r["ledger"]["excluded_tokens"]
        elif r["merge_stats"]:
            expected[run_data.WAITING] = (expected.get(run_data.WAITING, 0)
                                          + r["merge_stats"]["trained_tokens"])
            counts = r["merge_stats"]["excluded_by_cause"]
        else:
            continue
        for c, n in counts.items():
            expected[c] = expected.get(c, 0) + n
    assert {c for c, n in expected.items() if n} <= set(columns)
    if out:
        final = dict(zip(columns, out[-1][1:], strict=True))
        assert {c: n for c, n in final.items() if n} == {c: n for c, n in expected.items() if n}
    for before, after in zip(out, out[1:], strict=False):
        assert after[0] >= before[0]
        grew = [a >= b for c, a, b in zip(columns, after[1:], before[1:], strict=True)
                if c != run_data.WAITING]
        assert all(grew)  # tokens awaiting a trainer come and go; the others only add up


def test_staleness_is_the_wait_from_end_to_trainer():
    rows = [{"consumed_at": _at(20), "finished_at": _at(12)},
            {"consumed_at": None, "finished_at": _at(3)},
            {"consumed_at": _at(10), "finished_at": _at(9.5)}]
    assert run_data.staleness(rows) == [[_at(10).timestamp(), 0.5], [_at(20).timestamp(), 8.0]]


def _sample(history: MetricHistory, now: float) -> None:
    history.sample(now, history.registry.collect())


def _registry() -> tuple[CollectorRegistry, Gauge, Histogram]:
    r = CollectorRegistry()
    idle = Gauge("rolltap_trainer_idle_fraction", "idle", registry=r)
    wait = Histogram("rolltap_pool_queue_wait_seconds", "wait", ["pool"], registry=r)
    Gauge("rolltap_unwatched", "not plotted", registry=r).set(7)
    return r, idle, wait


def test_history_keeps_gauges_and_histogram_means_per_interval():
    registry, idle, wait = _registry()
    history = MetricHistory(registry)
    idle.set(0.5)
    wait.labels("agent").observe(2.0)
    wait.labels("agent").observe(4.0)
    _sample(history, 1.0)
    idle.set(0.25)
    wait.labels("agent").observe(10.0)
    _sample(history, 2.0)
    _sample(history, 3.0)  # no new wait observed: no mean for this interval
    series = history.series()
    assert series["rolltap_trainer_idle_fraction"] == [[1.0, 0.5], [2.0, 0.25], [3.0, 0.25]]
    assert series['rolltap_pool_queue_wait_seconds{pool="agent"} mean'] == [[1.0, 3.0],
                                                                             [2.0, 10.0]]
    assert not any(k.startswith("rolltap_unwatched") for k in series)


@given(st.integers(2, 40), st.integers(1, 200))
def test_a_full_history_thins_out_and_keeps_the_newest(max_samples, n):
    registry, idle, _ = _registry()
    history = MetricHistory(registry, max_samples=max_samples)
    for t in range(n):
        idle.set(t)
        _sample(history, float(t))
    points = history.series()["rolltap_trainer_idle_fraction"]
    assert len(points) <= max_samples
    assert points[-1] == [n - 1, n - 1]
    assert points == sorted(points)


def test_another_process_counters_become_rates():
    """The runner's /metrics, as its exposition text reaches the gateway: a counter of seconds
    spent queued becomes seconds queued per second (the mean queue length)."""
    runner = CollectorRegistry()
    waited = Counter("rolltap_runner_pool_queue_wait_seconds", "queued", ["pool"],
                     registry=runner)
    history = MetricHistory(CollectorRegistry())

    def scrape(now: float) -> None:
        history.sample(now, text_string_to_metric_families(generate_latest(runner).decode()))

    waited.labels("verify").inc(1.0)
    scrape(10.0)
    waited.labels("verify").inc(6.0)
    scrape(12.0)
    series = history.series()
    assert series == {'rolltap_runner_pool_queue_wait_seconds{pool="verify"} per s': [[12.0, 3.0]]}
