"""Exact continuation through the real gateway and vLLM with the tiny model, from the official
SDKs: a request that continues an earlier call gets that call's engine prompt + sampled ids as
its prompt prefix, so a whole tool-using conversation merges into one training sequence.

The tiny model is a strict test: its sampled tool calls carry whatever whitespace the grammar
allowed, and random token sequences rarely survive decode-then-encode, so re-rendering the
conversation drifts at nearly every turn (see the `--continuation render` test)."""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid

import anthropic
import asyncpg
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from core.store import bodies
from core.store import calls as calls_store
from gateway.continuation.checked_render import CheckedRenderer
from gateway.continuation.engine_render import EngineRenderer
from gateway.continuation.local_template import LocalTemplate
from gateway.continuation.window import WINDOWS, WindowedRenderer
from gateway.protocols import resumable
from gateway.upstream import Upstreams
from tests.support.detokenize import engine_text
from tests.support.gateway import GatewayProcess
from tests.support.postgres import fresh_database

TOOL_PARAMETERS = {
    "type": "object",
    "required": ["cmd"],
    "additionalProperties": False,
    "properties": {"cmd": {"type": "string", "enum": ["ls", "pwd", "make"]}},
}
# Strict and forced: the random model then makes a valid call within a few hundred tokens.
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "Run a shell command",
            "parameters": TOOL_PARAMETERS,
            "strict": True,
        },
    }
]
FORCE = {"type": "function", "function": {"name": "run"}}
TURNS = 6


def _chat_client(rollout) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=rollout["openai_base_url"], api_key=rollout["api_key"], max_retries=0, timeout=120
    )


def _chat_turn(client, model, messages, stream: bool) -> dict:
    """One call; returns the assistant message as a harness keeps it for the next request."""
    kwargs = dict(
        model=model,
        messages=messages,
        tools=CHAT_TOOLS,
        tool_choice=FORCE,
        max_tokens=400,
        parallel_tool_calls=False,
    )
    if not stream:
        return (
            client.chat.completions.create(**kwargs)
            .choices[0]
            .message.model_dump(exclude_none=True)
        )
    content, calls = [], {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            for tc in choice.delta.tool_calls or ():
                slot = calls.setdefault(
                    tc.index,
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                slot["id"] = tc.id or slot["id"]
                if tc.function and tc.function.name:
                    slot["function"]["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    slot["function"]["arguments"] += tc.function.arguments
    msg = {"role": "assistant", "content": "".join(content)}
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg


def chat_conversation(
    gw, model, turns=TURNS, stream=False, system="You are an agent.", task="Build it."
):
    """A tool-using conversation with the openai SDK; returns (rollout, requests' messages)."""
    rollout = gw.new_rollout(task_id="continuation")
    client = _chat_client(rollout)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
    requests = []
    for turn in range(turns):
        requests.append(list(messages))
        reply = _chat_turn(client, model, messages, stream)
        messages.append(reply)
        for call in reply.get("tool_calls") or ():
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"ok {turn}"})
        if not reply.get("tool_calls"):
            messages.append({"role": "user", "content": f"go on {turn}"})
    return rollout, requests


def full(call: dict) -> list[int]:
    return call["prompt_ids"] + call["completion_ids"]


def plain_render(vllm_server, messages) -> list[int]:
    """What the engine renders for `messages` on its own (no continuation)."""
    body = {"model": vllm_server.model, "messages": messages, "tools": CHAT_TOOLS}
    r = httpx.post(vllm_server.url + "/tokenize", json=body, timeout=60)
    r.raise_for_status()
    return r.json()["tokens"]


def assert_one_exact_sequence(gw, rollout, turns=TURNS) -> list[dict]:
    """The rollout's calls chain exactly and merge into one trained sequence; returns them."""
    calls = gw.calls(rollout["rollout_id"])
    assert len(calls) == turns and all(c["status"] == "ok" for c in calls)
    assert calls[0]["continuation"] == {"path": "render", "reason": "first turn"}
    for prev, call in zip(calls, calls[1:]):
        # The engine's prompt for turn k+1 starts with turn k's prompt + sampled ids.
        assert call["prompt_ids"][: len(full(prev))] == full(prev)
        assert call["continuation"]["path"] == "exact"
        assert call["continuation"]["parent"] == prev["call_id"]
        assert call["base_call_id"] == prev["call_id"]
    finished = gw.finish(rollout["rollout_id"], 1.0)
    assert finished.status_code == 200, finished.text
    summary = finished.json()
    stats = summary["merge"]["stats"]
    assert stats["sequences"] == 1
    assert stats["causes"] == {"drift": 0, "rewrite": 0, "independent": 0, "abandoned": 0}
    sampled = sum(len(c["completion_ids"]) for c in calls)
    assert stats["trained_tokens"] == stats["sampled_tokens"] == sampled
    assert summary["continuation"] == {
        "exact": turns - 1,
        "render": 1,
        "fallback": 0,
        "reasons": {"render: first turn": 1},
    }
    [trace] = gw.admin.get(f"/admin/rollouts/{rollout['rollout_id']}/traces").json()["sequences"]
    assert trace["input_ids"] == full(calls[-1]) and sum(trace["loss_mask"]) == sampled
    return calls


@pytest.mark.parametrize("stream", [False, True])
def test_chat_conversation_is_one_sequence(gateway, vllm_server, stream):
    rollout, requests = chat_conversation(gateway, vllm_server.model, stream=stream)
    calls = assert_one_exact_sequence(gateway, rollout)
    # Strictness: plain rendering would have broken the chain at some turn.
    drifts = sum(
        plain_render(vllm_server, messages)[: len(full(prev))] != full(prev)
        for prev, messages in zip(calls, requests[1:])
    )
    assert drifts >= 1


def test_client_sees_the_engine_prompt_it_asked_for(gateway, vllm_server):
    rollout = gateway.new_rollout()
    client = _chat_client(rollout)
    messages = [{"role": "user", "content": "Build it."}]
    echoed = []
    for _ in range(3):
        resp = client.chat.completions.create(
            model=vllm_server.model,
            messages=messages,
            tools=CHAT_TOOLS,
            tool_choice=FORCE,
            max_tokens=400,
            parallel_tool_calls=False,
            extra_body={"return_token_ids": True},
        )
        echoed.append(resp.model_extra["prompt_token_ids"])
        reply = resp.choices[0].message.model_dump(exclude_none=True)
        messages += [
            reply,
            {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "ok"},
        ]
    # Recorded ids are the engine's own (invariant 1), also when the gateway chose them.
    assert [c["prompt_ids"] for c in gateway.calls(rollout["rollout_id"])] == echoed


@pytest.mark.parametrize("stream", [False, True])
def test_continued_calls_record_the_ids_the_engine_sampled(
    gateway, vllm_server, tiny_tokenizer, stream
):
    """An exact continuation's prompt is not echoed back to the gateway that sent it; its
    sampled ids are read from the logprob tokens instead, and must be those the client's text
    came from."""
    rollout = gateway.new_rollout()
    client = _chat_client(rollout)
    messages = [{"role": "user", "content": "Say something."}]
    texts = []
    for turn in range(3):
        kwargs = dict(model=vllm_server.model, messages=messages, max_tokens=24)
        if stream:
            chunks = client.chat.completions.create(stream=True, **kwargs)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = client.chat.completions.create(**kwargs).choices[0].message.content or ""
        texts.append(text)
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"more {turn}"},
        ]
    calls = gateway.calls(rollout["rollout_id"])
    assert [c["continuation"]["path"] for c in calls] == ["render", "exact", "exact"]
    for prev, call, text in zip([None, *calls], calls, texts):
        assert call["status"] == "ok"
        assert engine_text(tiny_tokenizer, call) == text
        assert len(call["logprobs"]) == len(call["completion_ids"]) > 0
        if prev is not None:
            assert call["prompt_ids"][: len(full(prev))] == full(prev)


def anthropic_conversation(gw, model, task="Build it."):
    """A tool-using conversation with the anthropic SDK (`/v1/messages`); returns the rollout."""
    rollout = gw.new_rollout(task_id="continuation-anthropic")
    client = anthropic.Anthropic(
        base_url=rollout["anthropic_base_url"],
        api_key=rollout["api_key"],
        max_retries=0,
        timeout=120,
    )
    tool = {
        "name": "run",
        "description": "Run a shell command",
        "input_schema": TOOL_PARAMETERS,
        "strict": True,
    }
    messages = [{"role": "user", "content": task}]
    for turn in range(TURNS):
        reply = client.messages.create(
            model=model,
            system="You are an agent.",
            messages=messages,
            tools=[tool],
            tool_choice={"type": "tool", "name": "run", "disable_parallel_tool_use": True},
            max_tokens=400,
        )
        messages.append(
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in reply.content],
            }
        )
        uses = [b for b in reply.content if b.type == "tool_use"]
        assert uses, reply.content
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": u.id, "content": f"ok {turn}"}
                    for u in uses
                ],
            }
        )
    return rollout


def responses_conversation(gw, model, chained=False, task="Build it."):
    """A tool-using conversation with the openai SDK's `responses.create` (function_call and
    function_call_output items), sending the whole conversation each time or, `chained`, only
    the new items with `previous_response_id`; returns the rollout."""
    rollout = gw.new_rollout(task_id="continuation-responses")
    client = _chat_client(rollout)
    tools = [
        {
            "type": "function",
            "name": "run",
            "description": "Run a shell command",
            "parameters": TOOL_PARAMETERS,
            "strict": True,
        }
    ]
    items: list = [{"role": "user", "content": task}]
    previous = None
    for turn in range(TURNS):
        resp = client.responses.create(
            model=model,
            instructions="You are an agent.",
            input=items,
            tools=tools,
            tool_choice={"type": "function", "name": "run"},
            parallel_tool_calls=False,
            max_output_tokens=400,
            **({"previous_response_id": previous} if previous else {}),
        )
        calls = [o for o in resp.output if o.type == "function_call"]
        assert calls, resp.output
        outputs = [
            {"type": "function_call_output", "call_id": fc.call_id, "output": f"ok {turn}"}
            for fc in calls
        ]
        if chained:
            previous, items = resp.id, outputs
        else:
            items = items + [o.model_dump(exclude_none=True) for o in resp.output] + outputs
    return rollout


CONVERSATIONS = {
    "chat": lambda gw, model, **kw: chat_conversation(gw, model, **kw)[0],
    "anthropic": anthropic_conversation,
    "responses": responses_conversation,
}


def test_anthropic_conversation_is_one_sequence(gateway, vllm_server):
    assert_one_exact_sequence(gateway, anthropic_conversation(gateway, vllm_server.model))


@pytest.mark.parametrize("chained", [False, True], ids=["full-input", "previous_response_id"])
def test_responses_conversation_is_one_sequence(gateway, vllm_server, chained):
    rollout = responses_conversation(gateway, vllm_server.model, chained)
    assert_one_exact_sequence(gateway, rollout)


# A task pasted whole, as agents' first prompts carry: bodies past resumable.MIN_BYTES.
LONG_TASK = "Build it.\n" + "".join(f"    step_{i} = compute({i})\n" for i in range(1000))


def _decodes(gw, protocol: str, how: str) -> float:
    text = gw.admin.get("/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "rolltap_request_decodes_total" and sample.labels == {
                "protocol": protocol,
                "how": how,
            }:
                return sample.value
    return 0.0


@pytest.mark.parametrize("protocol", list(CONVERSATIONS))
def test_long_conversations_are_decoded_from_the_previous_request(
    gateway, vllm_server, tiny_tokenizer, protocol
):
    # Each later body is decoded as the previous one's messages plus its own new ones: the
    # conversation still continues exactly, and each new turn reaches the engine.
    assert len(LONG_TASK) > resumable.MIN_BYTES
    before = _decodes(gateway, protocol, "resumed")
    rollout = CONVERSATIONS[protocol](gateway, vllm_server.model, task=LONG_TASK)
    calls = assert_one_exact_sequence(gateway, rollout)
    assert _decodes(gateway, protocol, "resumed") - before == TURNS - 1
    for turn, call in enumerate(calls[1:]):
        prompt = tiny_tokenizer.decode(call["prompt_ids"])
        assert prompt.count("step_999 = compute(999)") == 1
        assert all(f"ok {t}" in prompt for t in range(turn + 1))


def test_interleaved_sub_agents_each_continue_their_own_parent(gateway, vllm_server):
    rollout = gateway.new_rollout(task_id="continuation-sub-agents")
    client = _chat_client(rollout)
    agents = {
        name: [
            {"role": "system", "content": f"You are the {name} agent."},
            {"role": "user", "content": "Go."},
        ]
        for name in ("main", "helper")
    }
    order = []
    for _ in range(3):
        for name, messages in agents.items():  # main, helper, main, helper, ...
            reply = _chat_turn(client, vllm_server.model, messages, stream=False)
            messages += [
                reply,
                {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "ok"},
            ]
            order.append(name)
    calls = gateway.calls(rollout["rollout_id"])
    last: dict[str, dict] = {}
    for name, call in zip(order, calls):
        if name in last:
            assert call["continuation"]["path"] == "exact"
            assert call["continuation"]["parent"] == last[name]["call_id"]
            assert call["prompt_ids"][: len(full(last[name]))] == full(last[name])
        else:
            assert call["continuation"]["reason"] == "first turn"
        last[name] = call
    stats = gateway.finish(rollout["rollout_id"], 1.0).json()["merge"]["stats"]
    assert stats["sequences"] == 2
    assert stats["causes"] == {"drift": 0, "rewrite": 0, "independent": 1, "abandoned": 0}
    assert stats["lost_tokens"] == 0


def test_a_reply_cut_at_max_tokens_gets_its_end_of_turn_token(gateway, vllm_server, tiny_tokenizer):
    im_end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    for attempt in range(5):  # the random model may end a 3-token reply on its own
        rollout = gateway.new_rollout(task_id="continuation-length")
        client = _chat_client(rollout)
        messages = [{"role": "user", "content": f"Tell a long story, take {attempt}."}]
        for turn in range(2):
            reply = client.chat.completions.create(
                model=vllm_server.model, messages=messages, max_tokens=3
            ).choices[0]
            messages += [
                {"role": "assistant", "content": reply.message.content or ""},
                {"role": "user", "content": f"More {turn}."},
            ]
        first, second = gateway.calls(rollout["rollout_id"])
        if first["finish_reason"] == "length" and first["completion_ids"][-1] != im_end:
            break
    else:
        pytest.fail("no reply was cut at max_tokens in 5 attempts")
    head = full(first)
    assert second["continuation"]["path"] == "exact"
    # The engine sees the cut reply closed the way the template closes every assistant turn.
    assert second["prompt_ids"][: len(head) + 1] == head + [im_end]
    stats = gateway.finish(rollout["rollout_id"], 1.0).json()["merge"]["stats"]
    assert stats["sequences"] == 1 and stats["causes"]["drift"] == 0


def test_edited_history_continues_the_last_unedited_reply_and_forks_as_rewrite(
    gateway, vllm_server
):
    rollout, requests = chat_conversation(gateway, vllm_server.model, turns=3)
    first, second, third = gateway.calls(rollout["rollout_id"])
    # The harness rewrites the first tool result (a compaction, say): the second reply no longer
    # follows the conversation the request shows, the first one still does.
    edited = json.loads(json.dumps(requests[2]))
    edited[3]["content"] = "a summary of the output"
    _chat_turn(_chat_client(rollout), vllm_server.model, edited, stream=False)
    fourth = gateway.calls(rollout["rollout_id"])[3]
    assert fourth["continuation"]["path"] == "exact"
    assert fourth["continuation"]["parent"] == first["call_id"]
    assert fourth["continuation"]["messages"] == 3  # system, user, first reply
    assert fourth["prompt_ids"][: len(full(first))] == full(first)
    stats = gateway.finish(rollout["rollout_id"], 1.0).json()["merge"]["stats"]
    assert stats["sequences"] == 2
    assert stats["causes"] == {"drift": 0, "rewrite": 1, "independent": 0, "abandoned": 0}


@pytest.fixture
def own_database():
    """A database for one more gateway. Gateways sharing a database race when one merges a
    rollout it finished while another's deadline sweep merges it too (a unique violation on
    `traces`, a bug outside this feature); these tests keep their gateways apart."""
    dsn, drop = fresh_database()
    yield dsn
    drop()


@pytest.fixture(scope="module")
def render_gateway(vllm_server, tmp_path_factory):
    dsn, drop = fresh_database()
    gw = GatewayProcess(
        [vllm_server.url],
        dsn,
        "--continuation",
        "render",
        "--train-constrained",
        log_path=tmp_path_factory.mktemp("gw-render") / "gateway.log",
    )
    gw.start()
    yield gw
    gw.stop()
    drop()


@pytest.mark.parametrize("protocol", list(CONVERSATIONS))
def test_render_mode_forks_at_drifts_and_counts_them(render_gateway, vllm_server, protocol):
    gw = render_gateway
    rollout = CONVERSATIONS[protocol](gw, vllm_server.model)
    calls = gw.calls(rollout["rollout_id"])
    for prev, call in zip(calls, calls[1:]):
        # The parent is still recognised; the engine renders the conversation itself.
        assert call["continuation"]["path"] == "render"
        assert call["continuation"]["reason"] == "render configured"
        assert call["continuation"]["parent"] == prev["call_id"]
    drifts = sum(
        call["prompt_ids"][: len(full(prev))] != full(prev) for prev, call in zip(calls, calls[1:])
    )
    summary = gw.finish(rollout["rollout_id"], 1.0).json()
    stats = summary["merge"]["stats"]
    assert drifts >= 1
    assert stats["causes"]["drift"] == drifts
    assert stats["sequences"] == 1 + drifts
    assert summary["continuation"] == {
        "exact": 0,
        "render": TURNS,
        "fallback": 0,
        "reasons": {"render: first turn": 1, "render: render configured": TURNS - 1},
    }


def test_local_template_renders_in_the_gateway(vllm_server, own_database, tmp_path):
    gw = GatewayProcess(
        [vllm_server.url],
        own_database,
        "--local-template",
        str(vllm_server.model_dir),
        "--train-constrained",
        log_path=tmp_path / "gateway.log",
    ).start()
    try:
        rollout, _ = chat_conversation(gw, vllm_server.model, system="You are a local agent.")
        calls = assert_one_exact_sequence(gw, rollout)
    finally:
        gw.stop()
    # A new context (these tools) is checked against the engine once, then rendered locally.
    assert [c["continuation"]["rendered_by"] for c in calls[1:]] == ["engine"] + ["local"] * (
        TURNS - 2
    )
    # ...and in a window of the conversation once that gave the whole conversation's ids.
    assert [c["continuation"].get("window") for c in calls[1:]] == [None] + ["reply"] * (
        TURNS - 2
    )


def test_a_restarted_gateway_continues_from_the_database(vllm_server, own_database, tmp_path):
    gw = GatewayProcess([vllm_server.url], own_database, "--train-constrained",
                        log_path=tmp_path / "gateway.log").start()
    rollout = gw.new_rollout(task_id="continuation-restart")
    client = _chat_client(rollout)
    messages = [{"role": "system", "content": "Restart agent."}, {"role": "user", "content": "Go."}]

    def turn() -> None:
        reply = _chat_turn(client, vllm_server.model, messages, stream=False)
        messages.extend(
            [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "ok"}]
        )

    try:
        turn()
        turn()
        gw.kill()  # no memory of the rollout survives
        gw.start()
        turn()
        turn()
        assert_one_exact_sequence(gw, rollout, turns=4)
    finally:
        gw.stop()


# -- local rendering against the engine (in-process, real vLLM) --------------------------------


def _model_copy(src, dst, template_edit) -> LocalTemplate:
    """The tiny model's tokenizer with its chat template edited: a local template that renders
    differently from the engine (a fault this test provokes on purpose)."""
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["chat_template"] = template_edit(config["chat_template"])
    dst.mkdir()
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    return LocalTemplate.from_model_dir(dst)


def _continued(system: str, tool_name: str) -> tuple[dict, int]:
    tool = {**CHAT_TOOLS[0], "function": {**CHAT_TOOLS[0]["function"], "name": tool_name}}
    call = {"id": "c1", "type": "function", "function": {"name": tool_name, "arguments": "{}"}}
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Build it."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    return {"model": "tiny", "messages": messages, "tools": [tool]}, 3


async def test_local_template_is_used_only_where_it_reproduces_the_engine(vllm_server, tmp_path):
    ups = Upstreams([vllm_server.url], 60)
    await ups.open()
    engine = EngineRenderer(ups)
    try:
        same = CheckedRenderer(engine, LocalTemplate.from_model_dir(vllm_server.model_dir))
        assert await same.self_check(vllm_server.url, vllm_server.model) == "openai"
        body, upto = _continued("sys", "run")
        first, second = [await same.around(vllm_server.url, body, upto) for _ in range(2)]
        assert (first.by, second.by) == ("engine", "local") and first.same_ids(second)

        # A template that differs everywhere fails the self-check: the engine renders.
        off = CheckedRenderer(
            engine,
            _model_copy(vllm_server.model_dir, tmp_path / "off", lambda t: t + "{{ '.' }}"),
        )
        assert await off.self_check(vllm_server.url, vllm_server.model) is None
        assert (await off.around(vllm_server.url, body, upto)).by == "engine"

        # One that differs only with a tool the probes do not use (in how it renders tool
        # results) passes the self-check, and is caught by the check of the first request in
        # that context.
        secret = CheckedRenderer(
            engine,
            _model_copy(
                vllm_server.model_dir,
                tmp_path / "secret",
                lambda t: t.replace(
                    "'\\n</tool_response>'",
                    "('!' if tools and tools[0].function.name == 'secret' else '')"
                    " + '\\n</tool_response>'",
                ),
            ),
        )
        assert await secret.self_check(vllm_server.url, vllm_server.model) == "openai"
        body, upto = _continued("sys", "secret")
        answers = [await secret.around(vllm_server.url, body, upto) for _ in range(3)]
        assert [a.by for a in answers] == ["engine"] * 3
        assert secret.stats["mismatches"] == 1
        other, upto = _continued("sys", "run")
        assert [(await secret.around(vllm_server.url, other, upto)).by for _ in range(2)] == [
            "engine",
            "local",
        ]
    finally:
        await ups.close()


def _long_conversation(rounds: int, tool: str = "run") -> tuple[dict, int]:
    """A system prompt, a task, `rounds` tool calls with their results and one more call's
    result: a request continuing the last call, and the index just past that call's reply."""
    messages = [
        {"role": "system", "content": "You are a windowed agent."},
        {"role": "user", "content": "Build it, then test it."},
    ]
    for i in range(rounds + 1):
        call = {"id": f"c{i}", "type": "function",
                "function": {"name": tool, "arguments": json.dumps({"cmd": "make"})}}
        messages += [
            {"role": "assistant", "content": f"step {i}", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": f"output {i}\n" * 20},
        ]
    body = {"model": "tiny", "messages": messages, "tools": CHAT_TOOLS}
    return body, len(messages) - 1


class _SizedEngine(EngineRenderer):
    """The real engine renderer, noting the bytes of messages each render request carries."""

    def __init__(self, upstreams: Upstreams) -> None:
        super().__init__(upstreams)
        self.sent: list[int] = []

    async def _span(self, upstream, body):
        self.sent.append(len(bytes(body["messages"])))
        return await super()._span(upstream, body)


async def test_windowed_renders_give_the_whole_conversations_ids(vllm_server):
    ups = Upstreams([vllm_server.url], 60)
    await ups.open()
    try:
        engine = _SizedEngine(ups)
        windowed = WindowedRenderer(engine, sample_every=2)
        for rounds in (8, 12, 16):
            body, upto = _long_conversation(rounds)
            whole = await engine.around(vllm_server.url, body, upto)
            engine.sent.clear()
            answer = await windowed.around(vllm_server.url, body, upto)
            assert answer is not None and answer.same_ids(whole) and answer.tail == whole.tail
            assert answer.window == (None if rounds == 8 else "reply")
            if rounds == 8:  # a new context: rendered whole and windowed
                assert max(engine.sent) == len(json.dumps(body["messages"], separators=(",", ":")))
            else:  # then only the window: the frame, the reply and what follows it
                assert max(engine.sent) < 1000 < len(bytes(json.dumps(body["messages"]), "utf-8"))
        await asyncio.sleep(0.5)  # the background sample (every 2nd use) has answered
        assert windowed.stats == {"used": 2, "checked": 2, "mismatches": 0}
    finally:
        await ups.close()


class _LocalRenders:
    """Local rendering with a template of this test's choosing, in place of the engine: a
    template that numbers the messages renders a window differently (the fault provoked)."""

    def __init__(self, local: LocalTemplate) -> None:
        self._local = local

    async def around(self, upstream, body, upto, messages_json=None):
        return self._local.around(body, upto, "openai")


def test_a_template_that_windows_change_is_rendered_whole(vllm_server, tmp_path):
    numbered = _model_copy(
        vllm_server.model_dir,
        tmp_path / "numbered",
        lambda t: t.replace("'\\n<tool_response>\\n'", "'\\n<tool_response>' ~ loop.index ~ '\\n'"),
    )
    plain = _model_copy(vllm_server.model_dir, tmp_path / "plain", lambda t: t)

    async def go():
        for local, mismatches in ((plain, 0), (numbered, len(WINDOWS))):
            windowed = WindowedRenderer(_LocalRenders(local))
            for rounds in (3, 4, 5):
                body, upto = _long_conversation(rounds)
                answer = await windowed.around("u", body, upto)
                assert answer.same_ids(local.around(body, upto, "openai"))
            assert windowed.stats["mismatches"] == mismatches
            assert windowed.stats["used"] == (2 if mismatches == 0 else 0)

    asyncio.run(go())


async def _stored_bodies(dsn: str, rollout_id: str) -> list[tuple]:
    """(base call, request base, stored body, digest, body read back) of each call, in order."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT id, base_id, request_base, request_body, body_digest FROM calls"
            " WHERE rollout_id = $1 ORDER BY seq",
            rollout_id,
        )
        return [
            (r["base_id"], r["request_base"], r["request_body"], r["body_digest"],
             await calls_store.request_body(conn, uuid.UUID(rollout_id), r["id"]))
            for r in rows
        ]
    finally:
        await conn.close()


def test_request_bodies_are_deltas_read_back_exactly(gateway, vllm_server, database_url):
    rollout, requests = chat_conversation(gateway, vllm_server.model, stream=True)
    calls = gateway.calls(rollout["rollout_id"])
    assert [c["request"]["messages"] for c in calls] == requests
    stored = asyncio.run(_stored_bodies(database_url, rollout["rollout_id"]))
    assert stored[0][1] is None  # the first body is whole
    for *_, digest, raw in stored:
        # The very bytes the SDK sent: their digest is the one taken on arrival.
        assert bodies.digest(raw) == digest
    for base_id, request_base, body, _digest, raw in stored[1:]:
        # A delta against the previous turn's body, much smaller than the body compressed.
        assert request_base == base_id
        assert len(body) < len(bodies.whole(raw)) / 2


@pytest.fixture
def forgetful_gateway(vllm_server, own_database, tmp_path):
    """A gateway that keeps no recent calls in memory: every call reads its rollout back."""
    gw = GatewayProcess(
        [vllm_server.url],
        own_database,
        "--recent-calls-mib",
        "0",
        "--train-constrained",
        log_path=tmp_path / "gateway.log",
    )
    gw.start()
    yield gw
    gw.stop()


def test_without_recent_calls_in_memory_calls_continue_exactly(
    forgetful_gateway, vllm_server, own_database
):
    rollout, requests = chat_conversation(forgetful_gateway, vllm_server.model)
    calls = assert_one_exact_sequence(forgetful_gateway, rollout)
    assert [c["request"]["messages"] for c in calls] == requests
    # No parent body at hand: every body is stored whole, and reads back all the same.
    for _base, request_base, _body, digest, raw in asyncio.run(
        _stored_bodies(own_database, rollout["rollout_id"])
    ):
        assert request_base is None
        assert bodies.digest(raw) == digest
