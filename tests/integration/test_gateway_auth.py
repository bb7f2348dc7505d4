"""Invariant 6 at the gateway: rollout keys open only the model routes of their own running
rollout; the admin API takes only the admin key; unknown keys are rejected, never adopted."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.support.gateway import ADMIN_KEY, GatewayProcess


def test_unknown_key_is_rejected_and_nothing_created(gateway, vllm_server):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="rt-not-a-real-key",
                           max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        client.chat.completions.create(model=vllm_server.model,
                                       messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert info.value.status_code == 401
    assert info.value.body["type"] == "authentication_error"
    r = httpx.post(gateway.url + "/v1/chat/completions", json={})
    assert r.status_code == 401 and "error" in r.json()


@pytest.mark.parametrize("route", [
    ("POST", "/admin/rollouts", {}),
    ("GET", "/admin/rollouts/{id}", None),
    ("GET", "/admin/rollouts/{id}/calls", None),
    ("POST", "/admin/rollouts/{id}/finish", {"reward": 1.0}),
    ("POST", "/admin/policy", {"version": 7}),
])
def test_rollout_key_cannot_use_admin_api(gateway, route):
    rollout = gateway.new_rollout()
    method, path, body = route
    path = path.format(id=rollout["rollout_id"])
    for headers in ({"Authorization": f"Bearer {rollout['api_key']}"},
                    {"x-api-key": rollout["api_key"]}, {}):
        r = httpx.request(method, gateway.url + path, json=body, headers=headers)
        assert r.status_code in (401, 403), (headers, r.status_code)
        assert r.json()["error"]["type"] in ("authentication_error", "permission_error")
    # Nothing changed: the rollout is still running with no reward, the policy untouched.
    state = gateway.admin.get(f"/admin/rollouts/{rollout['rollout_id']}").json()
    assert state["status"] == "running" and state["reward"] is None
    assert gateway.admin.get("/admin/policy").json()["version"] != 7


def test_finished_rollout_key_is_refused(gateway, vllm_server):
    rollout = gateway.new_rollout()
    client = openai.OpenAI(base_url=rollout["openai_base_url"], api_key=rollout["api_key"],
                           max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    client.chat.completions.create(model=vllm_server.model, messages=messages, max_tokens=4)
    r = gateway.finish(rollout["rollout_id"], 0.5)
    assert r.status_code == 200 and r.json()["status"] == "finished"
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model=vllm_server.model, messages=messages, max_tokens=4)
    assert len(gateway.calls(rollout["rollout_id"])) == 1
    # Finishing twice the same way is idempotent; differently is a conflict.
    assert gateway.finish(rollout["rollout_id"], 0.5).status_code == 200
    assert gateway.finish(rollout["rollout_id"], 1.0).status_code == 409


def test_x_api_key_header_is_accepted(gateway, vllm_server):
    rollout = gateway.new_rollout()
    r = httpx.post(gateway.url + "/v1/chat/completions", headers={"x-api-key": rollout["api_key"]},
                   json={"model": vllm_server.model, "max_tokens": 4,
                         "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 200, r.text


def test_admin_key_is_not_a_rollout_key(gateway, vllm_server):
    r = httpx.post(gateway.url + "/v1/chat/completions",
                   headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                   json={"model": vllm_server.model,
                         "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 401


def test_a_rollout_ended_on_one_gateway_is_refused_at_once_on_another(
    vllm_server, database_url, tmp_path
):
    # Keys are cached for long (an agent's calls are seconds apart); the end of a rollout
    # reaches every gateway through Postgres, not when a cache entry runs out.
    one = GatewayProcess([vllm_server.url], database_url, log_path=tmp_path / "gw1.log").start()
    two = GatewayProcess([vllm_server.url], database_url, log_path=tmp_path / "gw2.log").start()
    try:
        rollout = one.new_rollout()
        headers = {"Authorization": f"Bearer {rollout['api_key']}"}
        assert httpx.get(two.url + "/v1/models", headers=headers).status_code == 200
        time.sleep(2.5)
        # Cached afresh just now: a 2-second cache would take the key ~2 s past the end.
        assert httpx.get(two.url + "/v1/models", headers=headers).status_code == 200
        assert one.finish(rollout["rollout_id"], 1.0).status_code == 200
        started = time.monotonic()
        while httpx.get(two.url + "/v1/models", headers=headers).status_code == 200:
            assert time.monotonic() - started < 1.0, "the other gateway still takes the key"
            time.sleep(0.02)
        r = httpx.get(two.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and "has ended" in r.json()["error"]["message"]
    finally:
        one.stop()
        two.stop()
