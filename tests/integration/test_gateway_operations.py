"""Running gateways in production: connection and body timeouts, deadlines at the key check,
one policy version across gateways, graceful shutdown, back-pressure, metrics and request ids.
Real gateway processes, real Postgres, the session's real vLLM."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import time

import anthropic
import asyncpg
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.gateway import ADMIN_KEY, GatewayProcess, free_port
from tests.support.streams import OpenStream, long_stream_body
from trainer_bridge.versions import PolicyAnnouncer


def _dead_upstream() -> str:
    return f"http://127.0.0.1:{free_port()}"


def _closed_within(sock: socket.socket, limit: float) -> float:
    """Seconds until the server closes `sock` (reads only; fails past `limit`)."""
    started = time.monotonic()
    sock.settimeout(limit)
    try:
        while sock.recv(4096):
            pass
    except (ConnectionResetError, TimeoutError) as exc:
        if isinstance(exc, TimeoutError):
            raise AssertionError(f"connection still open after {limit}s") from None
    return time.monotonic() - started


def test_slow_and_idle_connections_are_closed_at_the_configured_timeouts(database_url, tmp_path):
    gw = GatewayProcess([_dead_upstream()], database_url, "--idle-timeout", "1",
                        "--body-timeout", "1", log_path=tmp_path / "gw.log").start()
    try:
        rollout = gw.new_rollout()
        idle = socket.create_connection(("127.0.0.1", gw.port))
        slow_head = socket.create_connection(("127.0.0.1", gw.port))
        slow_head.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        slow_body = socket.create_connection(("127.0.0.1", gw.port))
        slow_body.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {rollout['api_key']}\r\n".encode()
            + b"Content-Length: 1000\r\n\r\n{\"mod")
        for sock in (idle, slow_head):
            assert _closed_within(sock, 10) < 10
        slow_body.settimeout(10)
        reply = b""
        try:
            while chunk := slow_body.recv(4096):
                reply += chunk
        except ConnectionResetError:
            pass
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert b"--body-timeout" in reply
        # A keep-alive connection left idle after a response is closed too.
        with httpx.Client() as http:
            assert http.get(gw.url + "/").status_code == 200
            time.sleep(2.5)
            assert http.get(gw.url + "/").status_code == 200  # httpx reconnects transparently
    finally:
        gw.stop()


def test_key_is_refused_the_moment_the_deadline_passes(database_url, tmp_path):
    gw = GatewayProcess([_dead_upstream()], database_url, log_path=tmp_path / "gw.log").start()
    try:
        rollout = gw.new_rollout(timeout_s=1.0)
        headers = {"Authorization": f"Bearer {rollout['api_key']}"}
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        # Before the deadline the key works (the call then fails for want of a replica).
        first = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers)
        assert first.status_code != 401, first.text
        time.sleep(1.2)  # past the deadline; the 5 s sweep has most likely not run yet
        late = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers)
        assert late.status_code == 401
        assert late.json()["error"]["code"] == "invalid_api_key"
    finally:
        gw.stop()


def _call(gw_url: str, rollout: dict, model: str) -> None:
    client = openai.OpenAI(base_url=gw_url + "/v1", api_key=rollout["api_key"], max_retries=0,
                           timeout=120)
    client.chat.completions.create(model=model, max_tokens=4,
                                   messages=[{"role": "user", "content": "hi"}])


def _wait_version(gw: GatewayProcess, version: int, limit: float = 10) -> float:
    started = time.monotonic()
    while gw.admin.get("/admin/policy").json()["version"] != version:
        assert time.monotonic() - started < limit, "version never arrived"
        time.sleep(0.02)
    return time.monotonic() - started


def test_two_gateways_on_one_database_stamp_the_same_version(vllm_server, database_url,
                                                             tmp_path):
    one = GatewayProcess([vllm_server.url], database_url, log_path=tmp_path / "gw1.log").start()
    two = GatewayProcess([vllm_server.url], database_url, log_path=tmp_path / "gw2.log").start()
    try:
        base = one.admin.get("/admin/policy").json()["version"]
        assert two.admin.get("/admin/policy").json()["version"] == base
        rollout = one.new_rollout()
        bridge = PolicyAnnouncer([], ADMIN_KEY, offset=base + 20, database_url=database_url)
        # A bump through either gateway, or through the bridge straight to Postgres.
        for bump, (via, other) in enumerate([(one, two), (two, one), (None, None)], start=1):
            version = base + 10 * bump
            if via is None:
                version = bridge.announce(bump)
                delays = [_wait_version(g, version) for g in (one, two)]
            else:
                assert via.admin.post("/admin/policy", json={"version": version}).status_code == 200
                delays = [_wait_version(other, version)]
            print(f"version {version} reached the other gateway(s) in "
                  f"{', '.join(f'{d * 1000:.0f} ms' for d in delays)}")
            # Calls round-robined over both gateways are stamped with it.
            _call(one.url, rollout, vllm_server.model)
            _call(two.url, rollout, vllm_server.model)
            calls = one.calls(rollout["rollout_id"])[-2:]
            assert all(set(c["versions"]) == {version} for c in calls), calls
        # A gateway started later reads the current version at start-up.
        three = GatewayProcess([vllm_server.url], database_url,
                               log_path=tmp_path / "gw3.log").start()
        try:
            assert three.admin.get("/admin/policy").json()["version"] == version
        finally:
            three.stop()
    finally:
        one.stop()
        two.stop()


async def _calls_of(database_url: str, rollout_ids: list[str]) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(database_url)
    try:
        return await conn.fetch(
            "SELECT rollout_id::text, status, error, length(completion_ids) AS ids,"
            " length(logprobs) AS lps, length(versions) AS vs FROM calls"
            " WHERE rollout_id = any($1::uuid[])", rollout_ids)
    finally:
        await conn.close()


@pytest.mark.parametrize("drain_s, expect", [("60", "completed"), ("1", "aborted")])
def test_sigterm_drains_open_streams(vllm_server, database_url, tmp_path, drain_s, expect):
    gw = GatewayProcess([vllm_server.url], database_url, "--drain-timeout", drain_s,
                        log_path=tmp_path / "gw.log").start()
    try:
        rollouts = [gw.new_rollout(task_id=f"term-{i}") for i in range(16)]
        tokens = 300 if expect == "completed" else 20000
        streams = [OpenStream(r["openai_base_url"], r["api_key"],
                              long_stream_body(vllm_server.model, tokens)) for r in rollouts]
        for s in streams:
            s.wait_started(180)
        gw.proc.send_signal(signal.SIGTERM)
        assert gw.proc.wait(120) == 0, gw.log_tail()
        for s in streams:
            s.join(30)
    finally:
        gw.stop()  # a failure above leaves no gateway streaming into the tests after it
    rows = {r["rollout_id"]: r for r in asyncio.run(
        _calls_of(database_url, [r["rollout_id"] for r in rollouts]))}
    assert len(rows) == 16, gw.log_tail()  # every call recorded, none lost
    for r, s in zip(rollouts, streams):
        row = rows[r["rollout_id"]]
        assert row["ids"] == row["lps"] == row["vs"]  # 4 bytes a token each: none half-written
        if s.done:
            assert row["status"] == "ok"
        else:
            assert s.error is not None and "shut down" in s.error["message"], (s.error,
                                                                              s.exception)
            assert row["status"] == "aborted" and "shut down" in row["error"]
    outcome = {"completed" if s.done else "aborted" for s in streams}
    assert outcome == {expect}


def _scrape(gw: GatewayProcess) -> dict[tuple, float]:
    r = gw.admin.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def _total(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == w for k, w in labels.items()))


def test_metrics_move_with_calls_and_every_response_has_a_request_id(vllm_server, database_url,
                                                                      tmp_path):
    gw = GatewayProcess([vllm_server.url], database_url, "--log-format", "json",
                        "--log-level", "DEBUG", log_path=tmp_path / "gw.log").start()
    try:
        rollout = gw.new_rollout()
        before = _scrape(gw)
        client = openai.OpenAI(base_url=rollout["openai_base_url"], api_key=rollout["api_key"],
                               max_retries=0, timeout=120)
        raw = client.chat.completions.with_raw_response.create(
            model=vllm_server.model, max_tokens=8, stream=False,
            messages=[{"role": "user", "content": "count me"}],
            extra_headers={"X-Request-Id": "harness-id-42"})
        assert raw.headers["x-request-id"] == "harness-id-42"
        stream = client.chat.completions.create(
            model=vllm_server.model, max_tokens=8, stream=True,
            messages=[{"role": "user", "content": "and me"}])
        list(stream)
        gw.finish(rollout["rollout_id"], 1.0)
        time.sleep(10.5)  # the database-derived gauges are refreshed at most every 10 s
        after = _scrape(gw)

        route = "/v1/chat/completions"
        assert (_total(after, "rolltap_requests_total", route=route, status="200")
                - _total(before, "rolltap_requests_total", route=route, status="200")) == 2
        assert _total(after, "rolltap_calls_total", status="ok") - _total(
            before, "rolltap_calls_total", status="ok") == 2
        assert _total(after, "rolltap_sampled_tokens_total") > _total(
            before, "rolltap_sampled_tokens_total")
        assert _total(after, "rolltap_prompt_tokens_total") > _total(
            before, "rolltap_prompt_tokens_total")
        assert _total(after, "rolltap_ttft_seconds_count") - _total(
            before, "rolltap_ttft_seconds_count") == 2
        assert _total(after, "rolltap_request_seconds_count", route=route) >= 2
        assert _total(after, "rolltap_commit_seconds_count") > _total(
            before, "rolltap_commit_seconds_count")
        assert _total(after, "rolltap_recorder_batch_size_count") > 0
        assert _total(after, "rolltap_continuation_paths_total") >= 2
        assert _total(after, "rolltap_replica_healthy", replica=vllm_server.url) == 1
        assert ("rolltap_replica_in_flight", (("replica", vllm_server.url),)) in after
        assert _total(after, "rolltap_rollouts", status="finished") >= 1
        assert any(n == "rolltap_merge_forks" for n, _ in after)
        assert any(n == "rolltap_merge_lost_tokens" for n, _ in after)
        assert ("rolltap_policy_version", ()) in after
        assert ("rolltap_recorder_queue_depth", ()) in after

        # Ids on every response, errors included; each log line of a call carries its id.
        for r in (httpx.get(gw.url + "/"), httpx.post(gw.url + "/v1/chat/completions"),
                  httpx.get(gw.url + "/nope")):
            assert len(r.headers["x-request-id"]) >= 16
        lines = [json.loads(line) for line in gw.log_tail(10**7).splitlines()
                 if line.startswith("{")]
        mine = [x for x in lines if x["request_id"] == "harness-id-42"]
        assert mine and all(x["level"] for x in mine)
        # A rollout key cannot read the metrics.
        r = httpx.get(gw.url + "/metrics",
                      headers={"Authorization": f"Bearer {rollout['api_key']}"})
        assert r.status_code == 403
    finally:
        gw.stop()


def test_past_max_inflight_callers_get_protocol_shaped_429_and_529(vllm_server, database_url,
                                                                   tmp_path):
    # The two streams hold both places until the gateway stops (and aborts them after 1 s).
    gw = GatewayProcess([vllm_server.url], database_url, "--max-inflight", "2",
                        "--drain-timeout", "1", log_path=tmp_path / "gw.log").start()
    try:
        rollout = gw.new_rollout()
        streams = [OpenStream(rollout["openai_base_url"], rollout["api_key"],
                              long_stream_body(vllm_server.model, 20000)) for _ in range(2)]
        for s in streams:
            s.wait_started(180)
        oai = openai.OpenAI(base_url=rollout["openai_base_url"], api_key=rollout["api_key"],
                            max_retries=0)
        with pytest.raises(openai.RateLimitError) as info:
            oai.chat.completions.create(model=vllm_server.model, max_tokens=4,
                                        messages=[{"role": "user", "content": "hi"}])
        assert info.value.response.headers["retry-after"] == "1"
        assert info.value.body["type"] == "rate_limit_error"
        ant = anthropic.Anthropic(base_url=rollout["anthropic_base_url"],
                                  api_key=rollout["api_key"], max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as info:
            ant.messages.create(model=vllm_server.model, max_tokens=4,
                                messages=[{"role": "user", "content": "hi"}])
        assert info.value.status_code == 529
        assert info.value.body["error"]["type"] == "overloaded_error"
        assert info.value.response.headers["retry-after"] == "1"
        assert not any(s.ended.is_set() for s in streams)  # both were in flight throughout
    finally:
        gw.stop()
    for s in streams:
        s.join(60)


def test_slow_bodies_of_one_rollout_leave_the_gateway_slots_to_others(vllm_server,
                                                                      database_url, tmp_path):
    """Issue #28, attack 9: request heads whose bodies never finish held every in-flight slot,
    and another rollout's call got 429. Now a call takes a gateway slot once its body is in;
    until then it counts against its own rollout's share only."""
    gw = GatewayProcess([vllm_server.url], database_url, "--max-inflight", "2",
                        "--rollout-max-inflight", "8", "--body-timeout", "60",
                        log_path=tmp_path / "gw.log").start()
    hog, other = gw.new_rollout(), gw.new_rollout()
    held = []
    try:
        for _ in range(8):
            sock = socket.create_connection(("127.0.0.1", gw.port), timeout=10)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100000\r\n"
                         b"Authorization: Bearer " + hog["api_key"].encode() + b"\r\n\r\n{")
            held.append(sock)
        time.sleep(1)  # the heads are in and their bodies are being read
        oai = openai.OpenAI(base_url=other["openai_base_url"], api_key=other["api_key"],
                            max_retries=0, timeout=120)
        reply = oai.chat.completions.create(model=vllm_server.model, max_tokens=4,
                                            messages=[{"role": "user", "content": "hi"}])
        assert reply.choices
        # the hog's ninth request is past its own share
        r = httpx.post(hog["openai_base_url"] + "/chat/completions", timeout=30,
                       headers={"Authorization": f"Bearer {hog['api_key']}"},
                       json={"model": vllm_server.model, "max_tokens": 4,
                             "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 429 and "--rollout-max-inflight" in r.json()["error"]["message"]
    finally:
        for sock in held:
            sock.close()
        gw.stop()


def test_a_rollout_past_its_storage_quota_is_refused_in_its_protocol(vllm_server, database_url,
                                                                     tmp_path):
    """Issue #28, attack 11: one rollout could store without bound (four 8 MiB requests stored
    27 MiB). Past --rollout-max-stored-mb its calls get 413 in their protocol, are not
    recorded, and its next calls are refused before the engine works for them; another
    rollout goes on."""
    gw = GatewayProcess([vllm_server.url], database_url, "--rollout-max-stored-mb", "0.008",
                        log_path=tmp_path / "gw.log").start()
    try:
        hog, other = gw.new_rollout(), gw.new_rollout()
        ant = anthropic.Anthropic(base_url=hog["anthropic_base_url"], api_key=hog["api_key"],
                                  max_retries=0, timeout=120)

        def call(client):
            noise = base64.b64encode(os.urandom(4500)).decode()  # about 6 kB, incompressible
            return client.messages.create(model=vllm_server.model, max_tokens=2,
                                          messages=[{"role": "user", "content": noise}])

        call(ant)
        for _ in range(2):
            with pytest.raises(anthropic.APIStatusError) as info:
                call(ant)
            assert info.value.status_code == 413
            assert info.value.body["error"]["type"] == "request_too_large"
            assert "storage quota" in info.value.body["error"]["message"]
        assert len(gw.calls(hog["rollout_id"])) == 1
        client = openai.OpenAI(base_url=other["openai_base_url"], api_key=other["api_key"],
                               max_retries=0, timeout=120)
        assert client.chat.completions.create(model=vllm_server.model, max_tokens=2,
                                              messages=[{"role": "user", "content": "hi"}])
    finally:
        gw.stop()
