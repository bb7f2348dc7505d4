"""Chat completions through the real gateway to the real vLLM, with the official `openai` SDK:
every call lands in Postgres with the engine's own token ids and aligned logprobs."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.support.detokenize import engine_text

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["paris", "oslo", "lima"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
        # Strict: vLLM constrains the arguments to the schema, so even the random tiny model
        # produces a valid call (within a few hundred tokens: the grammar allows whitespace).
        "strict": True,
    },
}]
FORCE_TOOL = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def tokenizer(vllm_server):
    return AutoTokenizer.from_pretrained(vllm_server.model_dir)


def client_for(gateway, rollout: dict) -> openai.OpenAI:
    return openai.OpenAI(base_url=rollout["openai_base_url"], api_key=rollout["api_key"],
                         max_retries=0, timeout=120)


def engine_prompt_ids(vllm_server, messages, tools=None, generation=True) -> list[int]:
    """The engine's own rendering of `messages`, asked of vLLM directly (not through us)."""
    body = {"model": vllm_server.model, "messages": messages,
            "add_generation_prompt": generation}
    if tools:
        body["tools"] = tools
    r = httpx.post(vllm_server.url + "/tokenize", json=body, timeout=30)
    r.raise_for_status()
    return r.json()["tokens"]


def assert_faithful(call: dict, text: str, tokenizer, engine_prompt: list[int]) -> None:
    assert call["status"] == "ok"
    assert call["prompt_ids"] == engine_prompt
    assert engine_text(tokenizer, call) == text
    assert len(call["logprobs"]) == len(call["completion_ids"]) > 0
    assert all(lp <= 0 for lp in call["logprobs"])
    assert len(call["versions"]) == len(call["completion_ids"])


def test_non_streaming_chat_is_recorded_token_for_token(gateway, vllm_server, tokenizer):
    rollout = gateway.new_rollout(task_id="t-chat")
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Say hello."}]
    resp = client_for(gateway, rollout).chat.completions.create(
        model=vllm_server.model, messages=messages, max_tokens=24, temperature=0.2, top_p=0.5)
    text = resp.choices[0].message.content or ""
    # The capture fields the gateway asked for do not leak to a client that did not ask.
    assert "prompt_token_ids" not in resp.model_extra
    assert resp.choices[0].logprobs is None
    [call] = gateway.calls(rollout["rollout_id"])
    assert_faithful(call, text, tokenizer, engine_prompt_ids(vllm_server, messages))
    assert call["requested"] == {"temperature": 0.2, "top_p": 0.5}
    assert call["applied"]["temperature"] == 1.0 and call["applied"]["top_p"] == 1.0
    assert call["finish_reason"] == resp.choices[0].finish_reason
    assert call["request"]["messages"] == messages


def test_streaming_chat_is_recorded_token_for_token(gateway, vllm_server, tokenizer):
    rollout = gateway.new_rollout(task_id="t-stream")
    messages = [{"role": "user", "content": "Count to five."}]
    stream = client_for(gateway, rollout).chat.completions.create(
        model=vllm_server.model, messages=messages, max_tokens=32, stream=True,
        stream_options={"include_usage": True})
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    text = "".join(pieces)
    [call] = gateway.calls(rollout["rollout_id"])
    assert_faithful(call, text, tokenizer, engine_prompt_ids(vllm_server, messages))
    assert usage.completion_tokens == len(call["completion_ids"])
    assert usage.prompt_tokens == len(call["prompt_ids"])
    assert call["finish_reason"] == finish
    assert call["ttft_ms"] is not None and call["ttft_ms"] <= call["latency_ms"]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_using_multi_turn_conversation(gateway, vllm_server, tokenizer, stream):
    rollout = gateway.new_rollout(task_id="t-tools")
    client = client_for(gateway, rollout)
    messages = [{"role": "system", "content": "Use the tools."},
                {"role": "user", "content": "Weather in Oslo?"}]

    def turn(tool_choice) -> tuple[dict, str]:
        kwargs = dict(model=vllm_server.model, messages=messages, tools=TOOLS,
                      tool_choice=tool_choice, max_tokens=400, parallel_tool_calls=False)
        if not stream:
            msg = client.chat.completions.create(**kwargs).choices[0].message
            calls = [tc.model_dump() for tc in msg.tool_calls or ()]
            return {"role": "assistant", "content": msg.content, "tool_calls": calls or None}, (
                msg.content or "")
        content, calls = [], {}
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                content.append(choice.delta.content or "")
                for tc in choice.delta.tool_calls or ():
                    slot = calls.setdefault(tc.index, {"id": None, "type": "function",
                                                       "function": {"name": "", "arguments": ""}})
                    slot["id"] = tc.id or slot["id"]
                    if tc.function and tc.function.name:
                        slot["function"]["name"] += tc.function.name
                    if tc.function and tc.function.arguments:
                        slot["function"]["arguments"] += tc.function.arguments
        text = "".join(content)
        return {"role": "assistant", "content": text or None,
                "tool_calls": [calls[i] for i in sorted(calls)] or None}, text

    prompts = [engine_prompt_ids(vllm_server, messages, TOOLS)]
    assistant, _ = turn(FORCE_TOOL)
    assert assistant["tool_calls"], "the forced tool call came back as a tool call"
    call_json = assistant["tool_calls"][0]
    assert call_json["function"]["name"] == "get_weather"
    assert json.loads(call_json["function"]["arguments"])["city"] in ("paris", "oslo", "lima")
    messages.append({k: v for k, v in assistant.items() if v is not None})
    turn_render = engine_prompt_ids(vllm_server, messages, TOOLS, generation=False)
    messages.append({"role": "tool", "tool_call_id": call_json["id"], "content": "sunny, 21 C"})
    prompts.append(engine_prompt_ids(vllm_server, messages, TOOLS))
    _, second_text = turn("none")

    first, second = gateway.calls(rollout["rollout_id"])
    assert [first["seq"], second["seq"]] == [1, 2]
    assert first["offered_tools"] and second["offered_tools"]
    assert first["prompt_ids"] == prompts[0]
    assert first["finish_reason"] in ("tool_calls", "stop")
    assert first["response"]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    # Exact continuation: the engine saw the first call's own prompt and sampled ids, the
    # template's end of that assistant turn, then the newly rendered tool result.
    first_full = first["prompt_ids"] + first["completion_ids"]
    tail = prompts[1][len(turn_render):]
    glue = second["prompt_ids"][len(first_full): len(second["prompt_ids"]) - len(tail)]
    assert second["continuation"]["path"] == "exact"
    assert 1 <= len(glue) <= 2 and turn_render[-len(glue):] == glue
    assert_faithful(second, second_text, tokenizer, first_full + glue + tail)
    # Linear storage: the second call stores only what follows its shared prefix with the first.
    assert second["base_call_id"] == first["call_id"]
    assert second["stored_prompt_tokens"] < second["prompt_tokens"]


def test_models_lists_the_served_model(gateway, vllm_server):
    rollout = gateway.new_rollout()
    models = client_for(gateway, rollout).models.list()
    assert [m.id for m in models.data] == [vllm_server.model]


def test_legacy_completions_record_engine_tokens(gateway, vllm_server, tokenizer):
    rollout = gateway.new_rollout()
    client = client_for(gateway, rollout)
    resp = client.completions.create(model=vllm_server.model, prompt="def add(a, b):",
                                     max_tokens=16)
    [call] = gateway.calls(rollout["rollout_id"])
    assert call["protocol"] == "completions"
    assert call["prompt_ids"] == tokenizer("def add(a, b):")["input_ids"]
    assert engine_text(tokenizer, call) == resp.choices[0].text
    assert len(call["logprobs"]) == len(call["completion_ids"])


def test_default_output_cap_applies_only_when_the_harness_sets_none(
    vllm_server, database_url, tmp_path
):
    from tests.support.gateway import GatewayProcess

    gw = GatewayProcess([vllm_server.url], database_url, "--default-max-tokens", "5",
                        log_path=tmp_path / "gw.log").start()
    try:
        rollout = gw.new_rollout()
        client = client_for(gw, rollout)
        messages = [{"role": "user", "content": "Go on forever."}]
        client.chat.completions.create(model=vllm_server.model, messages=messages,
                                       extra_body={"min_tokens": 5})
        client.chat.completions.create(model=vllm_server.model, messages=messages, max_tokens=9,
                                       extra_body={"min_tokens": 9})
        capped, own = gw.calls(rollout["rollout_id"])
        assert len(capped["completion_ids"]) == 5 and capped["applied"]["max_tokens"] == 5
        assert len(own["completion_ids"]) == 9 and "max_tokens" not in own["applied"]
    finally:
        gw.stop()
