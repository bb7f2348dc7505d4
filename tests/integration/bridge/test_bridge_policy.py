"""The bridge refuses to train under another sampling policy than the gateway pins: the gateway
publishes what it pins in GET /admin/policy, exactly what it applies to every call."""

from __future__ import annotations

import subprocess
import sys

import openai

from tests.support.gateway import ADMIN_KEY, REPO


def test_the_published_policy_is_what_every_call_is_pinned_to(gateway, vllm_server):
    policy = gateway.admin.get("/admin/policy").json()
    rollout = gateway.new_rollout()
    client = openai.OpenAI(base_url=rollout["openai_base_url"], api_key=rollout["api_key"],
                           max_retries=0)
    client.chat.completions.create(model=vllm_server.model, max_tokens=4, temperature=0.2,
                                   top_p=0.5, messages=[{"role": "user", "content": "hi"}])
    [call] = gateway.calls(rollout["rollout_id"])
    assert call["applied"] == policy["sampling"]
    assert call["requested"]["temperature"] == 0.2  # the harness's wish, recorded, not applied


def test_a_bridge_at_another_temperature_refuses_to_start(gateway, vllm_server, tiny_model_dir):
    # A live vLLM: the bridge's preflight refuses an unreachable one before the policy check.
    published = gateway.admin.get("/admin/policy").json()["sampling"]["temperature"]
    command = [sys.executable, "-m", "trainer_bridge.cli", "bridge", "--model",
               str(tiny_model_dir), "--vllm", vllm_server.url, "--gateway", gateway.url,
               "--admin-key", ADMIN_KEY, "--max-steps", "1", "--temperature", "0.7"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"temperature is {published:g} at the gateway but 0.7 in the trainer" in done.stderr
    assert gateway.url in done.stderr and "--temperature" in done.stderr
