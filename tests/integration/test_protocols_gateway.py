"""Anthropic Messages, OpenAI Responses and legacy completions through the real gateway to the
real vLLM (tiny model), with the official SDKs as clients: every call is recorded with the
engine's own prompt ids, sampled ids that decode to exactly what the client received, and aligned
logprobs; the SDKs' stream parsers accept every stream.

Also: the live event order of each protocol's stream, field by field, as the protocols' own
references describe it (Anthropic "Streaming Messages"; OpenAI Responses streaming events; chat
and legacy completion chunks); bad input per protocol (the protocol's error shape, nothing
trained); and a prompt over the engine's context length (each protocol's "prompt too long").

Getting a valid tool call out of the random tiny model: a strict tool (Anthropic and OpenAI both
have `strict: true` on a tool definition; vLLM then holds the arguments to the schema), forced
with `tool_choice`, no parallel calls, and a few hundred output tokens (the grammar allows any
whitespace between JSON tokens).
"""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import openai
import pytest

from tests.support.detokenize import engine_text
from tests.support.vllm import TINY_MAX_MODEL_LEN

CITIES = ["paris", "oslo", "lima"]
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": CITIES}},
    "required": ["city"],
    "additionalProperties": False,
}
ANTHROPIC_TOOL = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": WEATHER_SCHEMA,
    "strict": True,
}
ANTHROPIC_FORCE = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
RESPONSES_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": WEATHER_SCHEMA,
    "strict": True,
}
RESPONSES_FORCE = {"type": "function", "name": "get_weather"}
# The chat form both translate to: what the engine's chat template renders.
CHAT_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": WEATHER_SCHEMA,
        "strict": True,
    },
}
TOOL_TOKENS = 400
TOOL_CALL = re.compile(r"^\s*<tool_call>(.*)</tool_call>\s*$", re.DOTALL)


# -- clients and checks ------------------------------------------------------------------------


def anthropic_client(rollout: dict) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=rollout["anthropic_base_url"], api_key=rollout["api_key"],
                               max_retries=0, timeout=180)


def openai_client(rollout: dict) -> openai.OpenAI:
    return openai.OpenAI(base_url=rollout["openai_base_url"], api_key=rollout["api_key"],
                         max_retries=0, timeout=180)


def engine_prompt_ids(vllm_server, messages: list[dict], tools: list[dict] | None = None
                      ) -> list[int]:
    """The engine's own rendering of a chat conversation, asked of vLLM directly."""
    body = {"model": vllm_server.model, "messages": messages, "add_generation_prompt": True}
    if tools:
        body["tools"] = tools
    r = httpx.post(vllm_server.url + "/tokenize", json=body, timeout=60)
    r.raise_for_status()
    return r.json()["tokens"]


def assert_aligned(call: dict, protocol: str) -> None:
    """A recorded call with sampled ids and their per-token logprobs and versions."""
    assert call["status"] == "ok", call["error"]
    assert call["protocol"] == protocol
    assert len(call["completion_ids"]) > 0
    assert len(call["logprobs"]) == len(call["completion_ids"])
    assert all(lp <= 0 for lp in call["logprobs"])
    assert len(call["versions"]) == len(call["completion_ids"])


def assert_recorded(call: dict, protocol: str, prompt_ids: list[int]) -> None:
    """A first turn: the recorded prompt is the engine's own rendering of the conversation."""
    assert_aligned(call, protocol)
    assert call["prompt_ids"] == prompt_ids


def assert_continues(call: dict, protocol: str, parent: dict, engine_full: list[int]) -> None:
    """A later turn (exact continuation): the engine saw exactly the tokens it sampled for the
    parent call, then its own rendering of what the request added, which is therefore a suffix
    of the engine's rendering of the whole conversation."""
    assert_aligned(call, protocol)
    head = parent["prompt_ids"] + parent["completion_ids"]
    # The continuation record says why a call was not exact, should the tiny model's sample
    # ever make it so.
    assert call["prompt_ids"][: len(head)] == head, (call["continuation"], parent.get("response"))
    tail = call["prompt_ids"][len(head):]
    assert tail and engine_full[-len(tail):] == tail
    assert call["base_call_id"] == parent["call_id"]


def decoded(tokenizer, call: dict) -> str:
    return engine_text(tokenizer, call)


def decoded_tool_call(tokenizer, call: dict) -> dict:
    """The sampled ids of a tool call, decoded: `<tool_call>{"name": .., "arguments": ..}`."""
    text = engine_text(tokenizer, call, skip_special_tokens=False)
    match = TOOL_CALL.match(text)
    assert match, text
    return json.loads(match[1])


def assert_in_pieces(deltas: int, call: dict) -> None:
    """Text streams as it is sampled, not in one piece at the end. (A reply the random model
    ends after one or two tokens, about 1 in 500, has nothing to show.)"""
    if len(call["completion_ids"]) > 2:
        assert deltas > 1


def terminal_response(events: list):
    """The response of a stream's last event. A stream cut by `max_output_tokens` ends with
    `response.incomplete`, for which the SDK's `get_final_response()` has no answer."""
    assert events[-1].type in ("response.completed", "response.incomplete"), events[-1].type
    return events[-1].response


def only_call(gateway, rollout: dict) -> dict:
    [call] = gateway.calls(rollout["rollout_id"])
    return call


def read_sse(resp: httpx.Response) -> list[tuple[str | None, object]]:
    """(event name, decoded data) of each server-sent event; `[DONE]` stays a string."""
    events: list[tuple[str | None, object]] = []
    name, data = None, []
    for line in resp.iter_lines():
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())
        elif not line and data:
            text = "\n".join(data)
            events.append((name, text if text == "[DONE]" else json.loads(text)))
            name, data = None, []
    assert not data, "stream ended inside an event"
    return events


def stream_raw(rollout: dict, path: str, body: dict) -> list[tuple[str | None, object]]:
    headers = {"Authorization": f"Bearer {rollout['api_key']}"}
    base = rollout["anthropic_base_url"]
    with httpx.stream("POST", base + path, json=body, headers=headers, timeout=180) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        return read_sse(resp)


# -- Anthropic Messages with the `anthropic` SDK -------------------------------------------------


def test_anthropic_message_is_recorded_token_for_token(gateway, vllm_server, tiny_tokenizer):
    rollout = gateway.new_rollout(task_id="anthropic-whole")
    msg = anthropic_client(rollout).messages.create(
        model=vllm_server.model, max_tokens=24, system="You are terse.",
        extra_body={"temperature": 0.3},
        messages=[{"role": "user", "content": "Say hello."}])
    text = "".join(b.text for b in msg.content if b.type == "text")
    call = only_call(gateway, rollout)
    prompt = engine_prompt_ids(vllm_server, [{"role": "system", "content": "You are terse."},
                                             {"role": "user", "content": "Say hello."}])
    assert_recorded(call, "anthropic", prompt)
    assert decoded(tiny_tokenizer, call) == text
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[call["finish_reason"]]
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (
        len(call["prompt_ids"]), len(call["completion_ids"]))
    assert msg.id.startswith("msg_") and msg.role == "assistant" and msg.model == vllm_server.model
    # The harness's sampling settings stay in the recorded request; the policy's were applied.
    assert call["request"]["temperature"] == 0.3 and call["applied"]["temperature"] == 1.0


def test_anthropic_stream_is_recorded_token_for_token(gateway, vllm_server, tiny_tokenizer):
    rollout = gateway.new_rollout(task_id="anthropic-stream")
    messages = [{"role": "user", "content": "Count to five."}]
    with anthropic_client(rollout).messages.stream(
            model=vllm_server.model, max_tokens=32, messages=messages) as stream:
        deltas = [e.delta.text for e in stream
                  if e.type == "content_block_delta" and e.delta.type == "text_delta"]
        final = stream.get_final_message()
    text = "".join(deltas)
    assert "".join(b.text for b in final.content if b.type == "text") == text
    call = only_call(gateway, rollout)
    assert_recorded(call, "anthropic", engine_prompt_ids(vllm_server, messages))
    assert decoded(tiny_tokenizer, call) == text
    assert_in_pieces(len(deltas), call)
    assert final.usage.output_tokens == len(call["completion_ids"])
    assert final.usage.input_tokens == len(call["prompt_ids"])
    assert call["ttft_ms"] is not None and call["ttft_ms"] <= call["latency_ms"]


def test_anthropic_tool_use_round_trip(gateway, vllm_server, tiny_tokenizer):
    rollout = gateway.new_rollout(task_id="anthropic-tools")
    client = anthropic_client(rollout)
    system = "Use the tools."
    messages: list[dict] = [{"role": "user", "content": "Weather in Oslo?"}]
    first = client.messages.create(model=vllm_server.model, max_tokens=TOOL_TOKENS, system=system,
                                   messages=messages, tools=[ANTHROPIC_TOOL],
                                   tool_choice=ANTHROPIC_FORCE)
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input["city"] in CITIES
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "sunny, 21 C"}]},
    ]
    with client.messages.stream(model=vllm_server.model, max_tokens=16, system=system,
                                messages=messages, tools=[ANTHROPIC_TOOL],
                                tool_choice={"type": "none"}) as stream:
        second = stream.get_final_message()
    # The random tiny model may end at once: then, as Anthropic's API, no text block at all.
    second_text = "".join(b.text for b in second.content if b.type == "text")

    one, two = gateway.calls(rollout["rollout_id"])
    chat = [{"role": "system", "content": system}, {"role": "user", "content": "Weather in Oslo?"}]
    assert_recorded(one, "anthropic", engine_prompt_ids(vllm_server, chat, [CHAT_TOOL]))
    assert decoded_tool_call(tiny_tokenizer, one) == {"name": "get_weather",
                                                      "arguments": use.input}
    chat += [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": use.id, "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "sunny, 21 C"},
    ]
    assert_continues(two, "anthropic", one, engine_prompt_ids(vllm_server, chat, [CHAT_TOOL]))
    assert decoded(tiny_tokenizer, two) == second_text
    assert one["offered_tools"] and two["offered_tools"]


def test_anthropic_count_tokens_is_the_engine_prompt_length(gateway, vllm_server):
    rollout = gateway.new_rollout(task_id="anthropic-count")
    client = anthropic_client(rollout)
    kwargs = dict(model=vllm_server.model, system="You are terse.", tools=[ANTHROPIC_TOOL],
                  messages=[{"role": "user", "content": "Weather in Lima?"}])
    counted = client.messages.count_tokens(**kwargs)
    assert gateway.calls(rollout["rollout_id"]) == [], "counting is not a model call"
    client.messages.create(max_tokens=1, **kwargs)
    call = only_call(gateway, rollout)
    assert counted.input_tokens == len(call["prompt_ids"]) == len(engine_prompt_ids(
        vllm_server, [{"role": "system", "content": "You are terse."},
                      {"role": "user", "content": "Weather in Lima?"}], [CHAT_TOOL]))


def test_anthropic_mid_conversation_system_message(gateway, vllm_server, tiny_tokenizer):
    """Claude Code 2.1.197 sends `role: system` messages after a user turn (Anthropic's
    mid-conversation system messages); they stay system messages at their place."""
    rollout = gateway.new_rollout(task_id="anthropic-system")
    messages = [{"role": "user", "content": "Hi."},
                {"role": "system", "content": [{"type": "text", "text": "Agents: none."}]}]
    msg = anthropic_client(rollout).messages.create(model=vllm_server.model, max_tokens=8,
                                                    system="Be brief.", messages=messages)
    call = only_call(gateway, rollout)
    assert_recorded(call, "anthropic", engine_prompt_ids(vllm_server, [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."},
        {"role": "system", "content": "Agents: none."}]))
    assert decoded(tiny_tokenizer, call) == "".join(b.text for b in msg.content)


# -- OpenAI Responses and legacy completions with the `openai` SDK -------------------------------


def test_responses_whole_is_recorded_token_for_token(gateway, vllm_server, tiny_tokenizer):
    rollout = gateway.new_rollout(task_id="responses-whole")
    resp = openai_client(rollout).responses.create(
        model=vllm_server.model, instructions="You are terse.", input="Say hello.",
        max_output_tokens=24, temperature=0.4)
    call = only_call(gateway, rollout)
    assert_recorded(call, "responses", engine_prompt_ids(vllm_server, [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hello."}]))
    assert decoded(tiny_tokenizer, call) == resp.output_text
    assert resp.status == {"length": "incomplete", "stop": "completed"}[call["finish_reason"]]
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (
        len(call["prompt_ids"]), len(call["completion_ids"]))
    assert call["requested"] == {"temperature": 0.4}


def test_responses_stream_is_recorded_token_for_token(gateway, vllm_server, tiny_tokenizer):
    rollout = gateway.new_rollout(task_id="responses-stream")
    with openai_client(rollout).responses.stream(
            model=vllm_server.model, input="Count to five.", max_output_tokens=32) as stream:
        events = list(stream)
    final = terminal_response(events)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    text = "".join(deltas)
    assert final.output_text == text
    call = only_call(gateway, rollout)
    assert_recorded(call, "responses", engine_prompt_ids(
        vllm_server, [{"role": "user", "content": "Count to five."}]))
    assert decoded(tiny_tokenizer, call) == text
    assert_in_pieces(len(deltas), call)
    assert final.usage.output_tokens == len(call["completion_ids"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_function_call_round_trip(gateway, vllm_server, tiny_tokenizer, stream):
    rollout = gateway.new_rollout(task_id="responses-tools")
    client = openai_client(rollout)
    inputs: list = [{"role": "user", "content": "Weather in Oslo?"}]
    kwargs = dict(model=vllm_server.model, instructions="Use the tools.", tools=[RESPONSES_TOOL],
                  parallel_tool_calls=False)

    def respond(tool_choice, max_output_tokens):
        if not stream:
            return client.responses.create(input=inputs, tool_choice=tool_choice,
                                           max_output_tokens=max_output_tokens, **kwargs)
        with client.responses.stream(input=inputs, tool_choice=tool_choice,
                                     max_output_tokens=max_output_tokens, **kwargs) as s:
            return terminal_response(list(s))

    first = respond(RESPONSES_FORCE, TOOL_TOKENS)
    [fc] = [item for item in first.output if item.type == "function_call"]
    assert fc.name == "get_weather" and json.loads(fc.arguments)["city"] in CITIES
    inputs += [*first.output, {"type": "function_call_output", "call_id": fc.call_id,
                               "output": "sunny, 21 C"}]
    second = respond("none", 16)

    one, two = gateway.calls(rollout["rollout_id"])
    chat = [{"role": "system", "content": "Use the tools."},
            {"role": "user", "content": "Weather in Oslo?"}]
    assert_recorded(one, "responses", engine_prompt_ids(vllm_server, chat, [CHAT_TOOL]))
    assert decoded_tool_call(tiny_tokenizer, one) == {
        "name": "get_weather", "arguments": json.loads(fc.arguments)}
    chat += [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": fc.call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": fc.arguments}}]},
        {"role": "tool", "tool_call_id": fc.call_id, "content": "sunny, 21 C"},
    ]
    assert_continues(two, "responses", one, engine_prompt_ids(vllm_server, chat, [CHAT_TOOL]))
    assert decoded(tiny_tokenizer, two) == second.output_text


def test_responses_previous_response_id_chain(gateway, vllm_server, tiny_tokenizer):
    """Each request sends only its new input; the gateway rebuilds the conversation from the
    stored chain, and the engine sees exactly that conversation."""
    rollout = gateway.new_rollout(task_id="responses-chain")
    client = openai_client(rollout)
    chat = [{"role": "system", "content": "Be terse."}]
    previous, parent = None, None
    for turn in ("Say hi.", "Again.", "Once more."):
        resp = client.responses.create(model=vllm_server.model, instructions="Be terse.",
                                       input=turn, previous_response_id=previous,
                                       max_output_tokens=8)
        assert resp.previous_response_id == previous
        chat.append({"role": "user", "content": turn})
        call = gateway.calls(rollout["rollout_id"])[-1]
        if parent is None:
            assert_recorded(call, "responses", engine_prompt_ids(vllm_server, chat))
        else:
            assert_continues(call, "responses", parent, engine_prompt_ids(vllm_server, chat))
        assert decoded(tiny_tokenizer, call) == resp.output_text
        chat.append({"role": "assistant", "content": resp.output_text})
        previous, parent = resp.id, call
    assert len(gateway.calls(rollout["rollout_id"])) == 3

    # Another rollout cannot continue this rollout's conversation.
    other = gateway.new_rollout(task_id="responses-chain-other")
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client(other).responses.create(model=vllm_server.model, input="Hi.",
                                              previous_response_id=previous, max_output_tokens=4)
    assert caught.value.body["param"] == "previous_response_id"
    assert gateway.calls(other["rollout_id"]) == []


@pytest.mark.parametrize("prompt", ["def add(a, b):", [100, 200, 300, 400]],
                         ids=["text", "token-ids"])
def test_legacy_completions_stream(gateway, vllm_server, tiny_tokenizer, prompt):
    rollout = gateway.new_rollout(task_id="completions-stream")
    stream = openai_client(rollout).completions.create(
        model=vllm_server.model, prompt=prompt, max_tokens=16, stream=True,
        stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in stream:
        pieces += [c.text for c in chunk.choices]
        usage = chunk.usage or usage
    call = only_call(gateway, rollout)
    ids = prompt if isinstance(prompt, list) else tiny_tokenizer(prompt)["input_ids"]
    assert_recorded(call, "completions", ids)
    assert decoded(tiny_tokenizer, call) == "".join(pieces)
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        len(call["prompt_ids"]), len(call["completion_ids"]))


# -- conformance of the live streams -------------------------------------------------------------


def _anthropic_flow(events: list) -> tuple[list[dict], dict]:
    """Checks Anthropic's documented event flow: message_start; per content block a
    content_block_start, deltas and content_block_stop with consecutive indices; message_delta;
    message_stop; `ping` anywhere. Returns the blocks (with their deltas) and message_delta."""
    for name, data in events:
        assert name == data["type"], "the SSE event name repeats the payload's type"
    flow = [data for _, data in events if data["type"] != "ping"]
    start, *middle, delta, stop = flow
    assert start["type"] == "message_start"
    message = start["message"]
    assert message["id"].startswith("msg_")
    assert (message["type"], message["role"], message["content"]) == ("message", "assistant", [])
    assert message["stop_reason"] is None and message["stop_sequence"] is None
    assert set(message["usage"]) >= {"input_tokens", "output_tokens"}
    assert delta["type"] == "message_delta" and stop == {"type": "message_stop"}
    assert set(delta["delta"]) == {"stop_reason", "stop_sequence"}
    assert isinstance(delta["usage"]["output_tokens"], int)
    blocks: list[dict] = []
    for event in middle:
        kind = event["type"]
        if kind == "content_block_start":
            assert event["index"] == len(blocks)
            assert not blocks or blocks[-1]["stopped"]
            blocks.append({"block": event["content_block"], "deltas": [], "stopped": False})
            continue
        current = blocks[-1]
        assert event["index"] == len(blocks) - 1 and not current["stopped"]
        if kind == "content_block_delta":
            current["deltas"].append(event["delta"])
        else:
            assert kind == "content_block_stop", kind
            current["stopped"] = True
    assert all(b["stopped"] for b in blocks)
    return blocks, delta


def test_anthropic_text_stream_events(gateway, vllm_server, tiny_tokenizer):
    rollout = gateway.new_rollout(task_id="conformance")
    events = stream_raw(rollout, "/v1/messages", {
        "model": vllm_server.model, "max_tokens": 16, "stream": True,
        "messages": [{"role": "user", "content": "Hello"}]})
    blocks, delta = _anthropic_flow(events)
    [text_block] = blocks
    assert text_block["block"] == {"type": "text", "text": ""}
    assert {d["type"] for d in text_block["deltas"]} == {"text_delta"}
    call = only_call(gateway, rollout)
    assert "".join(d["text"] for d in text_block["deltas"]) == decoded(tiny_tokenizer, call)
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert delta["usage"]["output_tokens"] == len(call["completion_ids"])
    assert events[0][1]["message"]["usage"]["input_tokens"] == len(call["prompt_ids"])


def test_anthropic_tool_use_stream_events(gateway, vllm_server):
    rollout = gateway.new_rollout(task_id="conformance")
    events = stream_raw(rollout, "/v1/messages", {
        "model": vllm_server.model, "max_tokens": TOOL_TOKENS, "stream": True,
        "messages": [{"role": "user", "content": "Weather?"}], "tools": [ANTHROPIC_TOOL],
        "tool_choice": ANTHROPIC_FORCE})
    blocks, delta = _anthropic_flow(events)
    [tool] = blocks
    block = tool["block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather"
    assert block["input"] == {} and block["id"]
    assert {d["type"] for d in tool["deltas"]} == {"input_json_delta"}
    assert len(tool["deltas"]) > 1, "arguments stream as they are generated"
    arguments = json.loads("".join(d["partial_json"] for d in tool["deltas"]))
    assert arguments["city"] in CITIES
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert only_call(gateway, rollout)["status"] == "ok"


def _responses_flow(events: list) -> list[dict]:
    for name, data in events:
        assert name == data["type"]
    payloads = [data for _, data in events]
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    created, in_progress = payloads[:2]
    assert created["type"] == "response.created" and in_progress["type"] == "response.in_progress"
    for p in (created, in_progress):
        resp = p["response"]
        assert resp["id"].startswith("resp_") and resp["object"] == "response"
        assert resp["status"] == "in_progress" and resp["output"] == []
    assert created["response"]["id"] == in_progress["response"]["id"]
    return payloads


def test_responses_text_stream_events(gateway, vllm_server, tiny_tokenizer):
    rollout = gateway.new_rollout(task_id="conformance")
    payloads = _responses_flow(stream_raw(rollout, "/v1/responses", {
        "model": vllm_server.model, "input": "Hello", "max_output_tokens": 16, "stream": True}))
    kinds = [p["type"] for p in payloads]
    n = kinds.count("response.output_text.delta")
    end = kinds[-1]
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * n,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        end]
    item_id = payloads[2]["item"]["id"]
    added = payloads[2]
    assert added["output_index"] == 0
    assert added["item"] == {"id": item_id, "type": "message", "status": "in_progress",
                             "role": "assistant", "content": []}
    assert payloads[3]["part"] == {"type": "output_text", "text": "", "annotations": []}
    text = "".join(p["delta"] for p in payloads[4:4 + n])
    for p in payloads[3:-1]:
        assert (p["item_id"] if "item_id" in p else p["item"]["id"]) == item_id
        assert p["output_index"] == 0
        if "content_index" in p:
            assert p["content_index"] == 0
    call = only_call(gateway, rollout)
    assert_in_pieces(n, call)
    assert text == decoded(tiny_tokenizer, call)
    assert payloads[4 + n]["text"] == text
    assert payloads[5 + n]["part"] == {"type": "output_text", "text": text, "annotations": []}
    final = payloads[-1]["response"]
    status = {"length": "incomplete", "stop": "completed"}[call["finish_reason"]]
    assert end == f"response.{status}" and final["status"] == status
    item = payloads[6 + n]["item"]
    assert item["content"] == [{"type": "output_text", "text": text, "annotations": []}]
    assert final["output"] == [item]
    if status == "incomplete":
        assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["usage"]["input_tokens"] == len(call["prompt_ids"])
    assert final["usage"]["output_tokens"] == len(call["completion_ids"])


def test_responses_function_call_stream_events(gateway, vllm_server):
    rollout = gateway.new_rollout(task_id="conformance")
    payloads = _responses_flow(stream_raw(rollout, "/v1/responses", {
        "model": vllm_server.model, "input": "Weather?", "max_output_tokens": TOOL_TOKENS,
        "stream": True, "tools": [RESPONSES_TOOL], "tool_choice": RESPONSES_FORCE,
        "parallel_tool_calls": False}))
    kinds = [p["type"] for p in payloads]
    n = kinds.count("response.function_call_arguments.delta")
    assert n > 1, "arguments stream as they are generated"
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        *["response.function_call_arguments.delta"] * n, "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    added = payloads[2]["item"]
    assert added["type"] == "function_call" and added["status"] == "in_progress"
    assert added["name"] == "get_weather" and added["arguments"] == "" and added["call_id"]
    arguments = "".join(p["delta"] for p in payloads[3:3 + n])
    assert all(p["item_id"] == added["id"] and p["output_index"] == 0
               for p in payloads[3:4 + n])
    assert payloads[3 + n]["arguments"] == arguments
    assert json.loads(arguments)["city"] in CITIES
    done = payloads[4 + n]["item"]
    assert done == {**added, "arguments": arguments, "status": "completed"}
    assert payloads[-1]["response"]["output"] == [done]
    assert payloads[-1]["response"]["status"] == "completed"
    assert only_call(gateway, rollout)["status"] == "ok"


def _chat_chunks(events: list, obj: str) -> list[dict]:
    """OpenAI streaming chunks: `data:` only, one id throughout, ending with `[DONE]`."""
    assert all(name is None for name, _ in events)
    *chunks, done = [data for _, data in events]
    assert done == "[DONE]"
    assert {c["object"] for c in chunks} == {obj}
    assert len({c["id"] for c in chunks}) == 1
    assert not any("prompt_token_ids" in c or "token_ids" in json.dumps(c) for c in chunks), (
        "capture fields the client did not ask for stay in the gateway")
    usage = chunks[-1]
    assert usage["choices"] == [] and set(usage["usage"]) >= {"prompt_tokens",
                                                             "completion_tokens"}
    return chunks[:-1]


def test_chat_text_stream_chunks(gateway, vllm_server, tiny_tokenizer):
    rollout = gateway.new_rollout(task_id="conformance")
    chunks = _chat_chunks(stream_raw(rollout, "/v1/chat/completions", {
        "model": vllm_server.model, "max_tokens": 16, "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Hello"}]}), "chat.completion.chunk")
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert all(f is None for f in finishes[:-1]) and finishes[-1] in ("stop", "length")
    call = only_call(gateway, rollout)
    assert "".join(d.get("content") or "" for d in deltas) == decoded(tiny_tokenizer, call)
    assert finishes[-1] == call["finish_reason"]


def test_chat_tool_call_stream_chunks(gateway, vllm_server):
    rollout = gateway.new_rollout(task_id="conformance")
    chunks = _chat_chunks(stream_raw(rollout, "/v1/chat/completions", {
        "model": vllm_server.model, "max_tokens": TOOL_TOKENS, "stream": True,
        "stream_options": {"include_usage": True}, "tools": [CHAT_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
        "messages": [{"role": "user", "content": "Weather?"}]}), "chat.completion.chunk")
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or ()]
    first, *rest = calls
    assert first["index"] == 0 and first["id"] and first["type"] == "function"
    assert first["function"]["name"] == "get_weather"
    assert all(tc["index"] == 0 and tc.get("id") is None for tc in rest)
    fragments = [tc["function"].get("arguments") or "" for tc in calls]
    assert sum(bool(f) for f in fragments) > 1, "arguments stream as they are generated"
    assert json.loads("".join(fragments))["city"] in CITIES
    # A forced function ends with "stop" in OpenAI's API; "tool_calls" when the model chose.
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "tool_calls")


def test_completions_stream_chunks(gateway, vllm_server, tiny_tokenizer):
    rollout = gateway.new_rollout(task_id="conformance")
    chunks = _chat_chunks(stream_raw(rollout, "/v1/completions", {
        "model": vllm_server.model, "prompt": "def add(a, b):", "max_tokens": 16, "stream": True,
        "stream_options": {"include_usage": True}}), "text_completion")
    call = only_call(gateway, rollout)
    assert "".join(c["choices"][0]["text"] for c in chunks) == decoded(tiny_tokenizer, call)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert all(f is None for f in finishes[:-1]) and finishes[-1] == call["finish_reason"]


# -- bad input: the protocol's error shape, nothing trained --------------------------------------

USER = {"role": "user", "content": "Hi."}
ANTHROPIC_BAD = [
    ("wrong-block-type", {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
     "messages.0.content.0.type"),
    ("tool-use-in-user-message", {"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]}]},
     "messages.0.content.0"),
    ("image-for-a-text-model", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
    ]}]}, "messages.0.content.0"),
    ("orphan-tool-result", {"messages": [USER, {"role": "assistant", "content": "Ok."},
                                         {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]},
     "messages.2.content.0.tool_use_id"),
    ("tool-schema-not-object", {"messages": [USER], "tools": [
        {"name": "f", "input_schema": {"type": "array"}}]}, "tools.0.input_schema.type"),
    ("server-tool", {"messages": [USER], "tools": [
        {"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ("forced-unknown-tool", {"messages": [USER], "tools": [ANTHROPIC_TOOL],
                             "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice.name"),
    ("system-message-first", {"messages": [{"role": "system", "content": "x"}, USER]},
     "messages.0.role"),
]
RESPONSES_BAD = [
    ("unknown-item-type", {"input": [{"type": "banana"}]}, "input[0].type"),
    ("wrong-content-part", {"input": [{"role": "user", "content": [
        {"type": "banana", "text": "x"}]}]}, "input[0].content[0].type"),
    ("image-for-a-text-model", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]},
     "input[0].content[0].type"),
    ("orphan-function-call-output", {"input": [
        USER, {"type": "function_call_output", "call_id": "call_9", "output": "x"}]},
     "input[1].call_id"),
    ("tool-schema-not-object", {"input": "Hi.", "tools": [
        {"type": "function", "name": "f", "parameters": {"type": "string"}}]},
     "tools[0].parameters.type"),
    ("unknown-tool-type", {"input": "Hi.", "tools": [{"type": "banana", "name": "f"}]},
     "tools[0].type"),
    ("forced-unknown-function", {"input": "Hi.", "tools": [RESPONSES_TOOL],
                                 "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice.name"),
    ("unknown-previous-response", {"input": "Hi.", "previous_response_id": "resp_nope"},
     "previous_response_id"),
]
# Chat and legacy completions are the engine's own protocols: the gateway checks the shape it
# needs and the engine validates the rest, so an engine-rejected request is recorded as a failed
# call (with the engine's message) and never trained.
ENGINE_CHECKED_BAD = [
    ("chat-wrong-content-part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "video", "video": "x"}]}]}),
    ("chat-unknown-tool-type", "/v1/chat/completions",
     {"messages": [USER], "tools": [{"type": "banana", "function": {"name": "f"}}]}),
    ("chat-tool-without-name", "/v1/chat/completions",
     {"messages": [USER], "tools": [{"type": "function", "function": {"parameters": {}}}]}),
    ("completions-unknown-token-id", "/v1/completions", {"prompt": [10**8]}),
    ("completions-prompt-object", "/v1/completions", {"prompt": {"text": "x"}}),
]
# Passed by chat.py to the engine, which runs them: see the report of issue 6.
CHAT_BAD_TOOL_INPUT = [
    ("chat-orphan-tool-result",
     {"messages": [USER, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]}),
    ("chat-invalid-tool-schema",
     {"messages": [USER], "tools": [{"type": "function", "function": {
         "name": "f", "parameters": {"type": "object", "properties": 5}}}]}),
]


def _with_good_call(gateway, vllm_server) -> tuple[dict, dict]:
    """A rollout holding one recorded, trainable call (it offered tools)."""
    rollout = gateway.new_rollout(task_id="bad-input")
    openai_client(rollout).chat.completions.create(
        model=vllm_server.model, max_tokens=2, tools=[CHAT_TOOL], tool_choice="none",
        messages=[{"role": "user", "content": "Before."}])
    return rollout, only_call(gateway, rollout)


def _nothing_trained_but(gateway, rollout: dict, good: dict) -> None:
    """Finish and merge the rollout: the good call is still intact and the only one trained."""
    calls = gateway.calls(rollout["rollout_id"])
    assert calls[0] == good
    for call in calls[1:]:
        assert call["status"] == "failed" and call["completion_tokens"] == 0, call
    assert gateway.finish(rollout["rollout_id"], 1.0).status_code == 200
    r = gateway.admin.get(f"/admin/rollouts/{rollout['rollout_id']}/traces")
    trained = [s for s in r.json()["sequences"] if not s["excluded"]]
    assert {c for s in trained for c in s["call_ids"]} == {good["call_id"]}
    assert sum(sum(s["loss_mask"]) for s in trained) == len(good["completion_ids"])


def _post(rollout: dict, path: str, body: dict, **headers) -> httpx.Response:
    return httpx.post(rollout["anthropic_base_url"] + path, json=body, timeout=60,
                      headers={"Authorization": f"Bearer {rollout['api_key']}", **headers})


@pytest.mark.parametrize("name,body,param", ANTHROPIC_BAD, ids=[c[0] for c in ANTHROPIC_BAD])
def test_anthropic_bad_input(gateway, vllm_server, name, body, param):
    rollout, good = _with_good_call(gateway, vllm_server)
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = _post(rollout, path, {"model": vllm_server.model, "max_tokens": 8, **body},
                  **{"anthropic-version": "2023-06-01"})
        assert r.status_code == 400, r.text
        assert r.json() == {"type": "error", "error": {
            "type": "invalid_request_error", "message": r.json()["error"]["message"]}}
        assert r.json()["error"]["message"].startswith(f"{param}:")
    # The SDK reads the same error.
    with pytest.raises(anthropic.BadRequestError) as caught:
        anthropic_client(rollout).messages.create(model=vllm_server.model, max_tokens=8, **body)
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert len(gateway.calls(rollout["rollout_id"])) == 1, "the engine was never asked"
    _nothing_trained_but(gateway, rollout, good)


@pytest.mark.parametrize("name,body,param", RESPONSES_BAD, ids=[c[0] for c in RESPONSES_BAD])
def test_responses_bad_input(gateway, vllm_server, name, body, param):
    rollout, good = _with_good_call(gateway, vllm_server)
    for stream in (False, True):
        r = _post(rollout, "/v1/responses", {"model": vllm_server.model, "stream": stream, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "invalid_request_error" and err["param"] == param
    assert len(gateway.calls(rollout["rollout_id"])) == 1, "the engine was never asked"
    _nothing_trained_but(gateway, rollout, good)


@pytest.mark.parametrize("name,path,body", ENGINE_CHECKED_BAD,
                         ids=[c[0] for c in ENGINE_CHECKED_BAD])
def test_engine_checked_bad_input(gateway, vllm_server, name, path, body):
    rollout, good = _with_good_call(gateway, vllm_server)
    r = _post(rollout, path, {"model": vllm_server.model, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    _nothing_trained_but(gateway, rollout, good)


@pytest.mark.parametrize("name,body", CHAT_BAD_TOOL_INPUT, ids=[c[0] for c in CHAT_BAD_TOOL_INPUT])
def test_chat_bad_tool_input(gateway, vllm_server, name, body):
    rollout, good = _with_good_call(gateway, vllm_server)
    r = _post(rollout, "/v1/chat/completions", {"model": vllm_server.model, "max_tokens": 2,
                                                 **body})
    assert r.status_code == 400, r.text
    _nothing_trained_but(gateway, rollout, good)


# -- a prompt over the engine's context length --------------------------------------------------


@pytest.fixture(scope="module")
def overlong_text(tiny_tokenizer) -> str:
    """Text of more tokens than the engine's max model length (hex numbers: about one token per
    character in the tiny tokenizer, so the body stays far under the gateway's size limit)."""
    text = " ".join(f"{i:x}" for i in range(TINY_MAX_MODEL_LEN // 4 + 2000))
    assert len(tiny_tokenizer(text)["input_ids"]) > TINY_MAX_MODEL_LEN
    return text


def _overflowed(gateway, rollout: dict) -> None:
    """The refused prompt is recorded as a failed call with no tokens: nothing to train."""
    calls = gateway.calls(rollout["rollout_id"])
    assert calls and all(c["status"] == "failed" and c["completion_tokens"] == 0 for c in calls)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic_prompt_too_long(gateway, vllm_server, overlong_text, stream):
    rollout = gateway.new_rollout(task_id="overflow")
    client = anthropic_client(rollout)
    kwargs = dict(model=vllm_server.model, max_tokens=8,
                  messages=[{"role": "user", "content": overlong_text}])
    with pytest.raises(anthropic.BadRequestError) as caught:
        if stream:
            with client.messages.stream(**kwargs) as s:
                s.get_final_message()
        else:
            client.messages.create(**kwargs)
    error = caught.value.body["error"]
    assert error["type"] == "invalid_request_error"
    # Anthropic's wording, which Claude Code matches to compact its conversation.
    match = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", error["message"])
    assert match and int(match[1]) > int(match[2]) == TINY_MAX_MODEL_LEN, error
    _overflowed(gateway, rollout)


@pytest.mark.parametrize("surface", ["responses", "chat", "completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_context_length_exceeded(gateway, vllm_server, overlong_text, surface, stream):
    rollout = gateway.new_rollout(task_id="overflow")
    client = openai_client(rollout)
    with pytest.raises(openai.BadRequestError) as caught:
        if surface == "responses":
            result = client.responses.create(model=vllm_server.model, input=overlong_text,
                                             max_output_tokens=8, stream=stream)
        elif surface == "chat":
            result = client.chat.completions.create(
                model=vllm_server.model, max_tokens=8, stream=stream,
                messages=[{"role": "user", "content": overlong_text}])
        else:
            result = client.completions.create(model=vllm_server.model, prompt=overlong_text,
                                               max_tokens=8, stream=stream)
        if stream:
            list(result)
    assert caught.value.code == "context_length_exceeded"
    assert caught.value.body["type"] == "invalid_request_error"
    _overflowed(gateway, rollout)
