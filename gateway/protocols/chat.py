"""OpenAI chat completions: the engine's own protocol, so translation is a pass-through that
checks the request and hides the capture fields the client did not ask for."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import msgspec

from gateway.protocols.adapter import Adapter
from gateway.protocols.adapter import Stream as StreamBase
from gateway.protocols.errors import GatewayError
from gateway.protocols.openai_common import (
    DONE,
    Echo,
    check_single_choice,
    data_frame,
    decode_checked,
    encode,
    render_error,
    strip_capture,
)
from gateway.protocols.request_common import check_object_schema
from gateway.protocols.resumable import Decoder, Layout

NAME = "chat"
UPSTREAM_PATH = "/v1/chat/completions"
__all__ = [
    "NAME",
    "UPSTREAM_PATH",
    "Context",
    "parse",
    "parse_request",
    "to_upstream",
    "from_upstream",
    "Stream",
    "render_error",
    "ADAPTER",
]

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


class _Function(msgspec.Struct):
    name: str
    parameters: dict | None = None


class _Tool(msgspec.Struct):
    function: _Function
    type: str = "function"


class _Called(msgspec.Struct):
    name: str | None = None
    arguments: str | dict | None = None


class _CallRef(msgspec.Struct):
    id: str | None = None
    function: _Called | None = None


class _Message(msgspec.Struct):
    role: str
    content: str | list[dict] | None = None
    tool_calls: list[_CallRef] | None = None
    tool_call_id: str | None = None


class _Shape(msgspec.Struct):
    """Only what must hold for the engine to accept the request; the rest passes through."""

    model: str
    messages: list[_Message]
    stream: bool = False
    tools: list[_Tool] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    return_token_ids: bool | None = None
    stream_options: dict | None = None


class Context(msgspec.Struct):
    model: str
    stream: bool
    echo: Echo
    include_usage: bool


def parse_request(raw: bytes) -> dict:
    return parse(raw)[0]


_MESSAGES = Decoder("messages")  # its layouts are only of bodies that passed `parse`


def parse(raw: bytes, earlier: Iterable[Layout] = ()) -> tuple[dict, Layout | None]:
    """The checked body, and its messages' layout for the requests after it. The messages
    resumed from an earlier request's passed these checks with it: only those after them are
    checked (`decode_checked`)."""
    body, shape, layout, first = decode_checked(raw, _Shape, earlier=earlier, decoder=_MESSAGES)
    if not shape.messages:
        raise GatewayError(400, "`messages` must hold at least one message", param="messages")
    open_calls = _open_calls(body["messages"], first)
    for i, m in enumerate(shape.messages, first):
        if m.role not in _ROLES:
            raise GatewayError(
                400, f"messages[{i}].role: unknown role {m.role!r}", param=f"messages[{i}].role"
            )
        if m.role == "assistant":
            open_calls = {c.id for c in m.tool_calls or ()}
        elif m.role == "tool" and m.tool_call_id not in open_calls:
            raise GatewayError(
                400, f"messages[{i}].tool_call_id: {m.tool_call_id!r} answers no tool call of the "
                "preceding assistant message", param=f"messages[{i}].tool_call_id",
            )
    for i, tool in enumerate(shape.tools or ()):
        if tool.function.parameters is not None:
            check_object_schema(tool.function.parameters, f"tools[{i}].function.parameters")
    check_single_choice(body)
    return body, layout


def _open_calls(messages: list[dict], end: int) -> set[str | None]:
    """The ids of the tool calls of the latest assistant message before `messages[end]` (the
    calls a tool message there may answer); the messages are checked ones."""
    for i in range(end - 1, -1, -1):
        if messages[i]["role"] == "assistant":
            return {c.get("id") for c in messages[i].get("tool_calls") or ()}
    return set()


def context(body: dict, echo: Echo) -> Context:
    """What answering a request needs to know of it (legacy completions too)."""
    return Context(
        model=body["model"],
        stream=bool(body.get("stream")),
        echo=echo,
        include_usage=bool((body.get("stream_options") or {}).get("include_usage")),
    )


def to_upstream(body: dict) -> tuple[dict, Context]:
    echo = Echo(
        token_ids=bool(body.get("return_token_ids")),
        logprobs=bool(body.get("logprobs")),
        reasoning=body.get("include_reasoning") is not False,
    )
    return body, context(body, echo)


def from_upstream(resp: dict, ctx: Context) -> bytes:
    return encode(strip_capture(resp, ctx.echo))


class Stream(StreamBase):
    __slots__ = ("_ctx",)

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx

    def feed(self, chunk: dict) -> bytes:
        # The usage-only chunk exists because the gateway asked for it; pass it on only when
        # the client asked too.
        if not chunk.get("choices") and chunk.get("usage") and not self._ctx.include_usage:
            return b""
        return data_frame(strip_capture(chunk, self._ctx.echo))

    def close(self) -> bytes:
        return DONE

    def fail(self, err: GatewayError) -> bytes:
        return data_frame(
            {
                "error": {
                    "message": err.message,
                    "type": err.kind,
                    "code": err.code,
                    "param": err.param,
                },
                "created": int(time.time()),
            }
        )


class ChatAdapter(Adapter[dict[str, Any], Context]):
    name = NAME
    passes_engine_ids = True

    def parse(
        self, raw: bytes, earlier: Iterable[Layout] = ()
    ) -> tuple[dict[str, Any], Layout | None]:
        return parse(raw, earlier)

    def to_upstream(
        self, req: dict[str, Any], history: list[Any] | None = None
    ) -> tuple[dict[str, Any], Context]:
        return to_upstream(req)

    def from_upstream(self, resp: dict[str, Any], ctx: Context) -> bytes:
        return from_upstream(resp, ctx)

    def stream(self, ctx: Context) -> Stream:
        return Stream(ctx)

    def render_error(self, err: GatewayError) -> tuple[int, bytes]:
        return render_error(err)


ADAPTER = ChatAdapter()
