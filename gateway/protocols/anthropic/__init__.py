"""Anthropic Messages API <-> vLLM chat completions. The package: types.py (the wire types),
translate.py (requests to chat requests, and the count_tokens helpers), resume.py (the
translation's resume cache), emit.py (whole responses and stream events), errors.py (error
bodies); here, the adapter the relay serves it through.

Decisions a reader cannot see from the code alone:
- Consecutive messages of one role form one turn, as the Messages API documents.
- `thinking` blocks of earlier assistant turns become the chat message's `reasoning` (vLLM hands
  it to the chat template as `reasoning`/`reasoning_content`); `redacted_thinking` is opaque
  data and is dropped. The `thinking` request setting is validated and otherwise ignored: the
  gateway core owns generation settings, and reasoning the engine returns (a reasoning parser is
  configured) comes back as thinking blocks whatever the setting.
- `tool_result` with `is_error: true` becomes a tool message whose text starts with "Error: "
  (chat tool messages have no error flag; the model must still see that the call failed).
- Tool-call arguments that are not a JSON object come back as `input: {}` (Anthropic clients
  need an object; the raw text stays in the recorded upstream response). Streaming passes the
  argument fragments through as they arrive, unchanged.
- A `role: "system"` message inside `messages` (Anthropic's mid-conversation system messages;
  Claude Code 2.1.197 sends one) stays a chat system message at its place; the Messages API
  accepts one only directly after a user message, so that is checked.
- A tool's `strict` (Anthropic's strict tool use) passes through to the chat tool: vLLM then
  holds the arguments to the schema, and only then does a small model produce valid calls.
- `stop_reason` is `stop_sequence` when vLLM reports (`stop_reason` of the choice) that one of
  the request's stop strings ended the output, `tool_use` whenever the reply holds a tool call
  and did not hit the length limit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gateway.protocols.adapter import Adapter
from gateway.protocols.anthropic.emit import Stream, from_upstream
from gateway.protocols.anthropic.errors import render_error
from gateway.protocols.anthropic.translate import (
    count_tokens_request,
    count_tokens_response,
    parse,
    parse_count_tokens,
    parse_request,
    to_upstream,
)
from gateway.protocols.anthropic.types import Context, MessagesBody, Request
from gateway.protocols.errors import GatewayError
from gateway.protocols.resumable import Layout

NAME = "anthropic"
__all__ = [
    "ADAPTER",
    "NAME",
    "Context",
    "MessagesBody",
    "Request",
    "Stream",
    "count_tokens_request",
    "count_tokens_response",
    "from_upstream",
    "parse",
    "parse_count_tokens",
    "parse_request",
    "render_error",
    "to_upstream",
]


class AnthropicAdapter(Adapter[Request, Context]):
    name = NAME
    normalises_messages = True  # turn by turn, so a resumed request's only once (resume.py)

    def parse(self, raw: bytes, earlier: Iterable[Layout] = ()) -> tuple[Request, Layout | None]:
        return parse(raw, earlier)

    def to_upstream(
        self, req: Request, history: list[Any] | None = None
    ) -> tuple[dict[str, Any], Context]:
        return to_upstream(req)

    def from_upstream(self, resp: dict[str, Any], ctx: Context) -> bytes:
        return from_upstream(resp, ctx)

    def stream(self, ctx: Context) -> Stream:
        return Stream(ctx)

    def render_error(self, err: GatewayError) -> tuple[int, bytes]:
        return render_error(err)


ADAPTER = AnthropicAdapter()
