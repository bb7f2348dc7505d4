"""The OpenAI Responses API's wire types: the request as msgspec decodes it, and the values the
adapter passes from request translation to emission. Fields this gateway does not read are
accepted and ignored."""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class _Part(msgspec.Struct, tag_field="type"):
    pass


class InputText(_Part, tag="input_text"):
    text: str


class OutputText(_Part, tag="output_text"):
    text: str


class InputImage(_Part, tag="input_image"):
    pass


class InputFile(_Part, tag="input_file"):
    pass


class InputAudio(_Part, tag="input_audio"):
    pass


_Parts = list[InputText | OutputText | InputImage | InputFile | InputAudio]


class _Item(msgspec.Struct, tag_field="type", omit_defaults=True):
    pass


class Message(_Item, tag="message"):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | _Parts


class FunctionCall(_Item, tag="function_call"):
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None


class FunctionCallOutput(_Item, tag="function_call_output"):
    call_id: str
    output: str | _Parts


class ReasoningText(msgspec.Struct, tag_field="type", tag="reasoning_text"):
    text: str


class Reasoning(_Item, tag="reasoning"):
    content: list[ReasoningText] | None = None


Item = Message | FunctionCall | FunctionCallOutput | Reasoning


class FunctionTool(msgspec.Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceTool(msgspec.Struct):
    name: str
    tools: list[dict[str, Any]]


class ReasoningConfig(msgspec.Struct, omit_defaults=True):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None


class TextFormat(msgspec.Struct, omit_defaults=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct, omit_defaults=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class Body(msgspec.Struct, kw_only=True):
    """The fields this gateway reads; others (prompt_cache_key, client_metadata, user, ...) are
    accepted and ignored."""

    model: str
    input: str | list[Item]
    instructions: str | None = None
    tools: list[dict[str, Any]] = []
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    store: bool = True
    stream: bool = False
    previous_response_id: str | None = None


class Request(msgspec.Struct):
    """A validated request: the body plus its tools in chat form, and its input as chat
    messages unless it continues a stored response (whose items `to_upstream` is given)."""

    body: Body
    chat_tools: list[dict[str, Any]]
    chat_tool_choice: str | dict[str, Any] | None
    namespaced: dict[str, tuple[str, str]]  # chat tool name -> (namespace, name)
    dropped_tools: list[str]
    messages: list[dict] | None = None


class Context(msgspec.Struct):
    model: str
    response_id: str
    created_at: int
    echo: dict[str, Any]  # request fields every response object repeats
    namespaced: dict[str, tuple[str, str]]
    dropped_tools: list[str]
