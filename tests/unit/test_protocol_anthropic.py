"""Anthropic Messages protocol: request translation, validation, responses, the SSE stream, errors,
count_tokens, and the prompt normalisers.

Expected shapes are written from Anthropic's Messages API documentation (request fields, content
blocks, the streaming event flow, error types) and checked twice more: upstream bodies against
vLLM's own request models, and our output through the official `anthropic` SDK, served over HTTP
from a local aiohttp server.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import anthropic
import pytest
import pytest_asyncio
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.protocols import anthropic as proto
from gateway.protocols.errors import GatewayError
from gateway.protocols.normalize import normalize_messages, strip_claude_code_billing_header

MODEL = "claude-test"
PROMPT_IDS = [1, 17, 230, 5, 99]
BILLING = "x-anthropic-billing-header: cc_version=2.1.117.48f; cc_entrypoint=cli; cch=71fea;"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
    "required": ["city"],
}
WEATHER_TOOL = {"name": "get_weather", "description": "Weather now", "input_schema": WEATHER_SCHEMA}
WEATHER_FUNCTION = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA, "description": "Weather now"},
}


def body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 256, "messages": messages, **extra}


def upstream_of(request_body: dict[str, Any]) -> tuple[dict[str, Any], proto.Context]:
    return proto.to_upstream(proto.parse_request(json.dumps(request_body).encode()))


def with_parsed_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool-call arguments are a JSON string whose spacing is ours to choose: compare values."""
    out = []
    for message in messages:
        if "tool_calls" in message:
            calls = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json.loads(c["function"]["arguments"]),
                    },
                }
                for c in message["tool_calls"]
            ]
            message = {**message, "tool_calls": calls}
        out.append(message)
    return out


@pytest.fixture(scope="module")
def vllm_models():
    """vLLM 0.32's own request models: what its server accepts is the ground truth upstream."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest

    return ChatCompletionRequest, TokenizeChatRequest


# ---------------------------------------------------------------------------------------------
# Request translation

USER_HI = {"role": "user", "content": "Hello"}
TOOL_TURN = {
    "role": "assistant",
    "content": [
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
    ],
}
TOOL_CALL_1 = {
    "id": "toolu_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}

TRANSLATIONS = [
    pytest.param(body([USER_HI]), {"messages": [USER_HI]}, id="string-content"),
    pytest.param(
        body([USER_HI], system="Be brief."),
        {"messages": [{"role": "system", "content": "Be brief."}, USER_HI]},
        id="system-string",
    ),
    pytest.param(
        body(
            [USER_HI],
            system=[
                {"type": "text", "text": "Rule one.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Rule two."},
            ],
        ),
        {"messages": [{"role": "system", "content": "Rule one.\nRule two."}, USER_HI]},
        id="system-text-blocks",
    ),
    pytest.param(
        body(
            [USER_HI],
            system=[
                {"type": "text", "text": BILLING},
                {"type": "text", "text": "You are Claude Code, Anthropic's official CLI."},
                {"type": "text", "text": "Be careful."},
            ],
        ),
        {
            "messages": [
                {
                    "role": "system",
                    "content": "You are Claude Code, Anthropic's official CLI.\nBe careful.",
                },
                USER_HI,
            ]
        },
        id="system-claude-code-billing-header-stripped",
    ),
    pytest.param(
        body(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                        {
                            "type": "text",
                            "text": "Fix the bug",
                            "cache_control": {"type": "ephemeral"},
                        },
                    ],
                }
            ]
        ),
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                        {"type": "text", "text": "Fix the bug"},
                    ],
                }
            ]
        },
        id="user-text-blocks",
    ),
    pytest.param(
        body(
            [
                {"role": "user", "content": "Weather in Paris?"},
                TOOL_TURN,
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"}
                    ],
                },
            ],
            tools=[WEATHER_TOOL],
        ),
        {
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "Let me check.", "tool_calls": [TOOL_CALL_1]},
                {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
            ],
            "tools": [WEATHER_FUNCTION],
        },
        id="tool-use-and-result",
    ),
    pytest.param(
        body(
            [
                {"role": "user", "content": "Two cities"},
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "tool_use",
                            "id": "a",
                            "name": "get_weather",
                            "input": {"city": "X"},
                        },
                        {
                            "type": "tool_use",
                            "id": "b",
                            "name": "get_weather",
                            "input": {"city": "Y"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Also: hurry."},
                        {"type": "tool_result", "tool_use_id": "b", "content": "rb"},
                        {
                            "type": "tool_result",
                            "tool_use_id": "a",
                            "content": [
                                {"type": "text", "text": "ra1"},
                                {"type": "text", "text": "ra2"},
                            ],
                        },
                    ],
                },
            ],
            tools=[WEATHER_TOOL],
        ),
        {
            "messages": [
                {"role": "user", "content": "Two cities"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "a",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": {"city": "X"}},
                        },
                        {
                            "id": "b",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": {"city": "Y"}},
                        },
                    ],
                },
                {"role": "tool", "tool_call_id": "b", "content": "rb"},
                {"role": "tool", "tool_call_id": "a", "content": "ra1\nra2"},
                {"role": "user", "content": "Also: hurry."},
            ],
            "tools": [WEATHER_FUNCTION],
        },
        id="tool-results-first-then-user-text",
    ),
    pytest.param(
        body(
            [
                {"role": "user", "content": "go"},
                TOOL_TURN,
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "no such city"}],
                            "is_error": True,
                        }
                    ],
                },
            ],
            tools=[WEATHER_TOOL],
        ),
        {
            "messages": [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": "Let me check.", "tool_calls": [TOOL_CALL_1]},
                {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: no such city"},
            ],
            "tools": [WEATHER_FUNCTION],
        },
        id="tool-result-is-error",
    ),
    pytest.param(
        body(
            [
                {"role": "user", "content": "go"},
                TOOL_TURN,
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]},
            ],
            tools=[WEATHER_TOOL],
        ),
        {
            "messages": [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": "Let me check.", "tool_calls": [TOOL_CALL_1]},
                {"role": "tool", "tool_call_id": "toolu_1", "content": ""},
            ],
            "tools": [WEATHER_FUNCTION],
        },
        id="tool-result-without-content",
    ),
    pytest.param(
        body(
            [
                {"role": "user", "content": "Hi"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "Greet back.", "signature": "c2ln"},
                        {"type": "redacted_thinking", "data": "b3BhcXVl"},
                        {"type": "text", "text": "Hello!"},
                    ],
                },
                {"role": "user", "content": "Bye"},
            ]
        ),
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!", "reasoning": "Greet back."},
                {"role": "user", "content": "Bye"},
            ],
        },
        id="thinking-to-reasoning-redacted-dropped",
    ),
    pytest.param(
        body(
            [
                {"role": "user", "content": "a"},
                {"role": "user", "content": [{"type": "text", "text": "b"}]},
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "tool_use",
                            "id": "t1",
                            "name": "get_weather",
                            "input": {"city": "X"},
                        }
                    ],
                },
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "tool_use",
                            "id": "t2",
                            "name": "get_weather",
                            "input": {"city": "Y"},
                        }
                    ],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "1"}],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "2"}],
                },
            ],
            tools=[WEATHER_TOOL],
        ),
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "t1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": {"city": "X"}},
                        },
                        {
                            "id": "t2",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": {"city": "Y"}},
                        },
                    ],
                },
                {"role": "tool", "tool_call_id": "t1", "content": "1"},
                {"role": "tool", "tool_call_id": "t2", "content": "2"},
            ],
            "tools": [WEATHER_FUNCTION],
        },
        id="consecutive-same-role-messages-are-one-turn",
    ),
    pytest.param(
        body(
            [
                {"role": "user", "content": "Greek name for the Sun? (A) Sol (B) Helios"},
                {"role": "assistant", "content": "The best answer is ("},
            ]
        ),
        {
            "messages": [
                {"role": "user", "content": "Greek name for the Sun? (A) Sol (B) Helios"},
                {"role": "assistant", "content": "The best answer is ("},
            ],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
        id="prefill-continues-final-assistant-message",
    ),
    pytest.param(
        body([USER_HI], tools=[{**WEATHER_TOOL, "type": "custom"}], tool_choice={"type": "auto"}),
        {"messages": [USER_HI], "tools": [WEATHER_FUNCTION], "tool_choice": "auto"},
        id="tool-choice-auto",
    ),
    pytest.param(
        body([USER_HI], tools=[WEATHER_TOOL], tool_choice={"type": "any"}),
        {"messages": [USER_HI], "tools": [WEATHER_FUNCTION], "tool_choice": "required"},
        id="tool-choice-any",
    ),
    pytest.param(
        body([USER_HI], tools=[WEATHER_TOOL], tool_choice={"type": "tool", "name": "get_weather"}),
        {
            "messages": [USER_HI],
            "tools": [WEATHER_FUNCTION],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
        id="tool-choice-tool",
    ),
    pytest.param(
        body([USER_HI], tools=[WEATHER_TOOL], tool_choice={"type": "none"}),
        {"messages": [USER_HI], "tools": [WEATHER_FUNCTION], "tool_choice": "none"},
        id="tool-choice-none",
    ),
    pytest.param(
        body(
            [USER_HI],
            tools=[WEATHER_TOOL],
            tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        ),
        {
            "messages": [USER_HI],
            "tools": [WEATHER_FUNCTION],
            "tool_choice": "auto",
            "parallel_tool_calls": False,
        },
        id="tool-choice-disable-parallel",
    ),
    pytest.param(
        body([USER_HI], tool_choice={"type": "auto"}),
        {"messages": [USER_HI]},
        id="tool-choice-auto-without-tools-dropped",
    ),
    pytest.param(
        body(
            [USER_HI],
            stop_sequences=["\n\nHuman:", "###"],
            stream=True,
            temperature=0.2,
            top_p=0.9,
            top_k=5,
            metadata={"user_id": "user_abc_account__session_123"},
            thinking={"type": "adaptive"},
            context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            output_config={"effort": "high"},
            service_tier="auto",
        ),
        {"messages": [USER_HI], "stream": True, "stop": ["\n\nHuman:", "###"]},
        id="sampling-and-claude-code-extras-not-forwarded",
    ),
    pytest.param(
        body([USER_HI], thinking={"type": "enabled", "budget_tokens": 2048}),
        {"messages": [USER_HI]},
        id="thinking-enabled-accepted",
    ),
    pytest.param(
        body([USER_HI], thinking={"type": "disabled"}),
        {"messages": [USER_HI]},
        id="thinking-disabled-accepted",
    ),
]


@pytest.mark.parametrize(("request_body", "expected"), TRANSLATIONS)
def test_request_translation(request_body, expected, vllm_models):
    upstream, ctx = upstream_of(request_body)
    want = {"max_tokens": 256, "stream": False, **expected}
    got = {**upstream, "messages": with_parsed_arguments(upstream["messages"])}
    assert got == want
    assert ctx.model == MODEL
    assert ctx.message_id.startswith("msg_") and len(ctx.message_id) > 8
    assert ctx.stop_sequences == tuple(request_body.get("stop_sequences", ()))
    chat_request, _ = vllm_models
    chat_request.model_validate({**upstream, "model": "tiny"})


def test_tool_arguments_are_a_json_string():
    upstream, _ = upstream_of(
        body(
            [
                {"role": "user", "content": "go"},
                TOOL_TURN,
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]},
            ],
            tools=[WEATHER_TOOL],
        )
    )
    arguments = upstream["messages"][1]["tool_calls"][0]["function"]["arguments"]
    assert isinstance(arguments, str) and json.loads(arguments) == {"city": "Paris"}


def test_message_ids_differ_per_request():
    ids = {upstream_of(body([USER_HI]))[1].message_id for _ in range(20)}
    assert len(ids) == 20


# ---------------------------------------------------------------------------------------------
# Bad input: 400 invalid_request_error naming the field

ORPHAN_CONVERSATION = [
    {"role": "user", "content": "go"},
    TOOL_TURN,
    {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}],
    },
    {"role": "assistant", "content": "Done."},
    {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "again"}],
    },
]

BAD_INPUTS = [
    pytest.param(
        body([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}]),
        "messages.0.content.0.tool_use_id",
        "toolu_9",
        id="orphan-tool-result-first-turn",
    ),
    pytest.param(
        body(ORPHAN_CONVERSATION, tools=[WEATHER_TOOL]),
        "messages.4.content.0.tool_use_id",
        "toolu_1",
        id="tool-result-for-an-older-turn",
    ),
    pytest.param(
        body(
            [
                {"role": "user", "content": "go"},
                TOOL_TURN,
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a"},
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "b"},
                    ],
                },
            ],
            tools=[WEATHER_TOOL],
        ),
        "messages.2.content.1.tool_use_id",
        "second tool_result",
        id="duplicate-tool-result",
    ),
    pytest.param(
        body([{"role": "user", "content": [{"type": "video", "url": "x"}]}]),
        "messages.0.content.0.type",
        "video",
        id="unknown-block-type",
    ),
    pytest.param(
        body(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"},
                        },
                    ],
                }
            ]
        ),
        "messages.0.content.1",
        "text-only",
        id="image-rejected",
    ),
    pytest.param(
        body(
            [
                {"role": "user", "content": "go"},
                TOOL_TURN,
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [
                                {"type": "image", "source": {"type": "base64", "data": "iVBO"}}
                            ],
                        }
                    ],
                },
            ],
            tools=[WEATHER_TOOL],
        ),
        "messages.2.content.0.content.0",
        "text-only",
        id="image-in-tool-result-rejected",
    ),
    pytest.param(
        body([{"role": "user", "content": [{"type": "document", "source": {"type": "text"}}]}]),
        "messages.0.content.0",
        "text-only",
        id="document-rejected",
    ),
    pytest.param(
        body(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}
                    ],
                }
            ]
        ),
        "messages.0.content.0",
        "tool_use blocks are not allowed in user messages",
        id="tool-use-in-user-message",
    ),
    pytest.param(
        body(
            [
                USER_HI,
                {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
            ]
        ),
        "messages.1.content.0",
        "tool_result blocks are not allowed in assistant messages",
        id="tool-result-in-assistant-message",
    ),
    pytest.param(
        body([USER_HI, TOOL_TURN], tools=[WEATHER_TOOL]),
        "messages.1",
        "tool_result",
        id="conversation-ends-with-tool-use",
    ),
    pytest.param(
        {"model": MODEL, "messages": [USER_HI]}, "max_tokens", "Field required", id="no-max-tokens"
    ),
    pytest.param(body([USER_HI], max_tokens="many"), "max_tokens", "int", id="max-tokens-type"),
    pytest.param(body([USER_HI], max_tokens=0), "max_tokens", ">= 1", id="max-tokens-zero"),
    pytest.param(body([]), "messages", "at least one", id="no-messages"),
    pytest.param(
        body([{"role": "user", "content": 7}]), "messages.0.content", "got `int`", id="content-type"
    ),
    pytest.param(
        body([{"role": "system", "content": "x"}]),
        "messages.0.role",
        "system",
        id="system-role-in-messages",
    ),
    pytest.param(
        body([{"role": "user", "content": [{"type": "text"}]}]),
        "messages.0.content.0.text",
        "Field required",
        id="text-block-without-text",
    ),
    pytest.param(
        body([USER_HI], system=[{"type": "image", "source": {}}]),
        "system.0.type",
        "image",
        id="system-non-text-block",
    ),
    pytest.param(
        body([USER_HI], tools=[{"name": "f", "input_schema": {"type": "array"}}]),
        "tools.0.input_schema.type",
        "object",
        id="tool-schema-not-object",
    ),
    pytest.param(
        body([USER_HI], tools=[{"name": "f", "input_schema": {"properties": {}}}]),
        "tools.0.input_schema.type",
        "object",
        id="tool-schema-without-type",
    ),
    pytest.param(
        body([USER_HI], tools=[{"name": "f"}]),
        "tools.0.input_schema",
        "Field required",
        id="tool-schema-missing",
    ),
    pytest.param(
        body([USER_HI], tools=[{"name": "f", "input_schema": "object"}]),
        "tools.0.input_schema",
        "got `str`",
        id="tool-schema-type",
    ),
    pytest.param(
        body([USER_HI], tools=[{"type": "web_search_20250305", "name": "web_search"}]),
        "tools.0.type",
        "web_search_20250305",
        id="server-tool",
    ),
    pytest.param(
        body([USER_HI], tools=[WEATHER_TOOL, WEATHER_TOOL]),
        "tools.1.name",
        "unique",
        id="duplicate-tool-name",
    ),
    pytest.param(
        body([USER_HI], tools=[WEATHER_TOOL], tool_choice={"type": "tool", "name": "nope"}),
        "tool_choice.name",
        "nope",
        id="tool-choice-unknown-tool",
    ),
    pytest.param(
        body([USER_HI], tool_choice={"type": "any"}),
        "tool_choice",
        "needs tools",
        id="tool-choice-any-without-tools",
    ),
    pytest.param(
        body([USER_HI], tools=[WEATHER_TOOL], tool_choice={"type": "tool"}),
        "tool_choice.name",
        "Field required",
        id="tool-choice-tool-without-name",
    ),
    pytest.param(
        body([USER_HI], tool_choice={"type": "sometimes"}),
        "tool_choice.type",
        "sometimes",
        id="tool-choice-unknown-type",
    ),
    pytest.param(
        body([USER_HI], stop_sequences="STOP"),
        "stop_sequences",
        "got `str`",
        id="stop-sequences-type",
    ),
    pytest.param(
        body([USER_HI], thinking={"budget_tokens": 1024}),
        "thinking.type",
        "Field required",
        id="thinking-without-type",
    ),
    pytest.param(
        body([USER_HI], metadata={"user_id": 5}),
        "metadata.user_id",
        "got `int`",
        id="metadata-type",
    ),
]


@pytest.mark.parametrize(("request_body", "param", "fragment"), BAD_INPUTS)
def test_bad_input(request_body, param, fragment):
    with pytest.raises(GatewayError) as caught:
        proto.parse_request(json.dumps(request_body).encode())
    err = caught.value
    assert err.status == 400
    assert err.param == param
    assert err.message.startswith(f"{param}:")
    assert fragment in err.message
    status, raw = proto.render_error(err)
    assert status == 400
    assert json.loads(raw) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": err.message},
    }


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", json.dumps(body([USER_HI])).encode() + b" trailing", b"\xff\xfe"],
    ids=["empty", "open", "tail", "bytes"],
)
def test_malformed_json(raw):
    with pytest.raises(GatewayError) as caught:
        proto.parse_request(raw)
    assert caught.value.status == 400
    assert caught.value.message.startswith("request body is not valid JSON")


def test_body_not_an_object():
    with pytest.raises(GatewayError) as caught:
        proto.parse_request(b"[]")
    assert caught.value.status == 400 and caught.value.message.startswith("request body:")


# ---------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    ("err", "status", "kind"),
    [
        (GatewayError(400, "bad", "invalid_request_error"), 400, "invalid_request_error"),
        (GatewayError(401, "unknown key", "authentication_error"), 401, "authentication_error"),
        (GatewayError(403, "admin only", "permission_error"), 403, "permission_error"),
        (GatewayError(404, "no such route", "not_found_error"), 404, "not_found_error"),
        (GatewayError(413, "body too big", "request_too_large"), 413, "request_too_large"),
        (GatewayError(429, "slow down", "rate_limit_error"), 429, "rate_limit_error"),
        (GatewayError(500, "bug", "api_error"), 500, "api_error"),
        (GatewayError(502, "vLLM went away", "upstream_error"), 502, "api_error"),
        (GatewayError(503, "no healthy replica", "upstream_error"), 503, "overloaded_error"),
        (GatewayError(529, "busy", "overloaded_error"), 529, "overloaded_error"),
        (GatewayError(409, "conflict", "conflict"), 409, "invalid_request_error"),
    ],
)
def test_render_error_types(err, status, kind):
    got_status, raw = proto.render_error(err)
    assert got_status == status
    assert json.loads(raw) == {"type": "error", "error": {"type": kind, "message": err.message}}


@pytest.mark.parametrize(
    ("upstream_message", "expected"),
    [
        (
            "This model's maximum context length is 2048 tokens. However, your prompt contains "
            "2100 input tokens, which exceeds this limit even without any output tokens. Please "
            "reduce the length of the input prompt.",
            "prompt is too long: 2100 tokens > 2048 maximum",
        ),
        (
            # As vLLM 0.32 answered a 513-token prompt with --max-model-len 512.
            "This model's maximum context length is 512 tokens. However, your prompt contains "
            "at least 513 input tokens, which exceeds this limit even without any output tokens. "
            "Please reduce the length of the input prompt. (parameter=input_tokens, value=513)",
            "prompt is too long: 513 tokens > 512 maximum",
        ),
        (
            "Input length (3000) exceeds model's maximum context length (2048).",
            "prompt is too long: 3000 tokens > 2048 maximum",
        ),
        (
            "This model's maximum context length is 2048 tokens. However, your prompt contains "
            "90000 characters (more than 81920 characters, which is the upper bound for 2048 "
            "input tokens).",
            "prompt is too long: This model's maximum context length is 2048 tokens. However, "
            "your prompt contains 90000 characters (more than 81920 characters, which is the "
            "upper bound for 2048 input tokens).",
        ),
    ],
)
def test_context_overflow_is_prompt_too_long(upstream_message, expected):
    err = GatewayError(400, upstream_message, "context_length_exceeded")
    status, raw = proto.render_error(err)
    assert status == 400
    decoded = json.loads(raw)
    assert decoded == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": expected},
    }
    # Claude Code's check: a case-insensitive "prompt is too long" in the message.
    assert "prompt is too long" in decoded["error"]["message"].lower()
    event, data = parse_sse(proto.Stream(context()).fail(err))[0]
    assert (event, data) == ("error", decoded)


# ---------------------------------------------------------------------------------------------
# Non-streaming responses (vLLM 0.32 ChatCompletionResponse shapes)


def context(stop_sequences: tuple[str, ...] = ()) -> proto.Context:
    return proto.Context(
        model=MODEL, message_id="msg_0123456789abcdef", stop_sequences=stop_sequences
    )


def vllm_response(
    message: dict[str, Any], finish: str, stop_reason: Any = None, completion: int = 4
) -> dict[str, Any]:
    return {
        "id": "chatcmpl-9f1",
        "object": "chat.completion",
        "created": 1767225600,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                    **message,
                },
                "logprobs": {"content": []},
                "finish_reason": finish,
                "stop_reason": stop_reason,
                "token_ids": list(range(100, 100 + completion)),
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": len(PROMPT_IDS),
            "total_tokens": len(PROMPT_IDS) + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None,
        },
        "prompt_logprobs": None,
        "prompt_token_ids": PROMPT_IDS,
        "kv_transfer_params": None,
    }


def message(
    content: list[dict[str, Any]],
    stop_reason: str,
    stop_sequence: str | None = None,
    output_tokens: int = 4,
) -> dict[str, Any]:
    return {
        "id": "msg_0123456789abcdef",
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": len(PROMPT_IDS), "output_tokens": output_tokens},
    }


VLLM_CALL = {
    "id": "chatcmpl-tool-8e2",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
}
PARIS_TOOL_USE = {
    "type": "tool_use",
    "id": "chatcmpl-tool-8e2",
    "name": "get_weather",
    "input": {"city": "Paris", "unit": "c"},
}

RESPONSES = [
    pytest.param(
        vllm_response({"content": "Hello there"}, "stop"),
        (),
        message([{"type": "text", "text": "Hello there"}], "end_turn"),
        id="text",
    ),
    pytest.param(
        vllm_response({"content": "Hello there"}, "stop", stop_reason=2),
        (),
        message([{"type": "text", "text": "Hello there"}], "end_turn"),
        id="eos-token-stop",
    ),
    pytest.param(
        vllm_response({"content": "1, 2, 3"}, "stop", stop_reason="###"),
        ("END", "###"),
        message([{"type": "text", "text": "1, 2, 3"}], "stop_sequence", "###"),
        id="stop-sequence",
    ),
    pytest.param(
        vllm_response({"content": "1, 2, 3, 4"}, "length"),
        (),
        message([{"type": "text", "text": "1, 2, 3, 4"}], "max_tokens"),
        id="length",
    ),
    pytest.param(
        vllm_response({"content": "Checking.", "tool_calls": [VLLM_CALL]}, "tool_calls"),
        (),
        message([{"type": "text", "text": "Checking."}, PARIS_TOOL_USE], "tool_use"),
        id="text-and-tool-call",
    ),
    pytest.param(
        vllm_response({"content": "", "tool_calls": [VLLM_CALL]}, "stop"),
        (),
        message([PARIS_TOOL_USE], "tool_use"),
        id="named-tool-choice-finishes-stop",
    ),
    pytest.param(
        vllm_response({"reasoning": "User wants a greeting.", "content": "Hi!"}, "stop"),
        (),
        message(
            [
                {"type": "thinking", "thinking": "User wants a greeting.", "signature": ""},
                {"type": "text", "text": "Hi!"},
            ],
            "end_turn",
        ),
        id="reasoning-to-thinking",
    ),
    pytest.param(
        vllm_response(
            {
                "tool_calls": [
                    {**VLLM_CALL, "function": {"name": "get_weather", "arguments": '{"city": '}}
                ]
            },
            "tool_calls",
        ),
        (),
        message([{**PARIS_TOOL_USE, "input": {}}], "tool_use"),
        id="unparsable-arguments",
    ),
    pytest.param(
        vllm_response(
            {
                "tool_calls": [
                    {**VLLM_CALL, "function": {"name": "get_weather", "arguments": "[1, 2]"}}
                ]
            },
            "tool_calls",
        ),
        (),
        message([{**PARIS_TOOL_USE, "input": {}}], "tool_use"),
        id="non-object-arguments",
    ),
    pytest.param(
        vllm_response(
            {"tool_calls": [{**VLLM_CALL, "function": {"name": "get_weather", "arguments": ""}}]},
            "tool_calls",
        ),
        (),
        message([{**PARIS_TOOL_USE, "input": {}}], "tool_use"),
        id="empty-arguments",
    ),
    pytest.param(
        vllm_response({"content": ""}, "stop", completion=1),
        (),
        message([], "end_turn", output_tokens=1),
        id="empty-reply",
    ),
]


@pytest.mark.parametrize(("resp", "stops", "expected"), RESPONSES)
def test_from_upstream(resp, stops, expected):
    raw = proto.from_upstream(resp, context(stops))
    assert json.loads(raw) == expected
    anthropic.types.Message.model_validate_json(raw)


def test_from_upstream_unknown_finish_reason_is_an_upstream_error():
    with pytest.raises(GatewayError) as caught:
        proto.from_upstream(vllm_response({"content": "x"}, "abort"), context())
    assert caught.value.status == 502


# ---------------------------------------------------------------------------------------------
# Streaming: vLLM 0.32 chunk shapes (return_token_ids, logprobs, include_usage)


def first_chunk() -> dict[str, Any]:
    return {
        "id": "chatcmpl-9f1",
        "object": "chat.completion.chunk",
        "created": 1767225600,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        "prompt_token_ids": PROMPT_IDS,
    }


_token = itertools.count(300)


def chunk(
    delta: dict[str, Any], finish: str | None = None, stop_reason: Any = None, tokens: int = 1
) -> dict[str, Any]:
    ids = [next(_token) for _ in range(tokens)]
    choice: dict[str, Any] = {
        "index": 0,
        "delta": delta,
        "logprobs": {
            "content": [
                {"token": f"token_id:{i}", "logprob": -0.25, "bytes": None, "top_logprobs": []}
                for i in ids
            ]
        },
        "finish_reason": finish,
        "token_ids": ids,
    }
    if finish is not None:
        choice["stop_reason"] = stop_reason
    return {
        "id": "chatcmpl-9f1",
        "object": "chat.completion.chunk",
        "created": 1767225600,
        "model": "tiny",
        "choices": [choice],
    }


def usage_chunk(completion: int) -> dict[str, Any]:
    return {
        "id": "chatcmpl-9f1",
        "object": "chat.completion.chunk",
        "created": 1767225600,
        "model": "tiny",
        "choices": [],
        "usage": {
            "prompt_tokens": len(PROMPT_IDS),
            "total_tokens": len(PROMPT_IDS) + completion,
            "completion_tokens": completion,
        },
    }


def tool_start(index: int, call_id: str, name: str) -> dict[str, Any]:
    return chunk(
        {
            "tool_calls": [
                {"id": call_id, "type": "function", "index": index, "function": {"name": name}}
            ]
        }
    )


def tool_args(index: int, fragment: str) -> dict[str, Any]:
    return chunk({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})


def run_stream(
    chunks: list[dict[str, Any]], ctx: proto.Context | None = None
) -> tuple[bytes, bytes]:
    """(bytes from feed, bytes from close)."""
    stream = proto.Stream(ctx or context())
    fed = b"".join(stream.feed(c) for c in chunks)
    return fed, stream.close()


def parse_sse(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """Frames are `event: NAME\\ndata: JSON\\n\\n`; the JSON's `type` repeats the name."""
    assert raw.endswith(b"\n\n")
    events = []
    for frame in raw[:-2].split(b"\n\n"):
        event_line, data_line = frame.split(b"\n")
        assert event_line.startswith(b"event: ") and data_line.startswith(b"data: ")
        name = event_line[len(b"event: ") :].decode()
        data = json.loads(data_line[len(b"data: ") :])
        assert data["type"] == name
        events.append((name, data))
    return events


def message_start(input_tokens: int = len(PROMPT_IDS)) -> tuple[str, dict[str, Any]]:
    return (
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": "msg_0123456789abcdef",
                "type": "message",
                "role": "assistant",
                "model": MODEL,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": input_tokens, "output_tokens": 0},
            },
        },
    )


PING = ("ping", {"type": "ping"})
MESSAGE_STOP = ("message_stop", {"type": "message_stop"})


def block_start(index: int, block: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return (
        "content_block_start",
        {"type": "content_block_start", "index": index, "content_block": block},
    )


def block_delta(index: int, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})


def block_stop(index: int) -> tuple[str, dict[str, Any]]:
    return ("content_block_stop", {"type": "content_block_stop", "index": index})


def message_delta(
    stop_reason: str, output_tokens: int, stop_sequence: str | None = None
) -> tuple[str, dict[str, Any]]:
    return (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": output_tokens},
        },
    )


def text(t: str) -> dict[str, Any]:
    return {"type": "text_delta", "text": t}


def partial(j: str) -> dict[str, Any]:
    return {"type": "input_json_delta", "partial_json": j}


TEXT_ONLY = [
    first_chunk(),
    chunk({"content": "Hel"}),
    chunk({"content": "lo"}),
    chunk({"content": "!"}),
    chunk({"content": ""}, "stop", None),
    usage_chunk(4),
]
TEXT_THEN_TOOL = [
    first_chunk(),
    chunk({"content": "Let me "}),
    chunk({"content": "check."}),
    tool_start(0, "chatcmpl-tool-8e2", "get_weather"),
    tool_args(0, '{"city": '),
    tool_args(0, '"Par'),
    tool_args(0, 'is", "unit": "c"}'),
    chunk({}, "tool_calls", None),
    usage_chunk(9),
]

STREAMS = [
    pytest.param(
        TEXT_ONLY,
        (),
        [
            message_start(),
            PING,
            block_start(0, {"type": "text", "text": ""}),
            block_delta(0, text("Hel")),
            block_delta(0, text("lo")),
            block_delta(0, text("!")),
            block_stop(0),
            message_delta("end_turn", 4),
        ],
        id="text-only",
    ),
    pytest.param(
        TEXT_THEN_TOOL,
        (),
        [
            message_start(),
            PING,
            block_start(0, {"type": "text", "text": ""}),
            block_delta(0, text("Let me ")),
            block_delta(0, text("check.")),
            block_stop(0),
            block_start(
                1,
                {"type": "tool_use", "id": "chatcmpl-tool-8e2", "name": "get_weather", "input": {}},
            ),
            block_delta(1, partial('{"city": ')),
            block_delta(1, partial('"Par')),
            block_delta(1, partial('is", "unit": "c"}')),
            block_stop(1),
            message_delta("tool_use", 9),
        ],
        id="text-then-tool-call",
    ),
    pytest.param(
        [
            first_chunk(),
            chunk({"content": "1, 2, 3"}),
            chunk({"content": ", 4"}, "length", None),
            usage_chunk(2),
        ],
        (),
        [
            message_start(),
            PING,
            block_start(0, {"type": "text", "text": ""}),
            block_delta(0, text("1, 2, 3")),
            block_delta(0, text(", 4")),
            block_stop(0),
            message_delta("max_tokens", 2),
        ],
        id="length-stop",
    ),
    pytest.param(
        [
            first_chunk(),
            chunk({"content": "a b"}),
            chunk({"content": " c"}, "stop", "###"),
            usage_chunk(3),
        ],
        ("###",),
        [
            message_start(),
            PING,
            block_start(0, {"type": "text", "text": ""}),
            block_delta(0, text("a b")),
            block_delta(0, text(" c")),
            block_stop(0),
            message_delta("stop_sequence", 3, "###"),
        ],
        id="stop-sequence",
    ),
    pytest.param(
        [
            first_chunk(),
            chunk({"reasoning": "The user "}),
            chunk({"reasoning": "greets."}),
            chunk({"content": "Hi"}),
            chunk({"content": ""}, "stop", None),
            usage_chunk(4),
        ],
        (),
        [
            message_start(),
            PING,
            block_start(0, {"type": "thinking", "thinking": "", "signature": ""}),
            block_delta(0, {"type": "thinking_delta", "thinking": "The user "}),
            block_delta(0, {"type": "thinking_delta", "thinking": "greets."}),
            block_stop(0),
            block_start(1, {"type": "text", "text": ""}),
            block_delta(1, text("Hi")),
            block_stop(1),
            message_delta("end_turn", 4),
        ],
        id="reasoning-then-text",
    ),
    pytest.param(
        [
            first_chunk(),
            tool_start(0, "call-a", "get_weather"),
            tool_args(0, '{"city": "X"}'),
            tool_start(1, "call-b", "get_weather"),
            tool_args(1, '{"city": '),
            tool_args(1, '"Y"}'),
            chunk({}, "tool_calls", None),
            usage_chunk(7),
        ],
        (),
        [
            message_start(),
            PING,
            block_start(
                0, {"type": "tool_use", "id": "call-a", "name": "get_weather", "input": {}}
            ),
            block_delta(0, partial('{"city": "X"}')),
            block_stop(0),
            block_start(
                1, {"type": "tool_use", "id": "call-b", "name": "get_weather", "input": {}}
            ),
            block_delta(1, partial('{"city": ')),
            block_delta(1, partial('"Y"}')),
            block_stop(1),
            message_delta("tool_use", 7),
        ],
        id="two-tool-calls",
    ),
    pytest.param(
        [
            first_chunk(),
            tool_start(0, "call-a", "get_weather"),
            tool_args(0, "{}"),
            chunk({}, "stop", None),
            usage_chunk(3),
        ],
        (),
        [
            message_start(),
            PING,
            block_start(
                0, {"type": "tool_use", "id": "call-a", "name": "get_weather", "input": {}}
            ),
            block_delta(0, partial("{}")),
            block_stop(0),
            message_delta("tool_use", 3),
        ],
        id="named-tool-choice-finishes-stop",
    ),
    pytest.param(
        [first_chunk(), chunk({"content": ""}, "stop", None), usage_chunk(1)],
        (),
        [message_start(), PING, message_delta("end_turn", 1)],
        id="empty-reply",
    ),
]


@pytest.mark.parametrize(("chunks", "stops", "expected"), STREAMS)
def test_stream_events(chunks, stops, expected):
    fed, closed = run_stream(chunks, context(stops))
    assert parse_sse(fed) == expected
    assert parse_sse(closed) == [MESSAGE_STOP]
    for _, data in parse_sse(fed + closed):
        validate_event(data)


_EVENT_MODELS = {
    "message_start": anthropic.types.RawMessageStartEvent,
    "content_block_start": anthropic.types.RawContentBlockStartEvent,
    "content_block_delta": anthropic.types.RawContentBlockDeltaEvent,
    "content_block_stop": anthropic.types.RawContentBlockStopEvent,
    "message_delta": anthropic.types.RawMessageDeltaEvent,
    "message_stop": anthropic.types.RawMessageStopEvent,
}


def validate_event(data: dict[str, Any]) -> None:
    if data["type"] != "ping":
        _EVENT_MODELS[data["type"]].model_validate(data)


def test_stream_message_delta_without_usage_chunk_comes_from_close():
    chunks = [first_chunk(), chunk({"content": "ok"}, tokens=2), chunk({"content": ""}, "stop")]
    fed, closed = run_stream(chunks)
    assert parse_sse(fed)[-1] == block_stop(0)
    assert parse_sse(closed) == [message_delta("end_turn", 3), MESSAGE_STOP]


def test_stream_interleaved_tool_deltas_are_an_upstream_error():
    stream = proto.Stream(context())
    for c in [first_chunk(), tool_start(0, "a", "f"), tool_start(1, "b", "f")]:
        stream.feed(c)
    with pytest.raises(GatewayError) as caught:
        stream.feed(tool_args(0, "{}"))
    assert caught.value.status == 502


def test_stream_fail_gives_error_event():
    stream = proto.Stream(context())
    stream.feed(first_chunk())
    stream.feed(chunk({"content": "partial"}))
    raw = stream.fail(GatewayError(529, "vLLM replica overloaded", "overloaded_error"))
    assert parse_sse(raw) == [
        (
            "error",
            {
                "type": "error",
                "error": {"type": "overloaded_error", "message": "vLLM replica overloaded"},
            },
        )
    ]


# ---------------------------------------------------------------------------------------------
# The official SDK parses what we serve


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def sdk():
    """An aiohttp server on 127.0.0.1 that answers POST /v1/messages with canned bytes chosen by
    the request's `model`, and an AsyncAnthropic client pointed at it."""
    canned: dict[str, tuple[int, str, bytes]] = {}

    async def messages(request: web.Request) -> web.Response:
        requested = await request.json()
        status, content_type, payload = canned[requested["model"]]
        return web.Response(status=status, body=payload, content_type=content_type)

    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    client = anthropic.AsyncAnthropic(
        base_url=f"http://127.0.0.1:{port}", api_key="sk-test", max_retries=0
    )
    names = (f"model-{i}" for i in itertools.count())

    def serve(status: int, content_type: str, payload: bytes) -> str:
        name = next(names)
        canned[name] = (status, content_type, payload)
        return name

    yield client, serve
    await client.close()
    await runner.cleanup()


def sse_payload(chunks: list[dict[str, Any]], ctx: proto.Context | None = None) -> bytes:
    fed, closed = run_stream(chunks, ctx)
    return fed + closed


async def final_message(sdk, payload: bytes) -> anthropic.types.Message:
    client, serve = sdk
    model = serve(200, "text/event-stream", payload)
    async with client.messages.stream(
        model=model, max_tokens=64, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        return await stream.get_final_message()


@pytest.mark.asyncio(loop_scope="session")
async def test_sdk_stream_text_then_tool_call(sdk):
    msg = await final_message(sdk, sse_payload(TEXT_THEN_TOOL))
    assert msg.id == "msg_0123456789abcdef"
    assert msg.model == MODEL and msg.role == "assistant" and msg.type == "message"
    assert [b.type for b in msg.content] == ["text", "tool_use"]
    assert msg.content[0].text == "Let me check."
    tool_use = msg.content[1]
    assert (tool_use.id, tool_use.name) == ("chatcmpl-tool-8e2", "get_weather")
    assert tool_use.input == {"city": "Paris", "unit": "c"}
    assert msg.stop_reason == "tool_use" and msg.stop_sequence is None
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (len(PROMPT_IDS), 9)


@pytest.mark.asyncio(loop_scope="session")
async def test_sdk_stream_thinking_and_stop_sequence(sdk):
    chunks = [
        first_chunk(),
        chunk({"reasoning": "Count."}),
        chunk({"content": "1 2"}),
        chunk({"content": " 3"}, "stop", "END"),
        usage_chunk(4),
    ]
    msg = await final_message(sdk, sse_payload(chunks, context(("END",))))
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == "Count."
    assert msg.content[1].text == "1 2 3"
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", "END")


@pytest.mark.asyncio(loop_scope="session")
async def test_sdk_non_streaming_message(sdk):
    client, serve = sdk
    payload = proto.from_upstream(
        vllm_response({"content": "Checking.", "tool_calls": [VLLM_CALL]}, "tool_calls"), context()
    )
    msg = await client.messages.create(
        model=serve(200, "application/json", payload),
        max_tokens=64,
        messages=[{"role": "user", "content": "hi"}],
    )
    assert msg.content[0].text == "Checking."
    assert msg.content[1].input == {"city": "Paris", "unit": "c"}
    assert msg.stop_reason == "tool_use"


@pytest.mark.asyncio(loop_scope="session")
async def test_sdk_error_body(sdk):
    client, serve = sdk
    status, payload = proto.render_error(
        GatewayError(
            400,
            "Input length (3000) exceeds model's maximum context length (2048).",
            "context_length_exceeded",
        )
    )
    with pytest.raises(anthropic.BadRequestError) as caught:
        await client.messages.create(
            model=serve(status, "application/json", payload),
            max_tokens=64,
            messages=[{"role": "user", "content": "hi"}],
        )
    assert caught.value.status_code == 400
    assert caught.value.body["error"] == {
        "type": "invalid_request_error",
        "message": "prompt is too long: 3000 tokens > 2048 maximum",
    }


@pytest.mark.asyncio(loop_scope="session")
async def test_sdk_stream_error_event(sdk):
    stream = proto.Stream(context())
    payload = stream.feed(first_chunk()) + stream.feed(chunk({"content": "par"}))
    payload += stream.fail(GatewayError(502, "replica died", "upstream_error"))
    with pytest.raises(anthropic.APIStatusError) as caught:
        await final_message(sdk, payload)
    assert caught.value.body["error"] == {"type": "api_error", "message": "replica died"}


def split(value: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(value) + 1) for c in cuts} | {0, len(value)})
    return [value[a:b] for a, b in itertools.pairwise(points) if b > a]


json_scalars = st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=12)
tool_inputs = st.dictionaries(
    st.text(min_size=1, max_size=8),
    st.recursive(
        json_scalars,
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
        ),
        max_leaves=6,
    ),
    max_size=4,
)


@pytest.mark.asyncio(loop_scope="session")
@settings(max_examples=60, deadline=None)
@given(
    reply=st.text(min_size=1, max_size=60),
    tool_input=tool_inputs,
    text_cuts=st.lists(st.integers(0, 10_000), max_size=8),
    arg_cuts=st.lists(st.integers(0, 10_000), max_size=8),
)
async def test_sdk_reassembles_any_split(sdk, reply, tool_input, text_cuts, arg_cuts):
    arguments = json.dumps(tool_input, ensure_ascii=False)
    chunks = [first_chunk()]
    chunks += [chunk({"content": piece}) for piece in split(reply, text_cuts)]
    chunks.append(tool_start(0, "call-1", "get_weather"))
    chunks += [tool_args(0, piece) for piece in split(arguments, arg_cuts)]
    chunks += [chunk({}, "tool_calls", None), usage_chunk(len(chunks) - 1)]
    msg = await final_message(sdk, sse_payload(chunks))
    assert msg.content[0].text == reply
    assert msg.content[1].input == tool_input
    assert msg.stop_reason == "tool_use"


# ---------------------------------------------------------------------------------------------
# count_tokens


def test_count_tokens_request(vllm_models):
    raw = json.dumps(
        {
            "model": MODEL,
            "system": [{"type": "text", "text": BILLING}, {"type": "text", "text": "Be brief."}],
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER_TOOL],
        }
    ).encode()
    req = proto.parse_count_tokens(raw)
    got = proto.count_tokens_request(req)
    assert got == {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
        ],
        "add_generation_prompt": True,
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "parameters": WEATHER_SCHEMA,
                    "description": "Weather now",
                },
            }
        ],
    }
    _, tokenize_request = vllm_models
    tokenize_request.model_validate({**got, "model": "tiny"})
    # The same conversation as a Messages request renders the same messages and tools upstream.
    upstream, _ = proto.to_upstream(
        proto.parse_request(json.dumps({**json.loads(raw), "max_tokens": 10}).encode())
    )
    assert (upstream["messages"], upstream["tools"]) == (got["messages"], got["tools"])


def test_count_tokens_prefill_continues_final_message(vllm_models):
    req = proto.parse_count_tokens(
        json.dumps(
            {"model": MODEL, "messages": [USER_HI, {"role": "assistant", "content": "Sure,"}]}
        ).encode()
    )
    got = proto.count_tokens_request(req)
    assert got["add_generation_prompt"] is False and got["continue_final_message"] is True
    _, tokenize_request = vllm_models
    tokenize_request.model_validate({**got, "model": "tiny"})


def test_count_tokens_response():
    tokenize = {"count": 3, "max_model_len": 2048, "tokens": [5, 6, 7], "token_strs": None}
    assert json.loads(proto.count_tokens_response(tokenize)) == {"input_tokens": 3}


def test_count_tokens_body_is_validated_like_messages():
    with pytest.raises(GatewayError) as caught:
        proto.parse_count_tokens(
            json.dumps(
                {
                    "model": MODEL,
                    "messages": [
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]}
                    ],
                }
            ).encode()
        )
    assert caught.value.param == "messages.0.content.0.tool_use_id"


def test_to_upstream_refuses_a_count_tokens_request():
    req = proto.parse_count_tokens(json.dumps({"model": MODEL, "messages": [USER_HI]}).encode())
    with pytest.raises(TypeError):
        proto.to_upstream(req)


# ---------------------------------------------------------------------------------------------
# normalize.py


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        pytest.param(
            [{"role": "system", "content": f"{BILLING}\nYou are Claude Code."}],
            [{"role": "system", "content": "You are Claude Code."}],
            id="first-line-of-string",
        ),
        pytest.param(
            [{"role": "system", "content": f"{BILLING}\n\nYou are Claude Code.\nRules."}],
            [{"role": "system", "content": "You are Claude Code.\nRules."}],
            id="with-blank-line-after",
        ),
        pytest.param(
            [{"role": "system", "content": f"Intro.\n{BILLING}\nRest."}],
            [{"role": "system", "content": "Intro.\nRest."}],
            id="middle-line",
        ),
        pytest.param(
            [{"role": "system", "content": BILLING}, USER_HI],
            [USER_HI],
            id="only-content-drops-message",
        ),
        pytest.param(
            [
                {
                    "role": "system",
                    "content": [
                        {"type": "text", "text": BILLING},
                        {"type": "text", "text": "You are Claude Code."},
                    ],
                }
            ],
            [{"role": "system", "content": [{"type": "text", "text": "You are Claude Code."}]}],
            id="text-parts",
        ),
        pytest.param(
            [{"role": "system", "content": "Say x-anthropic-billing-header: when asked."}],
            [{"role": "system", "content": "Say x-anthropic-billing-header: when asked."}],
            id="not-at-line-start-kept",
        ),
        pytest.param(
            [{"role": "user", "content": f"{BILLING}\nwhat is this line?"}],
            [{"role": "user", "content": f"{BILLING}\nwhat is this line?"}],
            id="user-message-untouched",
        ),
        pytest.param(
            [{"role": "system", "content": ""}],
            [{"role": "system", "content": ""}],
            id="empty-system-kept",
        ),
    ],
)
def test_strip_billing_header(messages, expected):
    before = json.dumps(messages)
    assert normalize_messages(messages) == expected
    assert json.dumps(messages) == before, "the input must not be modified"


@given(
    version=st.from_regex(r"2\.1\.[0-9]{1,3}\.[0-9a-f]{3}", fullmatch=True),
    entrypoint=st.sampled_from(["cli", "sdk-cli", "sdk-ts"]),
    cch=st.from_regex(r"[0-9a-f]{5}", fullmatch=True),
    prompt=st.text(min_size=1).filter(lambda t: not t.startswith("\n")),
)
def test_billing_header_variants_normalise_to_the_same_prompt(version, entrypoint, cch, prompt):
    line = (
        f"x-anthropic-billing-header: cc_version={version}; cc_entrypoint={entrypoint}; cch={cch};"
    )
    system = [{"type": "text", "text": line}, {"type": "text", "text": prompt}]
    req = proto.parse_request(json.dumps(body([USER_HI], system=system)).encode())
    plain = proto.parse_request(json.dumps(body([USER_HI], system=prompt)).encode())
    assert req.messages == plain.messages
    assert strip_claude_code_billing_header(req.messages) == req.messages
