"""The pipeline's small parts that need no engine: the one walk of a previous_response_id chain
(live calls and export read it alike), and the per-stage CPU clock the bench reads."""

from __future__ import annotations

import asyncio
import time
import uuid

from gateway import response_chain
from gateway.metrics import Metrics
from gateway.stage_cpu import ACCOUNT, STAGES, StageCpu

STATES = {
    "r3": {"items": ["e", "f"], "previous_response_id": "r2"},
    "r2": {"items": ["c", "d"], "previous_response_id": "r1"},
    "r1": {"items": ["a", "b"]},
}


def test_a_chain_is_walked_to_its_start_the_same_with_or_without_waiting():
    async def lookup(response_id):
        await asyncio.sleep(0)
        return STATES.get(response_id)

    for start, expected in (("r3", list("abcdef")), ("r1", ["a", "b"]), ("nope", None)):
        assert response_chain.items(start, STATES.get) == expected
        assert asyncio.run(response_chain.items_async(start, lookup)) == expected


def test_a_chain_with_a_missing_link_keeps_what_was_found():
    broken = {"r3": STATES["r3"]}  # r2 is not this rollout's
    assert response_chain.items("r3", broken.get) == ["e", "f"]
    assert response_chain.items(None, broken.get) is None


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_the_clock_charges_work_to_its_stage_and_waiting_to_nobody():
    cpu = StageCpu(on=True)

    async def call():
        clock = cpu.clock()
        _spin(0.02)
        clock.lap("parse")
        await clock.wait("plan", asyncio.sleep(0.2))  # a wait costs no CPU of this call
        _spin(0.01)
        clock.lap("respond")

    asyncio.run(call())
    assert cpu.calls == 1
    assert cpu.ns["parse"] >= 20_000_000
    assert cpu.ns["plan"] < 10_000_000
    assert 10_000_000 <= cpu.ns["respond"] < 100_000_000


def test_metered_the_clock_charges_the_work_inside_an_await_and_not_other_tasks():
    cpu = StageCpu()
    other_done = asyncio.Event()

    async def engine_send():
        _spin(0.03)  # the call's own work inside an awaited coroutine
        await asyncio.sleep(0)
        _spin(0.03)
        await other_done.wait()

    async def other():
        _spin(0.1)  # another task's work while the call waits
        other_done.set()

    async def call():
        clock = cpu.clock()
        await clock.wait("engine", engine_send())
        clock.lap("respond")

    async def main():
        cpu.meter_tasks(asyncio.get_running_loop())
        await asyncio.gather(asyncio.create_task(call()), asyncio.create_task(other()))

    asyncio.run(main())
    parts = cpu.account()
    assert 60_000_000 <= parts["engine"] < 100_000_000  # its own 60 ms, not the other's 100
    # The two tasks are "tasks" (not aiohttp's, not the recorder's); the stages are charged
    # inside server tasks only, so here they count against that part.
    assert parts["tasks"] >= 160_000_000
    assert set(parts) == {*STAGES, *ACCOUNT}


def test_unmetered_the_account_is_the_stages_alone():
    cpu = StageCpu()
    assert set(cpu.account()) == set(STAGES)


def test_without_the_account_the_clock_charges_nothing_and_awaits_what_it_is_given():
    cpu = StageCpu()

    async def call():
        clock = cpu.clock()
        _spin(0.01)
        clock.lap("parse")
        return await clock.wait("engine", asyncio.sleep(0, "answer"))

    assert asyncio.run(call()) == "answer"
    assert cpu.calls == 1
    assert all(ns == 0 for ns in cpu.account().values())


def test_the_stages_are_exposed_to_prometheus():
    cpu = StageCpu()
    cpu.ns["record"] = 1_500_000_000
    cpu.calls = 3
    metrics = Metrics()
    metrics.watch(lambda: (), lambda: 0, lambda: 0, lambda: 0, cpu)
    text = metrics.exposition().decode()
    assert 'rolltap_stage_cpu_seconds_total{stage="record"} 1.5' in text
    assert "rolltap_stage_cpu_calls_total 3.0" in text
    for stage in STAGES:
        assert f'stage="{stage}"' in text


def test_admission_refuses_past_its_limit_and_while_closing_in_the_callers_terms():
    import pytest
    from aiohttp.test_utils import make_mocked_request

    from gateway.admission import Admission
    from gateway.app_keys import RETRY_AFTER
    from gateway.protocols.errors import GatewayError

    admission = Admission(limit=1, rollout_limit=8, rollout_rate=100)
    with admission.gateway_slot(make_mocked_request("POST", "/v1/chat/completions")):
        assert admission.in_flight == 1
        for path, status in (("/v1/chat/completions", 429), ("/v1/messages", 529)):
            request = make_mocked_request("POST", path)
            with pytest.raises(GatewayError) as refused:
                with admission.gateway_slot(request):
                    pass
            assert refused.value.status == status and request[RETRY_AFTER] == "1"
    admission.closing = True
    for hold in (admission.gateway_slot, lambda r: admission.rollout_share(r, uuid.uuid4())):
        with pytest.raises(GatewayError) as refused:
            with hold(make_mocked_request("POST", "/v1/chat/completions")):
                pass
        assert refused.value.status == 503
    assert admission.in_flight == 0


def test_one_rollout_past_its_share_leaves_the_others_their_calls():
    """Issue #28, attack 9: one rollout's requests (bodies still coming in count) are held to
    its share; another rollout is let in, and the gateway's slots are untouched."""
    import contextlib

    import pytest
    from aiohttp.test_utils import make_mocked_request

    from gateway.admission import Admission
    from gateway.protocols.errors import GatewayError

    admission = Admission(limit=4, rollout_limit=3, rollout_rate=1000)
    hog, other = uuid.uuid4(), uuid.uuid4()
    with contextlib.ExitStack() as held:
        for _ in range(3):
            held.enter_context(admission.rollout_share(
                make_mocked_request("POST", "/v1/messages"), hog))
        request = make_mocked_request("POST", "/v1/messages")
        with pytest.raises(GatewayError) as refused:
            held.enter_context(admission.rollout_share(request, hog))
        assert refused.value.status == 529 and "--rollout-max-inflight" in refused.value.message
        with admission.rollout_share(make_mocked_request("POST", "/v1/messages"), other):
            with admission.gateway_slot(make_mocked_request("POST", "/v1/messages")):
                assert admission.in_flight == 1
    with admission.rollout_share(make_mocked_request("POST", "/v1/messages"), hog):
        pass  # its slots came back


def test_a_rollout_starting_calls_too_fast_is_told_when_to_retry():
    import pytest
    from aiohttp.test_utils import make_mocked_request

    from gateway.admission import Admission
    from gateway.app_keys import RETRY_AFTER
    from gateway.protocols.errors import GatewayError

    admission = Admission(limit=100, rollout_limit=100, rollout_rate=2)
    fast = uuid.uuid4()
    for _ in range(4):  # the burst: twice the rate
        with admission.rollout_share(make_mocked_request("POST", "/v1/chat/completions"), fast):
            pass
    request = make_mocked_request("POST", "/v1/chat/completions")
    with pytest.raises(GatewayError) as refused:
        with admission.rollout_share(request, fast):
            pass
    assert refused.value.status == 429 and "--rollout-max-rps" in refused.value.message
    assert request[RETRY_AFTER] == "1"
    with admission.rollout_share(make_mocked_request("POST", "/v1/chat/completions"),
                                 uuid.uuid4()):
        pass  # another rollout is not slowed


def test_a_response_chain_is_walked_at_most_max_links_deep():
    """Issue #28: each link costs a query on the call's path; a chain of every response to the
    one before (or a loop) ends with a 400 that says what to send instead."""
    import pytest

    from gateway.protocols.errors import GatewayError

    limit = response_chain.MAX_LINKS
    states = {f"r{i}": {"items": [i], "previous_response_id": f"r{i - 1}" if i else None}
              for i in range(limit + 1)}
    assert response_chain.items(f"r{limit - 1}", states.get) == list(range(limit))
    seen = []

    def lookup(response_id):
        seen.append(response_id)
        return states.get(response_id)

    with pytest.raises(GatewayError) as refused:
        response_chain.items(f"r{limit}", lookup)
    assert refused.value.status == 400 and refused.value.param == "previous_response_id"
    assert len(seen) == limit
    loop = {"a": {"items": [1], "previous_response_id": "a"}}
    with pytest.raises(GatewayError):
        asyncio.run(response_chain.items_async("a", _async(loop.get)))


def _async(fn):
    async def lookup(key):
        return fn(key)

    return lookup
