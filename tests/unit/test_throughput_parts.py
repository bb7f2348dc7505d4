"""Pure parts of the throughput work (issue #42): group quotas of oversampled groups, the phase
pools' limits and queue waits, the ledger of an aborted rollout."""

from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from core.store.ledger import aborted
from sandbox.oversample import GroupQuota, Oversampling
from sandbox.pools import Holder, PhasePools, Pool


@given(keep=st.integers(1, 8), ends=st.lists(st.sampled_from("abc"), max_size=60))
def test_quota_keeps_exactly_the_first_keep_of_each_group(keep, ends):
    quota = GroupQuota(keep)
    kept: dict[str, int] = {}
    for group in ends:
        if quota.take(group):
            kept[group] = kept.get(group, 0) + 1
    for group in set(ends):
        assert kept[group] == min(keep, ends.count(group))
        assert quota.full(group) == (ends.count(group) >= keep)


def test_resumed_quota_counts_members_kept_before():
    quota = GroupQuota(2, kept=["g", "g", "h"])
    assert quota.full("g") and not quota.full("h")
    assert quota.take("h") and not quota.take("h") and not quota.take("g")


def test_oversampling_note_names_the_bias_and_the_flag():
    note = Oversampling(keep=8, extra=2).note()
    assert note["started"] == 10 and note["trains"] == 8
    assert "fastest 8 of 10" in str(note["note"]) and "--oversample 0" in str(note["note"])


@given(limit=st.integers(1, 4), jobs=st.integers(0, 12))
def test_a_pool_never_runs_more_than_its_limit(limit, jobs):
    pool = Pool(limit)
    peak = 0

    async def job():
        nonlocal peak
        async with pool.slot():
            peak = max(peak, pool.busy)
            await asyncio.sleep(0)

    async def main():
        await asyncio.gather(*(job() for _ in range(jobs)))

    asyncio.run(main())
    stats = pool.stats()
    assert peak <= limit and stats.taken == jobs and stats.busy == 0 and stats.waiting == 0


def test_holder_moves_between_pools_and_counts_waits():
    pools = PhasePools(setup=1, agent=1, verify=1)

    async def main():
        first, second = Holder(pools), Holder(pools)
        await first.enter("setup")
        waiting = asyncio.ensure_future(second.enter("setup"))
        await asyncio.sleep(0.05)
        assert pools.pools["setup"].waiting == 1
        await first.enter("agent")  # leaves setup: the second one gets it
        await waiting
        assert pools.pools["agent"].busy == 1 and pools.pools["setup"].busy == 1
        first.leave()
        second.leave()
        return second.waited_s["setup"]

    waited = asyncio.run(main())
    assert waited > 0
    stats = pools.stats()
    assert all(s.busy == 0 for s in stats.values()) and stats["setup"].taken == 2
    assert stats["setup"].max_wait_s == waited


def test_aborted_ledger_trains_nothing_and_says_why():
    ledger = aborted({"trained_tokens": 40, "excluded_by_cause": {"aborted": 7}}, "a straggler")
    assert ledger.trained_tokens == 0
    assert ledger.excluded_tokens["rollout_aborted"] == 40
    assert ledger.excluded_tokens["aborted"] == 7
    assert ledger.reason is not None and ledger.reason.startswith("aborted: a straggler")
    assert "--oversample 0" in ledger.reason


def _tasks(n: int):
    from sandbox.tasks import Task, Verifier

    return [Task(id=f"t{i}", prompt="p", files={}, verifier=Verifier("true", "binary", {}))
            for i in range(n)]


@given(seed=st.integers(0, 2**32))
def test_sampler_draws_the_same_groups_from_the_same_seed(seed):
    from sandbox.continuous import TaskSampler

    def draws():
        sampler = TaskSampler(_tasks(5), 2, seed=seed)
        out = []
        for task, group in sampler:
            out.append((task.id, group))
            if len(out) == 20:
                sampler.stop("enough")
        return out

    first = draws()
    assert first == draws() and [g for _, g in first] == list(range(20))


@given(rewards=st.lists(st.one_of(st.none(), st.sampled_from([0.0, 0.5, 1.0])), max_size=8))
def test_flatness_is_none_exactly_when_scored_rewards_differ(rewards):
    from sandbox.continuous import flatness

    scored = [r for r in rewards if r is not None]
    why = flatness(rewards)
    assert (why is None) == (len(scored) < 2 or len(set(scored)) > 1)
    if why == "all passed":
        assert set(scored) == {1.0}


def test_flat_tasks_are_drawn_less_and_the_skips_counted():
    from sandbox.continuous import TaskSampler

    sampler = TaskSampler(_tasks(2), 2, seed=7, filter_flat=True, window=2, skip_p=0.9)
    for group in range(2):  # t0 passed twice in every member: flat
        for _ in range(2):
            sampler.ended("t0", f"g{group}", 1.0)
    assert sampler.flat("t0") == "all passed" and sampler.flat("t1") is None
    drawn = []
    for task, _ in sampler:
        drawn.append(task.id)
        if len(drawn) == 200:
            sampler.stop("enough")
    assert drawn.count("t0") < 60 < drawn.count("t1")
    assert sampler.skipped["all passed"] > 0
    assert "all passed" in sampler.summary()


def test_run_metrics_name_each_pool_and_how_rollouts_ended():
    from collections import Counter

    from prometheus_client import CollectorRegistry, generate_latest

    from sandbox.engine_busy import running_requests
    from sandbox.run_metrics import RunCollector

    pools = PhasePools(agent=2)
    pools.pools["verify"].note(1.5)
    registry = CollectorRegistry()
    registry.register(RunCollector(pools, None, Counter({"aborted": 3, "finished": 5})))
    text = generate_latest(registry).decode()
    assert 'rolltap_runner_pool_queue_wait_seconds_total{pool="verify"} 1.5' in text
    assert 'rolltap_runner_rollouts_ended_total{status="aborted"} 3.0' in text
    assert "engine_busy" not in text  # no engine sampled
    vllm = ('vllm:num_requests_running{engine="0",model_name="tiny"} 2.0\n'
            'vllm:num_requests_running{engine="1",model_name="tiny"} 1.0\n')
    assert running_requests(vllm) == 3.0 and running_requests("other 1\n") is None
