"""`include_reasoning: false` must not switch the capture off (issue 11, item 3).

vLLM 0.32 started with a reasoning parser drops a response's `token_ids` and `logprobs` when a
request says `include_reasoning: false`; a gateway passing the field on would record a reply
with no sampled tokens. The gateway removes the field upstream, records every sampled id and
logprob, and still hides the reasoning from the client that asked not to see it. `deepseek_r1`
suits the tiny model: its template writes `<think>` and `</think>`, which are tokens of its
vocabulary, and everything a random model samples before `</think>` counts as reasoning.
"""

from __future__ import annotations

import json

import httpx
import pytest

from stack.serve_model import start_vllm
from tests.support.gateway import GatewayProcess, free_port
from tests.support.postgres import fresh_database
from tests.support.vllm import TINY_MODEL_NAME, VLLM_READY_TIMEOUT_S

PROMPT = [{"role": "user", "content": "Think, then answer."}]


@pytest.fixture(scope="module")
def reasoning_vllm(tiny_model_dir, tmp_path_factory):
    vllm = start_vllm(tiny_model_dir, free_port(), served_model_name=TINY_MODEL_NAME,
                      max_model_len=4096, kv_cache_gib=1, device="auto",
                      extra_args=["--reasoning-parser", "deepseek_r1"],
                      log_path=tmp_path_factory.mktemp("vllm-reasoning") / "vllm.log")
    try:
        vllm.wait_ready(VLLM_READY_TIMEOUT_S)
        yield vllm.url
    finally:
        vllm.stop()


@pytest.fixture(scope="module")
def reasoning_gw(reasoning_vllm, tmp_path_factory):
    dsn, drop = fresh_database("rolltap_reasoning")
    gw = GatewayProcess([reasoning_vllm], dsn,
                        log_path=tmp_path_factory.mktemp("gw-reasoning") / "gateway.log").start()
    yield gw
    gw.stop()
    drop()


def test_the_engine_itself_drops_the_capture(reasoning_vllm):
    """The hazard, checked on the engine: without the gateway's care no ids come back."""
    body = {"model": TINY_MODEL_NAME, "messages": PROMPT, "max_tokens": 16,
            "return_token_ids": True, "logprobs": True, "include_reasoning": False}
    out = httpx.post(reasoning_vllm + "/v1/chat/completions", json=body, timeout=120).json()
    choice = out["choices"][0]
    assert out["usage"]["completion_tokens"] > len(choice.get("token_ids") or ())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_include_reasoning_false_still_records_every_sampled_token(reasoning_gw, stream):
    rollout = reasoning_gw.new_rollout(task_id="reasoning")
    body = {"model": TINY_MODEL_NAME, "messages": PROMPT, "max_tokens": 16, "stream": stream,
            "include_reasoning": False}
    r = httpx.post(rollout["openai_base_url"] + "/chat/completions", json=body, timeout=120,
                   headers={"Authorization": f"Bearer {rollout['api_key']}"})
    assert r.status_code == 200, r.text
    # The client asked not to see the reasoning, and does not.
    if stream:
        lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: {")]
        messages = [c["delta"] for ln in lines for c in json.loads(ln).get("choices") or ()]
    else:
        messages = [r.json()["choices"][0]["message"]]
    assert messages and not any(m.get("reasoning_content") or m.get("reasoning")
                                for m in messages)
    [call] = reasoning_gw.calls(rollout["rollout_id"])
    assert call["status"] == "ok", call["error"]
    assert call["requested"]["include_reasoning"] is False
    assert 0 < len(call["completion_ids"]) == len(call["logprobs"]) == len(call["versions"])
    assert call["response"]["usage"]["completion_tokens"] == len(call["completion_ids"])
