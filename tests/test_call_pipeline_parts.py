"""The pipeline's small parts that need no engine: the one walk of a previous_response_id chain
(live calls and export read it alike), and the per-stage CPU clock the bench reads."""

from __future__ import annotations

import asyncio
import time

from gateway import response_chain
from gateway.metrics import Metrics
from gateway.stage_cpu import STAGES, StageCpu

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
    cpu = StageCpu()

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

    admission = Admission(limit=1)
    first = make_mocked_request("POST", "/v1/chat/completions")
    admission.enter(first)
    assert admission.in_flight == 1
    for path, status in (("/v1/chat/completions", 429), ("/v1/messages", 529)):
        request = make_mocked_request("POST", path)
        with pytest.raises(GatewayError) as refused:
            admission.enter(request)
        assert refused.value.status == status and request[RETRY_AFTER] == "1"
    admission.leave()
    admission.closing = True
    with pytest.raises(GatewayError) as refused:
        admission.enter(make_mocked_request("POST", "/v1/chat/completions"))
    assert refused.value.status == 503
    assert admission.in_flight == 0
