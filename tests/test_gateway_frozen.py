"""A replica that accepts calls and then never answers. The replica here is a FAULT STAND-IN (a
few lines of aiohttp that hold every request open): the fault itself is what is under test, and
a real engine cannot be made to hang before its first chunk on demand. The idle timeout between
chunks is tested against a real, SIGSTOPped vLLM in test_gateway_replicas.py."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.support.frozen_replica import FrozenReplica
from tests.support.gateway import GatewayProcess, free_port
from tests.support.streams import OpenStream


@pytest.fixture
def frozen():
    return FrozenReplica()


def _body(stream: bool) -> dict:
    return {"model": "tiny", "stream": stream, "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello?"}]}


def test_stream_without_a_first_chunk_ends_at_the_ttft_timeout(frozen, database_url, tmp_path):
    # No probe during the test (its /health would pass and take the replica back at once).
    gw = GatewayProcess([frozen.url], database_url, "--ttft-timeout", "1.5",
                        "--continuation", "render", "--eject-after", "1",
                        "--probe-interval", "600", log_path=tmp_path / "gw.log").start()
    try:
        rollout = gw.new_rollout()
        started = time.monotonic()
        s = OpenStream(rollout["openai_base_url"], rollout["api_key"], _body(True))
        s.join(30)
        assert s.status == 200 and s.error is not None, (s.status, s.exception)
        assert "no first token for 1.5s" in s.error["message"]
        print(f"stream ended {time.monotonic() - started:.1f} s after it started")
        [call] = gw.calls(rollout["rollout_id"])
        assert call["status"] == "failed" and "frozen" in call["error"]
        # One failure with --eject-after 1: the replica is out until a probe passes.
        [replica] = gw.admin.get("/admin/upstreams").json()["upstreams"]
        assert replica["consecutive_failures"] == 1 and replica["state"] == "ejected"
        assert "no first token" in replica["last_failure"]
    finally:
        gw.stop()


def test_stream_that_goes_silent_ends_at_the_idle_timeout(frozen, database_url, tmp_path):
    frozen.first_bytes = b": the engine was here\n\n"  # an SSE comment, then nothing
    gw = GatewayProcess([frozen.url], database_url, "--ttft-timeout", "60",
                        "--stream-idle-timeout", "1", "--continuation", "render",
                        log_path=tmp_path / "gw.log").start()
    try:
        rollout = gw.new_rollout()
        s = OpenStream(rollout["openai_base_url"], rollout["api_key"], _body(True))
        s.join(30)  # well before the first-token timeout
        assert s.error is not None and "no next chunk for 1s" in s.error["message"], s.error
        [call] = gw.calls(rollout["rollout_id"])
        assert call["status"] == "failed" and "frozen" in call["error"]
    finally:
        gw.stop()


def test_whole_response_call_on_a_replica_ejected_by_probes_ends(frozen, database_url,
                                                                  tmp_path):
    gw = GatewayProcess([frozen.url, f"http://127.0.0.1:{free_port()}"], database_url,
                        "--probe-interval", "0.3", "--eject-after", "2",
                        "--continuation", "render", log_path=tmp_path / "gw.log").start()
    try:
        # A rollout placed on the stand-in (the other replica is down and soon ejected).
        deadline = time.monotonic() + 30
        while True:
            states = {u["url"]: u["state"] for u in
                      gw.admin.get("/admin/upstreams").json()["upstreams"]}
            if states[frozen.url] == "healthy" and list(states.values()).count("ejected") == 1:
                break
            assert time.monotonic() < deadline, states
            time.sleep(0.1)
        rollout = gw.new_rollout()
        result = {}

        def call():
            result["r"] = httpx.post(rollout["openai_base_url"] + "/chat/completions",
                                     json=_body(False), timeout=120,
                                     headers={"Authorization": f"Bearer {rollout['api_key']}"})

        t = threading.Thread(target=call)
        t.start()
        while frozen.held == 0:
            time.sleep(0.05)
        frozen.healthy = False  # now its /health fails too: probes eject it
        t.join(60)
        r = result["r"]
        assert r.status_code == 503 and "ejected" in r.json()["error"]["message"], r.text
        [rec] = gw.calls(rollout["rollout_id"])
        assert rec["status"] == "failed" and "ejected" in rec["error"]
    finally:
        gw.stop()
