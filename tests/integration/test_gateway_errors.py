"""Bad input gets a clear error in the caller's protocol, and never touches recorded data
(invariant 7). Faults (a client that leaves mid-stream, an upstream that dies) are recorded as
aborted or failed calls."""

from __future__ import annotations

import asyncio
import socket
import threading

import asyncpg
import httpx
import pytest

from tests.support.gateway import GatewayProcess


async def _snapshot(dsn: str):
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchrow(
            "SELECT count(*) AS n, md5(coalesce(string_agg(id::text || seq || status || "
            "md5(completion_ids) || md5(prompt_delta), ',' ORDER BY id), '')) AS digest FROM calls")
    finally:
        await conn.close()


def snapshot(dsn: str):
    return tuple(asyncio.run(_snapshot(dsn)))


BAD_REQUESTS = [
    # (name, raw body, expected status, words the message must contain)
    ("malformed json", b'{"model": "tiny", "messages": [', 400, "not valid JSON"),
    ("not an object", b'[1, 2]', 400, "JSON object"),
    ("missing messages", b'{"model": "tiny"}', 400, "messages"),
    ("messages wrong type", b'{"model": "tiny", "messages": "hi"}', 400, "messages"),
    ("empty messages", b'{"model": "tiny", "messages": []}', 400, "messages"),
    ("bad role", b'{"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}', 400,
     "role"),
    ("max_tokens wrong type",
     b'{"model": "tiny", "max_tokens": "ten", "messages": [{"role": "user", "content": "x"}]}',
     400, "max_tokens"),
    ("n > 1", b'{"model": "tiny", "n": 2, "messages": [{"role": "user", "content": "x"}]}', 400,
     "`n`"),
    ("unknown model",
     b'{"model": "gpt-17", "messages": [{"role": "user", "content": "x"}]}', 404, "gpt-17"),
    ("oversized body",
     b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"x" * (2 << 20) + b'"}]}',
     413, "too large"),
]


@pytest.mark.parametrize("name,raw,status,words", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_chat_request(gateway, database_url, vllm_server, name, raw, status, words):
    rollout = gateway.new_rollout()
    ok = httpx.post(rollout["openai_base_url"] + "/chat/completions",
                    headers={"Authorization": f"Bearer {rollout['api_key']}"}, timeout=60,
                    json={"model": vllm_server.model, "max_tokens": 4,
                          "messages": [{"role": "user", "content": "before"}]})
    assert ok.status_code == 200
    before = snapshot(database_url)
    r = httpx.post(rollout["openai_base_url"] + "/chat/completions", content=raw, timeout=60,
                   headers={"Authorization": f"Bearer {rollout['api_key']}",
                            "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"], err
    assert set(err) >= {"message", "type", "param", "code"}
    assert snapshot(database_url) == before


def test_admin_bad_input(gateway):
    r = gateway.admin.post("/admin/rollouts", content=b"{nope")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = gateway.admin.post("/admin/rollouts", json={"task_id": 5})
    assert r.status_code == 400 and "task_id" in r.json()["error"]["message"]
    rollout = gateway.new_rollout()
    r = gateway.admin.post(f"/admin/rollouts/{rollout['rollout_id']}/finish",
                           json={"reward": "high"})
    assert r.status_code == 400 and "reward" in r.json()["error"]["message"]
    r = gateway.admin.post(f"/admin/rollouts/{rollout['rollout_id']}/finish",
                           json={"reward": 1, "status": "great"})
    assert r.status_code == 400
    assert gateway.admin.get("/admin/rollouts/not-a-uuid").status_code == 404
    assert gateway.admin.get(
        "/admin/rollouts/00000000-0000-0000-0000-000000000000").status_code == 404


def test_client_disconnect_mid_stream_is_recorded_as_aborted(gateway, vllm_server):
    rollout = gateway.new_rollout()
    with httpx.Client(timeout=120) as client, client.stream(
        "POST", rollout["openai_base_url"] + "/chat/completions",
        headers={"Authorization": f"Bearer {rollout['api_key']}"},
        # ignore_eos: the random tiny model may sample its end of text within the first few
        # tokens, and a stream that ended before the client left is rightly recorded ok. So
        # many tokens that a loaded machine's client leaves before the engine is done.
        json={"model": vllm_server.model, "max_tokens": 8000, "stream": True, "ignore_eos": True,
              "messages": [{"role": "user", "content": "Write a long story."}]},
    ) as r:
        for n, _line in enumerate(r.iter_lines()):
            if n >= 6:
                break  # leave mid-stream: closing the response closes the connection
    for _ in range(600):  # the gateway notices at its next write, then commits
        calls = gateway.calls(rollout["rollout_id"])
        if calls:
            break
        threading.Event().wait(0.1)
    [call] = calls
    assert call["status"] == "aborted"
    assert 0 < len(call["completion_ids"]) < 8000
    assert len(call["logprobs"]) == len(call["completion_ids"])


class DeadUpstream:
    """A FAKE upstream for fault tests only: it lists a model, then drops every completion
    connection without answering, like a replica that dies mid-request."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            data = conn.recv(65536)
            if data.startswith(b"GET /v1/models"):
                body = b'{"object":"list","data":[{"id":"tiny","object":"model"}]}'
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
            conn.close()


def test_upstream_down_gives_502_and_a_failed_record(database_url, tmp_path):
    dead = DeadUpstream()
    gw = GatewayProcess([dead.url], database_url, log_path=tmp_path / "gw.log").start()
    try:
        rollout = gw.new_rollout()
        r = httpx.post(rollout["openai_base_url"] + "/chat/completions", timeout=60,
                       headers={"Authorization": f"Bearer {rollout['api_key']}"},
                       json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 502, r.text
        assert r.json()["error"]["type"] == "upstream_error"
        [call] = gw.calls(rollout["rollout_id"])
        assert call["status"] == "failed" and call["error"]
        assert call["completion_ids"] == [] and call["prompt_ids"] == []
    finally:
        gw.stop()
        dead.sock.close()
