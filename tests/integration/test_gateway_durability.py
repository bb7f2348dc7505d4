"""Invariant 2: a call acknowledged to the client is in Postgres, even if the gateway dies the
instant after. Also the embedded-Postgres path, used when no --database-url is given."""

from __future__ import annotations

import openai

from stack.launcher import stop_embedded_postgres
from tests.support.gateway import GatewayProcess


def test_call_survives_gateway_kill_right_after_done(vllm_server, database_url, tmp_path):
    gw = GatewayProcess([vllm_server.url], database_url, log_path=tmp_path / "gw.log").start()
    rollout = gw.new_rollout(task_id="durable")
    client = openai.OpenAI(base_url=rollout["openai_base_url"], api_key=rollout["api_key"],
                           max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model=vllm_server.model, stream=True, max_tokens=16,
        messages=[{"role": "user", "content": "durable?"}])
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    # The SDK has consumed `[DONE]`: kill -9 now, no shutdown hook runs.
    gw.kill()
    restarted = GatewayProcess([vllm_server.url], database_url, port=gw.port,
                               log_path=tmp_path / "gw2.log").start()
    try:
        [call] = restarted.calls(rollout["rollout_id"])
        assert call["status"] == "ok" and call["completion_ids"]
        assert call["response"]["message"]["content"] == (text or None)
    finally:
        restarted.stop()


def test_embedded_postgres_when_no_database_url(vllm_server, tmp_path):
    data_dir = tmp_path / "data"
    gw = GatewayProcess([vllm_server.url], None, "--data-dir", str(data_dir),
                        log_path=tmp_path / "gw.log").start(timeout=120)
    try:
        assert "starting embedded Postgres" in gw.log_path.read_text()
        rollout = gw.new_rollout()
        client = openai.OpenAI(base_url=rollout["openai_base_url"], api_key=rollout["api_key"],
                               max_retries=0, timeout=120)
        client.chat.completions.create(model=vllm_server.model, max_tokens=8,
                                       messages=[{"role": "user", "content": "embedded"}])
        [call] = gw.calls(rollout["rollout_id"])
        assert call["status"] == "ok" and len(call["logprobs"]) == len(call["completion_ids"])
        assert (data_dir / "pgdata" / "PG_VERSION").exists()
    finally:
        gw.stop()
        stop_embedded_postgres(data_dir / "pgdata")


