"""The Responses protocol: request items to chat messages, bad input to OpenAI-shaped errors,
and vLLM chat chunks to Responses events. Expected shapes are written from OpenAI's Responses
API reference and checked against the `openai` SDK's own types; the SDK also parses the bytes,
served by a local aiohttp server, as a real client would."""

from __future__ import annotations

import json

import msgspec
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import AsyncOpenAI
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.protocols import responses as R
from gateway.protocols.errors import GatewayError

SDK_EVENT = TypeAdapter(ResponseStreamEvent)


def raw(obj) -> bytes:
    return json.dumps(obj).encode()


def upstream(obj, previous=None) -> dict:
    return R.to_upstream(R.parse_request(raw(obj)), previous)[0]


def parse_sse(data: bytes) -> list[dict]:
    """Frames `event: TYPE\\ndata: JSON\\n\\n`; the event name must repeat the payload's type."""
    events = []
    assert data.endswith(b"\n\n")
    for frame in data.decode().split("\n\n")[:-1]:
        head, body = frame.split("\n")
        assert head.startswith("event: ") and body.startswith("data: ")
        event = json.loads(body[len("data: ") :])
        assert event["type"] == head[len("event: ") :]
        events.append(event)
    return events


# -- realistic vLLM chunks (shape of vLLM 0.32 with return_token_ids and logprobs) ---------------

_token = iter(range(100, 10**9))


def first_chunk() -> dict:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "tiny",
        "prompt_token_ids": [1, 2, 3],
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
    }


def chunk(delta: dict, finish: str | None = None) -> dict:
    tok = next(_token)
    lp = {"token": f"token_id:{tok}", "logprob": -0.5, "bytes": None, "top_logprobs": []}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "delta": delta,
                "logprobs": {"content": [lp]},
                "finish_reason": finish,
                "token_ids": [tok],
            }
        ],
    }


def usage_chunk(prompt: int, completion: int) -> dict:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "tiny",
        "choices": [],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }


def call_start(index: int, call_id: str, name: str) -> dict:
    return {
        "tool_calls": [
            {"index": index, "id": call_id, "type": "function", "function": {"name": name}}
        ]
    }


def call_args(index: int, args: str) -> dict:
    return {"tool_calls": [{"index": index, "function": {"arguments": args}}]}


# -- request translation -------------------------------------------------------------------------

FN_PARAMS = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}
EXEC_TOOL = {"type": "function", "name": "exec", "description": "Run", "parameters": FN_PARAMS}
EXEC_CHAT = {
    "type": "function",
    "function": {"name": "exec", "description": "Run", "parameters": FN_PARAMS},
}


def user(text):
    return {"role": "user", "content": text}


def fc(call_id, name, args="{}", **extra):
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": args, **extra}


def fco(call_id, output):
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def tool_call(call_id, name, args="{}"):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


TRANSLATIONS = [
    (
        "string input",
        {"model": "m", "input": "Hello"},
        {"messages": [user("Hello")], "stream": False},
    ),
    (
        "instructions, developer message with parts, typed message items, assistant turn",
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {
                    "type": "message",
                    "id": "msg_a",
                    "role": "developer",
                    "content": [
                        {"type": "input_text", "text": "rule one"},
                        {"type": "input_text", "text": "rule two"},
                    ],
                },
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "q"}],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "status": "completed",
                    "content": [
                        {"type": "output_text", "text": "ans", "annotations": []},
                        {"type": "output_text", "text": "wer", "annotations": []},
                    ],
                },
                {"role": "system", "content": "late system note"},
                user("again"),
            ],
        },
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {
                    "role": "system",
                    "content": [
                        {"type": "text", "text": "rule one"},
                        {"type": "text", "text": "rule two"},
                    ],
                },
                user("q"),
                {"role": "assistant", "content": "answer"},
                {"role": "system", "content": "late system note"},
                user("again"),
            ],
            "stream": False,
        },
    ),
    (
        "consecutive function calls form one assistant message; outputs become tool messages",
        {
            "model": "m",
            "input": [
                user("list and count"),
                fc("call_1", "exec", '{"cmd": "ls"}'),
                fc("call_2", "exec", '{"cmd": "wc"}'),
                fco("call_1", "a.txt"),
                fco("call_2", [{"type": "input_text", "text": "3"}]),
                {"role": "assistant", "content": "Done."},
            ],
        },
        {
            "messages": [
                user("list and count"),
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        tool_call("call_1", "exec", '{"cmd": "ls"}'),
                        tool_call("call_2", "exec", '{"cmd": "wc"}'),
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
                {"role": "tool", "tool_call_id": "call_2", "content": "3"},
                {"role": "assistant", "content": "Done."},
            ],
            "stream": False,
        },
    ),
    (
        "reasoning, text and calls of one generation stay one assistant turn",
        {
            "model": "m",
            "input": [
                user("go"),
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "need ls"}],
                    "encrypted_content": None,
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Looking.", "annotations": []}],
                },
                fc("call_1", "exec"),
                fco("call_1", "ok"),
                {
                    "type": "reasoning",
                    "id": "rs_2",
                    "summary": [{"type": "summary_text", "text": "a summary is not the text"}],
                    "encrypted_content": "opaque",
                },
                {"role": "assistant", "content": "Finished."},
            ],
        },
        {
            "messages": [
                user("go"),
                {
                    "role": "assistant",
                    "content": "Looking.",
                    "reasoning": "need ls",
                    "tool_calls": [tool_call("call_1", "exec")],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
                {"role": "assistant", "content": "Finished."},
            ],
            "stream": False,
        },
    ),
    (
        "text after calls starts a new assistant message; output parts stay separate",
        {
            "model": "m",
            "input": [
                user("x"),
                fc("call_1", "exec"),
                {"role": "assistant", "content": "between"},
                fco(
                    "call_1",
                    [{"type": "input_text", "text": "p1"}, {"type": "input_text", "text": "p2"}],
                ),
            ],
        },
        {
            "messages": [
                user("x"),
                {"role": "assistant", "content": None, "tool_calls": [tool_call("call_1", "exec")]},
                {"role": "assistant", "content": "between"},
                {
                    "role": "tool",
                    "tool_call_id": "call_1",
                    "content": [{"type": "text", "text": "p1"}, {"type": "text", "text": "p2"}],
                },
            ],
            "stream": False,
        },
    ),
    (
        "a namespaced call in history uses the flattened tool name",
        {
            "model": "m",
            "input": [user("x"), fc("call_1", "wait", namespace="agents"), fco("call_1", "ok")],
        },
        {
            "messages": [
                user("x"),
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [tool_call("call_1", "agents__wait")],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
            ],
            "stream": False,
        },
    ),
    (
        "function tool, tool_choice default auto, parallel_tool_calls, caps and sampling fields",
        {
            "model": "m",
            "input": "hi",
            "tools": [dict(EXEC_TOOL, strict=False)],
            "parallel_tool_calls": False,
            "max_output_tokens": 64,
            "temperature": 0.2,
            "top_p": 0.9,
            "reasoning": {"effort": "low", "summary": "auto"},
            "stream": True,
            "store": False,
            "include": ["reasoning.encrypted_content"],
            "metadata": {"k": "v"},
            "prompt_cache_key": "ignored",
        },
        {
            "messages": [user("hi")],
            "stream": True,
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "exec",
                        "description": "Run",
                        "parameters": FN_PARAMS,
                        "strict": False,
                    },
                }
            ],
            "tool_choice": "auto",
            "parallel_tool_calls": False,
            "max_tokens": 64,
            "temperature": 0.2,
            "top_p": 0.9,
            "reasoning_effort": "low",
        },
    ),
    (
        "namespace tools are flattened; hosted tools are dropped",
        {
            "model": "m",
            "input": "hi",
            "tools": [
                {
                    "type": "namespace",
                    "name": "agents",
                    "description": "Sub-agents",
                    "tools": [
                        {"type": "function", "name": "wait", "parameters": {"type": "object"}}
                    ],
                },
                {"type": "web_search", "external_web_access": False},
            ],
            "tool_choice": "required",
        },
        {
            "messages": [user("hi")],
            "stream": False,
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "agents__wait", "parameters": {"type": "object"}},
                }
            ],
            "tool_choice": "required",
            "parallel_tool_calls": True,
        },
    ),
    (
        "only hosted tools: no tools reach the engine",
        {"model": "m", "input": "hi", "tools": [{"type": "web_search"}], "tool_choice": "auto"},
        {"messages": [user("hi")], "stream": False},
    ),
    (
        "tool_choice none",
        {"model": "m", "input": "hi", "tools": [EXEC_TOOL], "tool_choice": "none"},
        {
            "messages": [user("hi")],
            "stream": False,
            "tools": [EXEC_CHAT],
            "tool_choice": "none",
            "parallel_tool_calls": True,
        },
    ),
    (
        "tool_choice naming a function",
        {
            "model": "m",
            "input": "hi",
            "tools": [EXEC_TOOL],
            "tool_choice": {"type": "function", "name": "exec"},
        },
        {
            "messages": [user("hi")],
            "stream": False,
            "tools": [EXEC_CHAT],
            "tool_choice": {"type": "function", "function": {"name": "exec"}},
            "parallel_tool_calls": True,
        },
    ),
    (
        "text.format json_schema becomes response_format",
        {
            "model": "m",
            "input": "hi",
            "text": {
                "format": {
                    "type": "json_schema",
                    "name": "answer",
                    "schema": {"type": "object"},
                    "strict": True,
                }
            },
        },
        {
            "messages": [user("hi")],
            "stream": False,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": {"type": "object"}, "strict": True},
            },
        },
    ),
    (
        "text.format json_object",
        {"model": "m", "input": "hi", "text": {"format": {"type": "json_object"}}},
        {"messages": [user("hi")], "stream": False, "response_format": {"type": "json_object"}},
    ),
]


@pytest.mark.parametrize(
    "req,expected", [t[1:] for t in TRANSLATIONS], ids=[t[0] for t in TRANSLATIONS]
)
def test_request_translation(req, expected):
    assert upstream(req) == expected


def test_context_carries_model_tool_names_and_dropped_tools():
    req = R.parse_request(
        raw(
            {
                "model": "tiny",
                "input": "hi",
                "tools": [
                    EXEC_TOOL,
                    {"type": "web_search"},
                    {
                        "type": "namespace",
                        "name": "agents",
                        "description": "d",
                        "tools": [{"type": "function", "name": "wait"}],
                    },
                    {"type": "file_search", "vector_store_ids": ["vs"]},
                ],
            }
        )
    )
    _, ctx = R.to_upstream(req)
    assert ctx.model == "tiny"
    assert ctx.response_id.startswith("resp_")
    assert ctx.namespaced == {"agents__wait": ("agents", "wait")}
    assert ctx.dropped_tools == ["web_search", "file_search"]


def test_codex_shaped_request():
    """The shape Codex 0.171 sends (captured from `codex exec` against a local server; texts
    replaced): typed message items with ids, developer messages, strict function tools, a
    namespace of sub-agent tools, a web_search tool, and on later turns its own reasoning items
    and namespaced calls echoed back."""
    codex = {
        "model": "tiny",
        "stream": True,
        "instructions": None,
        "input": [
            {
                "type": "message",
                "id": "msg_1",
                "role": "developer",
                "content": [{"type": "input_text", "text": "You are a coding agent."}],
            },
            {
                "type": "message",
                "id": "msg_2",
                "role": "user",
                "content": [{"type": "input_text", "text": "<environment_context/>"}],
            },
            {
                "type": "message",
                "id": "msg_3",
                "role": "user",
                "content": [{"type": "input_text", "text": "Say hi"}],
            },
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "run echo"}],
                "encrypted_content": None,
            },
            {
                "type": "function_call",
                "status": "completed",
                "id": "fc_1",
                "name": "exec_command",
                "arguments": '{"cmd": "echo hi"}',
                "call_id": "call_A",
            },
            {
                "type": "function_call",
                "status": "completed",
                "id": "fc_2",
                "name": "wait_agent",
                "namespace": "multi_agent_v1",
                "arguments": '{"targets": ["x"]}',
                "call_id": "call_B",
            },
            {"type": "function_call_output", "id": "fco_1", "call_id": "call_A", "output": "hi\n"},
            {"type": "function_call_output", "id": "fco_2", "call_id": "call_B", "output": "no"},
        ],
        "tools": [
            {
                "type": "function",
                "name": "exec_command",
                "description": "Runs a command.",
                "strict": False,
                "parameters": {
                    "type": "object",
                    "properties": {"cmd": {"type": "string"}},
                    "required": ["cmd"],
                    "additionalProperties": False,
                },
            },
            {
                "type": "namespace",
                "name": "multi_agent_v1",
                "description": "Sub-agents.",
                "tools": [
                    {
                        "type": "function",
                        "name": "wait_agent",
                        "description": "Wait.",
                        "strict": False,
                        "parameters": {"type": "object", "properties": {}},
                    }
                ],
            },
            {"type": "web_search", "external_web_access": False},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "k",
        "client_metadata": {"turn_id": "t"},
    }
    assert upstream(codex) == {
        "messages": [
            {"role": "system", "content": "You are a coding agent."},
            user("<environment_context/>"),
            user("Say hi"),
            {
                "role": "assistant",
                "content": None,
                "reasoning": "run echo",
                "tool_calls": [
                    tool_call("call_A", "exec_command", '{"cmd": "echo hi"}'),
                    tool_call("call_B", "multi_agent_v1__wait_agent", '{"targets": ["x"]}'),
                ],
            },
            {"role": "tool", "tool_call_id": "call_A", "content": "hi\n"},
            {"role": "tool", "tool_call_id": "call_B", "content": "no"},
        ],
        "stream": True,
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "exec_command",
                    "description": "Runs a command.",
                    "parameters": codex["tools"][0]["parameters"],
                    "strict": False,
                },
            },
            {
                "type": "function",
                "function": {
                    "name": "multi_agent_v1__wait_agent",
                    "description": "Wait.",
                    "parameters": {"type": "object", "properties": {}},
                    "strict": False,
                },
            },
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
    }


# -- previous_response_id ------------------------------------------------------------------------


def nonstream_response(message: dict, finish: str, prompt: int = 9, completion: int = 4) -> dict:
    """vLLM's non-streamed chat completion with return_token_ids."""
    return {
        "id": "chatcmpl-2",
        "object": "chat.completion",
        "created": 1,
        "model": "tiny",
        "prompt_token_ids": list(range(prompt)),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", **message},
                "logprobs": None,
                "finish_reason": finish,
                "token_ids": list(range(completion)),
            }
        ],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }


def test_previous_response_chain():
    first = R.parse_request(
        raw(
            {
                "model": "m",
                "instructions": "Old rules.",
                "input": "list files",
                "tools": [EXEC_TOOL],
            }
        )
    )
    _, ctx1 = R.to_upstream(first)
    body1 = R.from_upstream(
        nonstream_response(
            {
                "content": None,
                "reasoning": "use ls",
                "tool_calls": [tool_call("call_7", "exec", '{"cmd": "ls"}')],
            },
            "tool_calls",
        ),
        ctx1,
    )
    stored = R.conversation_items(first, body1)
    resp1 = msgspec.json.decode(body1)
    assert stored == [
        {"type": "message", "role": "user", "content": "list files"},
        *resp1["output"],
    ]

    second = R.parse_request(
        raw(
            {
                "model": "m",
                "instructions": "New rules.",
                "previous_response_id": resp1["id"],
                "input": [fco("call_7", "a.txt")],
                "tools": [EXEC_TOOL],
            }
        )
    )
    body, ctx2 = R.to_upstream(second, stored)
    assert body["messages"] == [
        {"role": "system", "content": "New rules."},  # instructions are not carried over
        user("list files"),
        {
            "role": "assistant",
            "content": None,
            "reasoning": "use ls",
            "tool_calls": [tool_call("call_7", "exec", '{"cmd": "ls"}')],
        },
        {"role": "tool", "tool_call_id": "call_7", "content": "a.txt"},
    ]
    # The chain continues: the next link stores everything so far.
    body2 = R.from_upstream(nonstream_response({"content": "One file."}, "stop"), ctx2)
    chain = R.conversation_items(second, body2, stored)
    assert chain[: len(stored)] == stored
    assert chain[len(stored)] == fco("call_7", "a.txt")
    assert chain[-1]["content"][0]["text"] == "One file."
    third = R.parse_request(
        raw({"model": "m", "previous_response_id": "resp_x", "input": "and now?"})
    )
    assert [m["role"] for m in R.to_upstream(third, chain)[0]["messages"]] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
    ]


# -- bad input -----------------------------------------------------------------------------------

BAD = [
    # (name, raw body, param the error must name, words its message must contain)
    ("invalid JSON", b'{"model": "m", "input": [', None, "not valid JSON"),
    ("not an object", b"[1]", None, "JSON object"),
    ("missing model", raw({"input": "x"}), "model", "model"),
    ("missing input", raw({"model": "m"}), "input", "input"),
    ("input of wrong type", raw({"model": "m", "input": 5}), "input", "Expected"),
    ("model of wrong type", raw({"model": 5, "input": "x"}), "model", "Expected `str`"),
    (
        "content of wrong type",
        raw({"model": "m", "input": [{"role": "user", "content": 5}]}),
        "input[0].content",
        "Expected",
    ),
    (
        "unknown role",
        raw({"model": "m", "input": [{"role": "wizard", "content": "x"}]}),
        "input[0].role",
        "wizard",
    ),
    (
        "unknown item type",
        raw({"model": "m", "input": [user("x"), {"type": "item_reference", "id": "a"}]}),
        "input[1].type",
        "item_reference",
    ),
    (
        "function_call without call_id",
        raw({"model": "m", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}),
        "input[0].call_id",
        "call_id",
    ),
    (
        "arguments not a string",
        raw({"model": "m", "input": [fc("c", "f", {"a": 1})]}),
        "input[0].arguments",
        "Expected `str`",
    ),
    (
        "orphan function_call_output",
        raw({"model": "m", "input": [user("x"), fco("call_9", "out")]}),
        "input[1].call_id",
        "call_9",
    ),
    (
        "function_call_output before its call",
        raw({"model": "m", "input": [fco("call_1", "out"), fc("call_1", "f")]}),
        "input[0].call_id",
        "call_1",
    ),
    (
        "image input",
        raw(
            {
                "model": "m",
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "look"},
                            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
                        ],
                    }
                ],
            }
        ),
        "input[0].content[1].type",
        "text-only",
    ),
    (
        "image in a tool output",
        raw(
            {
                "model": "m",
                "input": [
                    fc("c", "f"),
                    fco("c", [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]),
                ],
            }
        ),
        "input[1].output[0].type",
        "text-only",
    ),
    (
        "unknown content part",
        raw({"model": "m", "input": [{"role": "user", "content": [{"type": "video"}]}]}),
        "input[0].content[0].type",
        "video",
    ),
    (
        "tool parameters not an object schema",
        raw({"model": "m", "input": "x", "tools": [dict(EXEC_TOOL, parameters={"type": "array"})]}),
        "tools[0].parameters.type",
        "must be 'object'",
    ),
    (
        "tool parameters of wrong type",
        raw({"model": "m", "input": "x", "tools": [dict(EXEC_TOOL, parameters="{}")]}),
        "tools[0].parameters",
        "Expected",
    ),
    (
        "function tool without name",
        raw({"model": "m", "input": "x", "tools": [{"type": "function", "parameters": FN_PARAMS}]}),
        "tools[0].name",
        "name",
    ),
    (
        "custom tool",
        raw(
            {
                "model": "m",
                "input": "x",
                "tools": [{"type": "custom", "name": "apply_patch", "description": "d"}],
            }
        ),
        "tools[0].type",
        "'custom' are not supported",
    ),
    (
        "local_shell tool",
        raw({"model": "m", "input": "x", "tools": [{"type": "local_shell"}]}),
        "tools[0].type",
        "'local_shell' are not supported",
    ),
    (
        "unknown tool type",
        raw({"model": "m", "input": "x", "tools": [{"type": "teleport"}]}),
        "tools[0].type",
        "teleport",
    ),
    (
        "custom tool inside a namespace",
        raw(
            {
                "model": "m",
                "input": "x",
                "tools": [
                    {
                        "type": "namespace",
                        "name": "ns",
                        "description": "d",
                        "tools": [{"type": "custom", "name": "c"}],
                    }
                ],
            }
        ),
        "tools[0].tools[0].type",
        "custom",
    ),
    (
        "duplicate tool name",
        raw({"model": "m", "input": "x", "tools": [EXEC_TOOL, EXEC_TOOL]}),
        "tools",
        "exec",
    ),
    (
        "unknown tool_choice",
        raw({"model": "m", "input": "x", "tools": [EXEC_TOOL], "tool_choice": "always"}),
        "tool_choice",
        "always",
    ),
    (
        "tool_choice names an undeclared function",
        raw(
            {
                "model": "m",
                "input": "x",
                "tools": [EXEC_TOOL],
                "tool_choice": {"type": "function", "name": "fly"},
            }
        ),
        "tool_choice.name",
        "fly",
    ),
    (
        "tool_choice required without function tools",
        raw(
            {
                "model": "m",
                "input": "x",
                "tools": [{"type": "web_search"}],
                "tool_choice": "required",
            }
        ),
        "tool_choice",
        "required",
    ),
    (
        "tool_choice of a hosted tool",
        raw({"model": "m", "input": "x", "tool_choice": {"type": "web_search_preview"}}),
        "tool_choice.type",
        "web_search_preview",
    ),
    (
        "max_output_tokens of wrong type",
        raw({"model": "m", "input": "x", "max_output_tokens": "64"}),
        "max_output_tokens",
        "Expected `int | null`",
    ),
    (
        "unknown reasoning effort",
        raw({"model": "m", "input": "x", "reasoning": {"effort": "maximal"}}),
        "reasoning.effort",
        "maximal",
    ),
    (
        "json_schema format without schema",
        raw({"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}),
        "text.format",
        "schema",
    ),
    (
        "previous_response_id the core could not resolve",
        raw({"model": "m", "input": "x", "previous_response_id": "resp_gone"}),
        "previous_response_id",
        "resp_gone",
    ),
    ("no message at all", raw({"model": "m", "input": []}), "input", "no message"),
]


@pytest.mark.parametrize("body,param,words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_a_400_naming_the_field(body, param, words):
    with pytest.raises(GatewayError) as info:
        R.to_upstream(R.parse_request(body))
    err = info.value
    assert err.status == 400
    assert err.param == param
    assert words in err.message
    status, payload = R.render_error(err)
    assert status == 400
    assert msgspec.json.decode(payload) == {
        "error": {
            "message": err.message,
            "type": "invalid_request_error",
            "param": param,
            "code": None,
        }
    }


def test_context_overflow_renders_openai_code():
    err = GatewayError(
        400,
        "This model's maximum context length is 2048 tokens.",
        "context_length_exceeded",
        code="context_length_exceeded",
    )
    status, payload = R.render_error(err)
    assert status == 400
    assert msgspec.json.decode(payload)["error"]["code"] == "context_length_exceeded"


# -- streaming conformance -----------------------------------------------------------------------


def make_ctx(**request):
    req = R.parse_request(raw({"model": "tiny", "input": "hi", "stream": True, **request}))
    return R.to_upstream(req)[1]


def run_stream(ctx, chunks) -> tuple[list[dict], bytes]:
    """Events of the whole stream, checked against the SDK's event types; and the bytes `feed`
    produced, which must not hold a final event."""
    stream = R.Stream(ctx)
    fed = b"".join(stream.feed(c) for c in chunks)
    final = stream.close()
    events = parse_sse(fed + final)
    for ev in events:
        SDK_EVENT.validate_python(ev)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert b"response.completed" not in fed and b"response.incomplete" not in fed
    assert parse_sse(final)[-1]["type"] in ("response.completed", "response.incomplete")
    return events, fed


def lifecycle_response(ctx, status, output, usage, incomplete=None, **echo):
    """A `response` object as the API reference documents it, echoing the request."""
    return {
        "id": ctx.response_id,
        "object": "response",
        "created_at": ctx.created_at,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "model": "tiny",
        "output": output,
        "usage": usage,
        "instructions": None,
        "max_output_tokens": None,
        "metadata": {},
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": None,
        "store": True,
        "temperature": None,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": None,
        "truncation": "disabled",
        **echo,
    }


def usage(prompt, completion):
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def message(item_id, text, status="completed"):
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def message_events(index, item_id, deltas, status="completed"):
    """added, part added, deltas (as fed); and the closing events of a text message."""
    text = "".join(deltas)
    where = {"item_id": item_id, "output_index": index}
    opening = [
        {
            "type": "response.output_item.added",
            "output_index": index,
            "item": {
                "id": item_id,
                "type": "message",
                "status": "in_progress",
                "content": [],
                "role": "assistant",
            },
        },
        {
            "type": "response.content_part.added",
            **where,
            "content_index": 0,
            "part": {"type": "output_text", "text": "", "annotations": []},
        },
    ] + [
        {
            "type": "response.output_text.delta",
            **where,
            "content_index": 0,
            "delta": d,
            "logprobs": [],
        }
        for d in deltas
    ]
    closing = [
        {
            "type": "response.output_text.done",
            **where,
            "content_index": 0,
            "text": text,
            "logprobs": [],
        },
        {
            "type": "response.content_part.done",
            **where,
            "content_index": 0,
            "part": {"type": "output_text", "text": text, "annotations": []},
        },
        {
            "type": "response.output_item.done",
            "output_index": index,
            "item": message(item_id, text, status),
        },
    ]
    return opening, closing


def strip_seq(events):
    return [{k: v for k, v in e.items() if k != "sequence_number"} for e in events]


def test_stream_text():
    ctx = make_ctx()
    chunks = [
        first_chunk(),
        chunk({"content": "Hel"}),
        chunk({"content": "lo"}),
        chunk({"content": " world"}, "stop"),
        usage_chunk(12, 3),
    ]
    events, _ = run_stream(ctx, chunks)
    start = lifecycle_response(ctx, "in_progress", [], None)
    mid = events[2]["item"]["id"]
    assert mid.startswith("msg_")
    opening, closing = message_events(0, mid, ["Hel", "lo", " world"])
    final = lifecycle_response(ctx, "completed", [message(mid, "Hello world")], usage(12, 3))
    assert strip_seq(events) == [
        {"type": "response.created", "response": start},
        {"type": "response.in_progress", "response": start},
        *opening,
        *closing,
        {"type": "response.completed", "response": final},
    ]
    Response.model_validate(events[-1]["response"])


def test_stream_reasoning_text_then_tool_call_split_over_chunks():
    ctx = make_ctx(tools=[EXEC_TOOL])
    chunks = [
        first_chunk(),
        chunk({"reasoning": "Need "}),
        chunk({"reasoning": "a listing."}),
        chunk({"content": "Let me "}),
        chunk({"content": "look."}),
        chunk(call_start(0, "chatcmpl-tool-1", "exec")),
        chunk(call_args(0, '{"cmd"')),
        chunk(call_args(0, ': "l')),
        chunk(call_args(0, 's"}'), "tool_calls"),
        usage_chunk(40, 12),
    ]
    events, fed = run_stream(ctx, chunks)
    rid, mid, fid = (events[i]["item"]["id"] for i in (2, 9, 16))
    assert (rid[:3], mid[:4], fid[:3]) == ("rs_", "msg_", "fc_")
    assert len({rid, mid, fid}) == 3
    reasoning = {
        "id": rid,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "Need a listing."}],
        "encrypted_content": None,
        "status": "completed",
    }
    call = {
        "id": fid,
        "type": "function_call",
        "call_id": "chatcmpl-tool-1",
        "name": "exec",
        "arguments": '{"cmd": "ls"}',
        "status": "completed",
    }
    r_where = {"item_id": rid, "output_index": 0}
    f_where = {"item_id": fid, "output_index": 2}
    m_open, m_close = message_events(1, mid, ["Let me ", "look."])
    tools_echo = {"tools": [EXEC_TOOL]}
    expected = [
        {
            "type": "response.created",
            "response": lifecycle_response(ctx, "in_progress", [], None, **tools_echo),
        },
        {
            "type": "response.in_progress",
            "response": lifecycle_response(ctx, "in_progress", [], None, **tools_echo),
        },
        {
            "type": "response.output_item.added",
            "output_index": 0,
            "item": {
                "id": rid,
                "type": "reasoning",
                "status": "in_progress",
                "content": [],
                "summary": [],
            },
        },
        {
            "type": "response.content_part.added",
            **r_where,
            "content_index": 0,
            "part": {"type": "reasoning_text", "text": ""},
        },
        {"type": "response.reasoning_text.delta", **r_where, "content_index": 0, "delta": "Need "},
        {
            "type": "response.reasoning_text.delta",
            **r_where,
            "content_index": 0,
            "delta": "a listing.",
        },
        {
            "type": "response.reasoning_text.done",
            **r_where,
            "content_index": 0,
            "text": "Need a listing.",
        },
        {
            "type": "response.content_part.done",
            **r_where,
            "content_index": 0,
            "part": {"type": "reasoning_text", "text": "Need a listing."},
        },
        {"type": "response.output_item.done", "output_index": 0, "item": reasoning},
        *m_open,
        *m_close,
        {
            "type": "response.output_item.added",
            "output_index": 2,
            "item": dict(call, arguments="", status="in_progress"),
        },
        {"type": "response.function_call_arguments.delta", **f_where, "delta": '{"cmd"'},
        {"type": "response.function_call_arguments.delta", **f_where, "delta": ': "l'},
        {"type": "response.function_call_arguments.delta", **f_where, "delta": 's"}'},
        # Everything below comes from close(): the harness runs the call on its done event.
        {"type": "response.function_call_arguments.done", **f_where, "arguments": '{"cmd": "ls"}'},
        {"type": "response.output_item.done", "output_index": 2, "item": call},
        {
            "type": "response.completed",
            "response": lifecycle_response(
                ctx,
                "completed",
                [reasoning, message(mid, "Let me look."), call],
                usage(40, 12),
                **tools_echo,
            ),
        },
    ]
    assert strip_seq(events) == expected
    assert b"response.output_item.done" in fed  # reasoning and message closed mid-stream
    assert b"response.function_call_arguments.done" not in fed


def test_stream_parallel_calls_with_namespace_close_in_order():
    ctx = make_ctx(
        tools=[
            EXEC_TOOL,
            {
                "type": "namespace",
                "name": "agents",
                "description": "d",
                "tools": [{"type": "function", "name": "wait", "parameters": {"type": "object"}}],
            },
        ]
    )
    chunks = [
        first_chunk(),
        chunk(call_start(0, "call_a", "exec")),
        chunk(call_args(0, '{"cmd": "ls"}')),
        chunk(call_start(1, "call_b", "agents__wait")),
        chunk(call_args(1, "{}"), "tool_calls"),
        usage_chunk(5, 9),
    ]
    events, _ = run_stream(ctx, chunks)
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [d["output_index"] for d in done] == [0, 1]
    assert [{k: d["item"][k] for k in ("call_id", "name", "arguments")} for d in done] == [
        {"call_id": "call_a", "name": "exec", "arguments": '{"cmd": "ls"}'},
        {"call_id": "call_b", "name": "wait", "arguments": "{}"},
    ]
    assert "namespace" not in done[0]["item"] and done[1]["item"]["namespace"] == "agents"
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert added[1]["item"]["namespace"] == "agents" and added[1]["item"]["name"] == "wait"
    assert events[-1]["response"]["output"] == [d["item"] for d in done]


def test_stream_length_stop_is_incomplete():
    ctx = make_ctx(max_output_tokens=3)
    chunks = [
        first_chunk(),
        chunk({"content": "a"}),
        chunk({"content": "b"}),
        chunk({"content": "c"}, "length"),
        usage_chunk(4, 3),
    ]
    events, _ = run_stream(ctx, chunks)
    mid = events[2]["item"]["id"]
    _, closing = message_events(0, mid, ["a", "b", "c"], status="incomplete")
    assert strip_seq(events[-4:]) == [
        *closing,
        {
            "type": "response.incomplete",
            "response": lifecycle_response(
                ctx,
                "incomplete",
                [message(mid, "abc", "incomplete")],
                usage(4, 3),
                {"reason": "max_output_tokens"},
                max_output_tokens=3,
            ),
        },
    ]


def test_stream_failure_mid_stream():
    ctx = make_ctx(tools=[EXEC_TOOL])
    stream = R.Stream(ctx)
    fed = stream.feed(first_chunk()) + stream.feed(chunk({"content": "Hi"}))
    fed += stream.feed(chunk(call_start(0, "call_a", "exec")))
    tail = parse_sse(stream.fail(GatewayError(502, "upstream stream broke", "upstream_error")))
    for ev in tail:
        SDK_EVENT.validate_python(ev)
    seq = len(parse_sse(fed))
    mid = parse_sse(fed)[2]["item"]["id"]
    assert [e["sequence_number"] for e in tail] == [seq, seq + 1]
    assert tail[0] == {
        "type": "error",
        "sequence_number": seq,
        "code": "server_error",
        "message": "upstream stream broke",
        "param": None,
    }
    failed = tail[1]["response"]
    assert tail[1]["type"] == "response.failed"
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": "server_error", "message": "upstream stream broke"}
    assert failed["output"][0] == message(mid, "Hi")
    assert failed["output"][1]["status"] == "incomplete"
    # The half-streamed call is never announced as done: a harness would run it.
    assert not any(
        e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"
        for e in parse_sse(fed) + tail
    )


def test_stream_failure_before_any_chunk_and_context_overflow_code():
    ctx = make_ctx()
    events = parse_sse(
        R.Stream(ctx).fail(
            GatewayError(
                400,
                "maximum context length is 2048 tokens",
                "context_length_exceeded",
                code="context_length_exceeded",
            )
        )
    )
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "error",
        "response.failed",
    ]
    # Codex reads this code to report a full context window (the SDK's literal list lacks it).
    assert events[2]["code"] == "context_length_exceeded"
    assert events[3]["response"]["error"]["code"] == "context_length_exceeded"


def test_stream_response_is_what_close_sends():
    ctx = make_ctx()
    stream = R.Stream(ctx)
    for c in (first_chunk(), chunk({"content": "x"}, "stop"), usage_chunk(1, 1)):
        stream.feed(c)
    early = stream.response()
    assert parse_sse(stream.close())[-1]["response"] == early


# -- the official SDK as the client --------------------------------------------------------------


@pytest.fixture
async def sdk_server():
    """A tiny server that runs the SDK's real request through this module and answers with a
    scripted vLLM generation, streamed through `Stream` or whole through `from_upstream`."""
    state: dict = {"seen": []}

    async def handle(request: web.Request) -> web.StreamResponse:
        req = R.parse_request(await request.read())
        body, ctx = R.to_upstream(req)
        state["seen"].append(body)
        if not body["stream"]:
            return web.Response(
                body=R.from_upstream(state["whole"], ctx), content_type="application/json"
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        stream = R.Stream(ctx)
        for c in state["chunks"]:
            piece = stream.feed(c)
            if piece:
                await resp.write(piece)
        await resp.write(stream.close())
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/responses", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
    yield client, state
    await client.close()
    await runner.cleanup()


SDK_TOOLS = [
    {
        "type": "function",
        "name": "exec",
        "description": "Run",
        "parameters": FN_PARAMS,
        "strict": False,
    }
]

TOOL_TURN = [
    first_chunk(),
    chunk({"content": "Running "}),
    chunk({"content": "ls."}),
    chunk(call_start(0, "chatcmpl-tool-7", "exec")),
    chunk(call_args(0, '{"cmd":')),
    chunk(call_args(0, ' "ls"}'), "tool_calls"),
    usage_chunk(30, 8),
]


async def test_sdk_parses_stream_events(sdk_server):
    client, state = sdk_server
    state["chunks"] = TOOL_TURN
    events = [
        e
        async for e in await client.responses.create(
            model="tiny", instructions="Be brief.", input="list files", tools=SDK_TOOLS, stream=True
        )
    ]
    assert state["seen"][0]["messages"] == [
        {"role": "system", "content": "Be brief."},
        user("list files"),
    ]
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1].response
    assert final.status == "completed"
    assert final.output_text == "Running ls."
    call = final.output[1]
    assert (call.type, call.call_id, call.name, call.arguments, call.status) == (
        "function_call",
        "chatcmpl-tool-7",
        "exec",
        '{"cmd": "ls"}',
        "completed",
    )
    assert (final.usage.input_tokens, final.usage.output_tokens, final.usage.total_tokens) == (
        30,
        8,
        38,
    )
    assert final.instructions == "Be brief." and final.tools[0].name == "exec"


async def test_sdk_stream_helper_final_response(sdk_server):
    client, state = sdk_server
    state["chunks"] = TOOL_TURN
    async with client.responses.stream(model="tiny", input="list files", tools=SDK_TOOLS) as s:
        deltas = [e.delta async for e in s if e.type == "response.output_text.delta"]
        final = await s.get_final_response()
    assert deltas == ["Running ", "ls."]
    assert final.output_text == "Running ls."
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output[1].arguments == '{"cmd": "ls"}'
    assert final.output[1].parsed_arguments is None  # non-strict tool: the SDK leaves it raw


async def test_sdk_stream_incomplete(sdk_server):
    client, state = sdk_server
    state["chunks"] = [
        first_chunk(),
        chunk({"content": "tr"}),
        chunk({"content": "unc"}, "length"),
        usage_chunk(3, 2),
    ]
    events = [
        e
        async for e in await client.responses.create(
            model="tiny", input="x", max_output_tokens=2, stream=True
        )
    ]
    assert state["seen"][0]["max_tokens"] == 2
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.status == "incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output[0].status == "incomplete"
    assert last.response.output_text == "trunc"


async def test_sdk_non_streaming(sdk_server):
    client, state = sdk_server
    state["whole"] = nonstream_response(
        {
            "content": "Running ls.",
            "reasoning": "list first",
            "tool_calls": [tool_call("chatcmpl-tool-3", "exec", '{"cmd": "ls"}')],
        },
        "tool_calls",
        prompt=21,
        completion=13,
    )
    resp = await client.responses.create(model="tiny", input="list files", tools=SDK_TOOLS)
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.status == "completed" and resp.model == "tiny"
    assert [item.type for item in resp.output] == ["reasoning", "message", "function_call"]
    assert resp.output[0].content[0].text == "list first"
    assert resp.output_text == "Running ls."
    assert resp.output[2].call_id == "chatcmpl-tool-3"
    assert resp.usage.total_tokens == 34
    assert resp.parallel_tool_calls is True and resp.tool_choice == "auto"
    Response.model_validate(resp.to_dict())


# -- properties ----------------------------------------------------------------------------------

TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)


@st.composite
def pieces(draw, text: str) -> list[str]:
    """`text` cut at arbitrary places (a piece may be empty, as a vLLM delta can be)."""
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=6)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@st.composite
def generations(draw):
    reasoning = draw(TEXT)
    content = draw(TEXT)
    calls = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["exec", "agents__wait"]),
                TEXT.map(lambda s: json.dumps({"a": s})),
            ),
            max_size=3,
        )
    )
    finish = draw(st.sampled_from(["stop", "length"] + (["tool_calls"] if calls else [])))
    chunks = [first_chunk()]
    chunks += [chunk({"reasoning": p}) for p in draw(pieces(reasoning))]
    chunks += [chunk({"content": p}) for p in draw(pieces(content))]
    for i, (name, args) in enumerate(calls):
        first, *rest = draw(pieces(args))
        start = call_start(i, f"call_{i}", name)
        start["tool_calls"][0]["function"]["arguments"] = first
        chunks.append(chunk(start))
        chunks += [chunk(call_args(i, p)) for p in rest]
    if draw(st.booleans()):
        chunks[-1]["choices"][0]["finish_reason"] = finish
    else:
        chunks.append(chunk({}, finish))
    chunks.append(usage_chunk(7, len(chunks)))
    whole = {"content": content or None}
    if reasoning:
        whole["reasoning"] = reasoning
    if calls:
        whole["tool_calls"] = [tool_call(f"call_{i}", n, a) for i, (n, a) in enumerate(calls)]
    return (
        chunks,
        (reasoning, content, calls, finish),
        nonstream_response(whole, finish, 7, len(chunks) - 1),
    )


NS_TOOLS = [
    EXEC_TOOL,
    {
        "type": "namespace",
        "name": "agents",
        "description": "d",
        "tools": [{"type": "function", "name": "wait"}],
    },
]


@settings(max_examples=150, deadline=None)
@given(generations())
def test_any_split_reassembles_into_the_same_response(gen):
    chunks, (reasoning, content, calls, finish), whole = gen
    ctx = make_ctx(tools=NS_TOOLS)
    stream = R.Stream(ctx)
    events = parse_sse(b"".join(stream.feed(c) for c in chunks) + stream.close())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]

    incomplete = finish == "length"
    expected = []
    if reasoning:
        expected.append(
            {
                "type": "reasoning",
                "summary": [],
                "encrypted_content": None,
                "content": [{"type": "reasoning_text", "text": reasoning}],
            }
        )
    if content:
        expected.append(
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": content, "annotations": []}],
            }
        )
    for i, (name, args) in enumerate(calls):
        item = {"type": "function_call", "call_id": f"call_{i}", "name": name, "arguments": args}
        if name == "agents__wait":
            item.update(name="wait", namespace="agents")
        expected.append(item)
    for k, item in enumerate(expected):
        item["status"] = "incomplete" if incomplete and k == len(expected) - 1 else "completed"
    assert [{k: v for k, v in it.items() if k != "id"} for it in final["output"]] == expected
    assert final["status"] == ("incomplete" if incomplete else "completed")
    assert events[-1]["type"] == "response." + final["status"]

    # Deltas of each item add up to its final text; every item opens once and closes once.
    ids = [it["id"] for it in final["output"]]
    assert len(set(ids)) == len(ids)
    for k, item in enumerate(final["output"]):
        mine = [e for e in events if e.get("output_index") == k]
        assert [e["type"] for e in mine].count("response.output_item.added") == 1
        assert [e["type"] for e in mine].count("response.output_item.done") == 1
        joined = "".join(e["delta"] for e in mine if e["type"].endswith(".delta"))
        if item["type"] == "function_call":
            assert joined == item["arguments"]
        else:
            assert joined == item["content"][0]["text"]
    # Streaming and the whole response of the same generation are the same response.
    assert msgspec.json.decode(R.from_upstream(whole, ctx)) == final
