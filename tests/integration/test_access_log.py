"""The gateway logs one line per HTTP call (method, route, status, latency, rollout, request
id), and `--no-access-log` turns it off."""

from __future__ import annotations

import re
import time

import httpx

from tests.support.gateway import GatewayProcess

LINE = re.compile(
    r"rolltap\.access(?: \[\S*\])?:? (?P<method>[A-Z]+) (?P<route>\S+) (?P<status>\d{3}) "
    r"(?P<ms>[\d.]+)ms rollout=(?P<rollout>\S+) request_id=(?P<rid>\S+)$"
)


def access_lines(gw: GatewayProcess) -> list[dict]:
    return [m.groupdict() for m in map(LINE.search, gw.log_tail(1_000_000).splitlines()) if m]


def _lines_once(gw: GatewayProcess, seen, timeout: float = 10.0) -> list[dict]:
    """The access lines once `seen(lines)` holds: aiohttp writes a call's line only after its
    response is sent, so the client can read the log before the last call's line is there."""
    deadline = time.monotonic() + timeout
    while not seen(lines := access_lines(gw)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return lines


def test_one_line_per_call_with_route_status_rollout_and_request_id(gateway, vllm_server):
    rollout = gateway.new_rollout(task_id="access-log")
    rid = rollout["rollout_id"]
    r = httpx.post(
        rollout["openai_base_url"] + "/chat/completions",
        headers={"Authorization": f"Bearer {rollout['api_key']}", "X-Request-Id": "req-42"},
        json={"model": vllm_server.model, "max_tokens": 4,
              "messages": [{"role": "user", "content": "hi"}]},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert gateway.admin.get(f"/admin/rollouts/{rid}?x=1").status_code == 200
    assert httpx.get(gateway.url + "/v1/models").status_code == 401
    lines = _lines_once(gateway, lambda ls: any(x["route"] == "/v1/models" for x in ls))
    chat = [x for x in lines if x["rid"] == "req-42"]
    assert len(chat) == 1
    assert (chat[0]["method"], chat[0]["route"], chat[0]["status"], chat[0]["rollout"]) == (
        "POST", "/v1/chat/completions", "200", rid)
    assert float(chat[0]["ms"]) > 0
    admin = [x for x in lines if x["route"] == "/admin/rollouts/{rollout_id}"
             and x["rollout"] == rid]
    assert [(x["method"], x["status"]) for x in admin] == [("GET", "200")]
    assert any(x["route"] == "/v1/models" and x["status"] == "401" for x in lines)


def test_no_access_log_flag_silences_it(vllm_server, database_url, tmp_path):
    gw = GatewayProcess([vllm_server.url], database_url, "--no-access-log",
                        log_path=tmp_path / "gw.log").start()
    try:
        for _ in range(3):
            assert httpx.get(gw.url + "/").status_code == 200
        assert gw.admin.get("/admin/policy").status_code == 200
    finally:
        gw.stop()
    assert access_lines(gw) == []
    assert "listening" in gw.log_tail()
