"""Invariant 4: every sampled token carries the policy version live when it was sampled. A
streamed response that straddles a weight sync (engine paused, version bumped, resumed)
carries both versions, split inside the one response."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai

from tests.support.vllm import wait_engine_idle


def test_streamed_response_straddling_a_sync_has_per_token_versions(gateway, vllm_server):
    assert gateway.admin.post("/admin/policy", json={"version": 1}).status_code == 200
    rollout = gateway.new_rollout()
    client = openai.OpenAI(base_url=rollout["openai_base_url"], api_key=rollout["api_key"],
                           max_retries=0, timeout=300)
    got_some, resumed = threading.Event(), threading.Event()
    received: list[str] = []
    after_resume: list[str] = []

    def consume() -> None:
        # A reply far longer than the test (min_tokens: no early end of turn), read until some
        # tokens have come after the sync; leaving then records the call as aborted, versions
        # and all, without waiting for the rest.
        stream = client.chat.completions.create(
            model=vllm_server.model, stream=True, max_tokens=20000,
            extra_body={"min_tokens": 20000},
            messages=[{"role": "user", "content": "Tell me everything."}])
        for chunk in stream:
            if not chunk.choices:
                continue
            (after_resume if resumed.is_set() else received).append(
                chunk.choices[0].delta.content or "")
            if len(received) >= 5:
                got_some.set()
            if len(after_resume) >= 20:
                break
        stream.close()

    reader = threading.Thread(target=consume)
    reader.start()
    try:
        assert got_some.wait(120), "stream did not start"
        r = httpx.post(vllm_server.url + "/pause", params={"mode": "keep"}, timeout=60)
        assert r.status_code == 200, r.text
        # Let chunks already in flight arrive under the old version before it changes.
        time.sleep(1.0)
        assert gateway.admin.post("/admin/policy", json={"version": 2}).status_code == 200
        resumed.set()
    finally:
        httpx.post(vllm_server.url + "/resume", timeout=60)
    reader.join(300)
    assert len(after_resume) >= 20, "generation went on after the sync"

    deadline = time.monotonic() + 30
    while not (calls := gateway.calls(rollout["rollout_id"])) and time.monotonic() < deadline:
        time.sleep(0.2)
    [call] = calls
    assert call["status"] == "aborted"
    versions = call["versions"]
    assert len(versions) == len(call["completion_ids"])
    assert set(versions) == {1, 2}
    split = versions.index(2)
    assert versions == [1] * split + [2] * (len(versions) - split)


def test_non_streamed_call_gets_the_older_version(gateway, vllm_server):
    assert gateway.admin.post("/admin/policy", json={"version": 5}).status_code == 200
    rollout = gateway.new_rollout()
    client = openai.OpenAI(base_url=rollout["openai_base_url"], api_key=rollout["api_key"],
                           max_retries=0, timeout=300)
    result: dict = {}

    def call() -> None:
        result["resp"] = client.chat.completions.create(
            model=vllm_server.model, max_tokens=200,
            messages=[{"role": "user", "content": "Long answer please."}])

    httpx.post(vllm_server.url + "/pause", params={"mode": "keep"}, timeout=60)
    try:
        worker = threading.Thread(target=call)
        worker.start()
        time.sleep(1.0)  # the request is queued in the paused engine
        assert gateway.admin.post("/admin/policy", json={"version": 6}).status_code == 200
    finally:
        httpx.post(vllm_server.url + "/resume", timeout=60)
    worker.join(300)
    [call_rec] = gateway.calls(rollout["rollout_id"])
    assert set(call_rec["versions"]) == {5}


def test_a_client_that_stalls_across_a_sync_keeps_its_tokens_sampling_version(gateway,
                                                                               vllm_server):
    """Issue #28, attack 7: the engine finished a long reply under one version while its client
    read slowly; a new version went live before the client read the rest. Every token keeps
    the version it was sampled under: the gateway reads the engine at the engine's pace. The
    client is a raw socket with a small receive buffer, so its stall reaches the gateway."""
    assert gateway.admin.post("/admin/policy", json={"version": 10}).status_code == 200
    rollout = gateway.new_rollout()
    body = json.dumps({"model": vllm_server.model, "stream": True, "max_tokens": 6000,
                       "min_tokens": 6000,
                       "messages": [{"role": "user", "content": "Tell me everything."}]})
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(300)
    sock.connect(("127.0.0.1", gateway.port))
    try:
        sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                      f"Authorization: Bearer {rollout['api_key']}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                      + body).encode())
        first = sock.recv(2048)
        assert b" 200 " in first.split(b"\r\n", 1)[0], first[:200]
        wait_engine_idle(vllm_server.url)  # the client reads nothing meanwhile
        assert gateway.admin.post("/admin/policy", json={"version": 11}).status_code == 200
        rest = bytearray(first)
        while chunk := sock.recv(1 << 16):
            rest += chunk
        assert b"data: [DONE]" in rest
    finally:
        sock.close()
    [call] = gateway.calls(rollout["rollout_id"])
    assert call["status"] == "ok" and len(call["completion_ids"]) == 6000
    assert set(call["versions"]) == {10}
