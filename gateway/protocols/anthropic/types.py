"""The Anthropic Messages API's wire types: the request as msgspec decodes it, and the values
the adapter passes from request translation to emission. Unknown fields (cache_control,
citations, context_management, output_config, service_tier, ...) are accepted and ignored."""

from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal

import msgspec


class TextBlock(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ImageBlock(msgspec.Struct, tag="image", tag_field="type"):
    """Decoded only to be rejected with a clear message: the served model is text-only."""


class DocumentBlock(msgspec.Struct, tag="document", tag_field="type"):
    """Decoded only to be rejected with a clear message: the served model is text-only."""


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(msgspec.Struct, tag="tool_result", tag_field="type"):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(msgspec.Struct, tag="thinking", tag_field="type"):
    thinking: str


class RedactedThinkingBlock(msgspec.Struct, tag="redacted_thinking", tag_field="type"):
    pass


Block = (
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
)


class Message(msgspec.Struct):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class Tool(msgspec.Struct):
    name: str
    # Optional here so that a missing schema and a server tool (which has none) get messages
    # of their own instead of a bare "missing field".
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None
    strict: bool | None = None


class ToolChoiceAuto(msgspec.Struct, tag="auto", tag_field="type"):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(msgspec.Struct, tag="any", tag_field="type"):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(msgspec.Struct, tag="tool", tag_field="type"):
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(msgspec.Struct, tag="none", tag_field="type"):
    pass


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


class ThinkingConfig(msgspec.Struct):
    type: str
    budget_tokens: int | None = None


class Metadata(msgspec.Struct):
    user_id: str | None = None


class CountTokensBody(msgspec.Struct, kw_only=True):
    """`POST /v1/messages/count_tokens`: a Messages request without the output settings."""

    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesBody(CountTokensBody, kw_only=True):
    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    # Accepted and recorded with the raw request; the core pins sampling.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None


class Request(msgspec.Struct, frozen=True):
    """A decoded, validated request with its chat-completions parts already built."""

    body: CountTokensBody
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: str | dict[str, Any] | None
    parallel_tool_calls: bool | None
    prefill: bool


class Context(msgspec.Struct, frozen=True):
    model: str
    message_id: str
    stop_sequences: tuple[str, ...] = ()



def new_id(prefix: str) -> str:
    """A message or tool-use id, as Anthropic writes them."""
    return prefix + secrets.token_hex(12)
