"""OpenAI legacy completions: a prompt (text or token ids) in, text out; the engine serves it
natively, so this checks the request and hides the capture fields the client did not ask for."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from gateway.protocols import chat
from gateway.protocols.errors import GatewayError
from gateway.protocols.openai_common import (
    Echo,
    check_single_choice,
    decode_checked,
    encode,
    render_error,
    strip_capture,
)
from gateway.protocols.resumable import Layout

NAME = "completions"
UPSTREAM_PATH = "/v1/completions"
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

Context = chat.Context


class _Shape(msgspec.Struct):
    model: str
    prompt: str | list[int]
    stream: bool = False
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool = False
    return_token_ids: bool | None = None
    stream_options: dict | None = None


def parse(raw: bytes, earlier: object = ()) -> tuple[dict, None]:
    """The checked body; a prompt has no messages to decode from an earlier request's."""
    return parse_request(raw), None


def parse_request(raw: bytes) -> dict:
    body, shape, *_ = decode_checked(
        raw, _Shape, " (one prompt per request: a string or a list of token ids)"
    )
    if not shape.prompt:
        raise GatewayError(400, "`prompt` is empty", param="prompt")
    if shape.echo:
        # Echoed prompt text would be indistinguishable from sampled text in the record.
        raise GatewayError(400, "`echo` is not supported by the recording gateway", param="echo")
    check_single_choice(body)
    return body


def to_upstream(body: dict) -> tuple[dict, Context]:
    echo = Echo(
        token_ids=bool(body.get("return_token_ids")), logprobs=body.get("logprobs") is not None
    )
    return body, chat.context(body, echo)


def from_upstream(resp: dict, ctx: Context) -> bytes:
    return encode(strip_capture(resp, ctx.echo))


Stream = chat.Stream


class CompletionsAdapter(chat.ChatAdapter):
    """Answers as chat does; a prompt has no chat messages, so the relay plans no continuation
    for it."""

    name = NAME
    upstream_path = UPSTREAM_PATH

    def parse(self, raw: bytes, earlier: Iterable[Layout] = ()) -> tuple[dict[str, Any], None]:
        return parse(raw, earlier)

    def to_upstream(
        self, req: dict[str, Any], history: list[Any] | None = None
    ) -> tuple[dict[str, Any], Context]:
        return to_upstream(req)


ADAPTER = CompletionsAdapter()
