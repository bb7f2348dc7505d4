"""Anthropic Messages API <-> vLLM chat completions: request translation, response rendering,
the streaming adapter, error bodies and the count_tokens helpers.

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

import re
import secrets
from bisect import bisect_right
from collections.abc import Iterable
from typing import Annotated, Any, Literal, NamedTuple

import msgspec

from gateway import engine_ids
from gateway.protocols import segments
from gateway.protocols.adapter import Adapter
from gateway.protocols.adapter import Stream as StreamBase
from gateway.protocols.errors import GatewayError, bad_request, invalid_field, text_only
from gateway.protocols.normalize import normalize_messages
from gateway.protocols.resumable import Decoder, Layout
from gateway.protocols.segments import REASONING, TEXT, TOOL_CALL, Accumulator, Segment
from gateway.protocols.tools import chat_tool, chat_tool_choice, check_unique_names

NAME = "anthropic"
UPSTREAM_PATH = "/v1/chat/completions"

# ---------------------------------------------------------------------------------------------
# Wire types of the request. Unknown fields (cache_control, citations, context_management,
# output_config, service_tier, ...) are accepted and ignored.


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


# ---------------------------------------------------------------------------------------------
# Request side


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


_PATH_INDEX = re.compile(r"\[(\d+)\]")
_BAD_TAG = re.compile(r"^Invalid value (.*)$")


def _decode_error(err: msgspec.DecodeError) -> GatewayError:
    """msgspec says `Expected int, got str - at $.messages[0].content`; Anthropic names fields
    `messages.0.content: ...`."""
    text, path, missing = invalid_field(err)
    if not isinstance(err, msgspec.ValidationError):
        return bad_request(f"request body is not valid JSON: {text}")
    path = _PATH_INDEX.sub(r".\1", path).lstrip(".")
    if missing:
        text = "Field required"
    elif path.endswith("type") and (bad := _BAD_TAG.match(text)):
        text = f"unknown type {bad[1]}"
    if not path:
        return bad_request(f"request body: {text}")
    return bad_request(f"{path}: {text}", param=path)


def _content_value(texts: list[str]) -> str | list[dict[str, str]] | None:
    """One text stays a string; several stay separate parts, as the client sent them."""
    if not texts:
        return None
    if len(texts) == 1:
        return texts[0]
    return [{"type": "text", "text": t} for t in texts]


def _tool_result_text(block: ToolResultBlock, path: str) -> str:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts = []
        for k, item in enumerate(content):
            if not isinstance(item, TextBlock):
                raise _text_only(item, f"{path}.content.{k}")
            parts.append(item.text)
        text = "\n".join(parts)
    if block.is_error:
        return f"Error: {text}" if text else "Error"
    return text


def _text_only(block: Block, path: str) -> GatewayError:
    return text_only("image" if isinstance(block, ImageBlock) else "document", path)


def _misplaced(block: Block, role: str, path: str) -> GatewayError:
    kind = type(block).__struct_config__.tag
    return bad_request(f"{path}: {kind} blocks are not allowed in {role} messages", param=path)


def _user_turn(items: list[tuple[str, Block]], open_tool_ids: set[str]) -> list[dict[str, Any]]:
    """Tool results first (as tool messages, in the client's order), then the user's text."""
    tool_messages: list[dict[str, Any]] = []
    texts: list[str] = []
    answered: set[str] = set()
    for path, block in items:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock):
            tool_id = block.tool_use_id
            id_path = f"{path}.tool_use_id"
            if tool_id not in open_tool_ids:
                raise bad_request(
                    f"{id_path}: tool_result refers to tool_use id {tool_id!r}, which is not a "
                    "tool_use block of the preceding assistant turn",
                    param=id_path,
                )
            if tool_id in answered:
                raise bad_request(
                    f"{id_path}: a second tool_result for tool_use id {tool_id!r}", param=id_path
                )
            answered.add(tool_id)
            tool_messages.append(
                {
                    "role": "tool",
                    "tool_call_id": tool_id,
                    "content": _tool_result_text(block, path),
                }
            )
        elif isinstance(block, (ImageBlock, DocumentBlock)):
            raise _text_only(block, path)
        else:
            raise _misplaced(block, "user", path)
    if texts or not tool_messages:
        tool_messages.append({"role": "user", "content": _content_value(texts) or ""})
    return tool_messages


def _assistant_turn(items: list[tuple[str, Block]]) -> tuple[dict[str, Any], list[str]]:
    texts: list[str] = []
    reasoning: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    for path, block in items:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, RedactedThinkingBlock):
            continue
        elif isinstance(block, ToolUseBlock):
            tool_calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {
                        "name": block.name,
                        "arguments": msgspec.json.encode(block.input).decode(),
                    },
                }
            )
        elif isinstance(block, (ImageBlock, DocumentBlock)):
            raise _text_only(block, path)
        else:
            raise _misplaced(block, "assistant", path)
    message: dict[str, Any] = {"role": "assistant", "content": _content_value(texts)}
    if reasoning:
        message["reasoning"] = "\n".join(reasoning)
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message, [call["id"] for call in tool_calls]


def _turns(
    messages: list[Message], start: int = 0
) -> list[tuple[str, int, list[tuple[str, Block]]]]:
    """Consecutive user or assistant messages from `start` on merged: (role, index of its first
    message, blocks with their field paths). A system message is a turn of its own."""
    turns: list[tuple[str, int, list[tuple[str, Block]]]] = []
    for i in range(start, len(messages)):
        message = messages[i]
        if isinstance(message.content, str):
            items = [(f"messages.{i}.content", TextBlock(message.content))]
        else:
            items = [(f"messages.{i}.content.{j}", b) for j, b in enumerate(message.content)]
        if turns and turns[-1][0] == message.role != "system":
            turns[-1][2].extend(items)
        else:
            turns.append((message.role, i, items))
    return turns


def _opens_turn(messages: list[Message], index: int) -> bool:
    """Whether `messages[index]` starts a turn (see `_turns`)."""
    role = messages[index].role
    return index == 0 or role == "system" or role != messages[index - 1].role


def _system_message(system: str | list[TextBlock] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    text = system if isinstance(system, str) else "\n".join(block.text for block in system)
    return [{"role": "system", "content": text}] if text else []


def _system_turn(messages: list[Message], index: int) -> list[dict[str, Any]]:
    """A mid-conversation system message (Claude Code 2.1.197 sends them, with the beta
    `mid-conversation-system-2026-04-07`): kept as a chat system message at its place. The
    Messages API accepts one only directly after a user message, with text content."""
    message = messages[index]
    if index == 0 or messages[index - 1].role != "user":
        raise bad_request(
            f"messages.{index}.role: a system message must directly follow a user message",
            param=f"messages.{index}.role",
        )
    if isinstance(message.content, list):
        for j, block in enumerate(message.content):
            if not isinstance(block, TextBlock):
                raise _misplaced(block, "system", f"messages.{index}.content.{j}")
    return _system_message(message.content)


class _Translated(NamedTuple):
    """A body's messages as chat messages (its system prompt apart), with where each turn ends:
    a request resumed from this body (gateway/protocols/resumable.py) translates only the turns
    after the last one the two share whole. The earlier turns passed the checks with this body,
    and translate the same; the system prompt, which Claude Code changes every call (its
    billing line), is translated anew."""

    out: list[dict[str, Any]]
    ends: list[int]  # per turn: the index of the message after it
    sizes: list[int]  # per turn: len(out) after it
    open_ids: list[set[str]]  # per turn: the tool_use ids that a user turn after it may answer


def _shared_turns(messages: list[Message], earlier: _Translated | None, resumed: int) -> int:
    """How many of `earlier`'s turns are this request's too: those within its first `resumed`
    messages (the earlier body's), the last of them only if no new message joins it."""
    if earlier is None:
        return 0
    t = bisect_right(earlier.ends, resumed)
    return t - 1 if t and not _opens_turn(messages, earlier.ends[t - 1]) else t


def _chat_messages(
    body: CountTokensBody, layout: Layout | None = None
) -> tuple[list[dict[str, Any]], bool, _Translated]:
    """The upstream chat messages (normalised, so the relay does not go over them again),
    whether the last turn is an assistant prefill that the model continues, and the
    translation for the requests resumed from this one."""
    if not body.messages:
        raise bad_request("messages: at least one message is required", param="messages")
    earlier = None if layout is None else layout.derived_from()
    shared = _shared_turns(body.messages, earlier, layout.resumed if layout else 0)
    if shared:
        out = earlier.out[: earlier.sizes[shared - 1]]
        ends, sizes, open_ids = (part[:shared] for part in earlier[1:])
    else:
        out, ends, sizes, open_ids = [], [], [], []
    open_tool_ids = open_ids[-1] if open_ids else set()
    turns = _turns(body.messages, ends[-1] if ends else 0)
    after = [first for _, first, _ in turns[1:]] + [len(body.messages)]
    for (role, first, items), end in zip(turns, after):
        if role == "system":
            turn = _system_turn(body.messages, first)
        elif role == "user":
            turn = _user_turn(items, open_tool_ids)
            open_tool_ids = set()
        else:
            message, tool_ids = _assistant_turn(items)
            turn = [message]
            open_tool_ids = set(tool_ids)
        out.extend(normalize_messages(turn))  # message by message: see normalize.py
        ends.append(end)
        sizes.append(len(out))
        open_ids.append(open_tool_ids)
    last_role, last_index, _ = turns[-1]
    if last_role == "assistant" and open_tool_ids:
        raise bad_request(
            f"messages.{last_index}: the conversation ends with tool_use blocks; send their "
            "tool_result blocks in a user message",
            param=f"messages.{last_index}",
        )
    messages = normalize_messages(_system_message(body.system)) + out
    return messages, last_role == "assistant", _Translated(out, ends, sizes, open_ids)


def _chat_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        path = f"tools.{i}"
        if tool.type not in (None, "custom"):
            raise bad_request(
                f"{path}.type: tool type {tool.type!r} is not supported; only client tools "
                "(name, description, input_schema) are",
                param=f"{path}.type",
            )
        if not tool.name:
            raise bad_request(f"{path}.name: must not be empty", param=f"{path}.name")
        if tool.input_schema is None:
            raise bad_request(f"{path}.input_schema: Field required", param=f"{path}.input_schema")
        out.append(
            chat_tool(
                tool.name, tool.input_schema, tool.description, tool.strict, f"{path}.input_schema"
            )
        )
    check_unique_names(out, lambda i: f"tools.{i}.name")
    return out


_CHOICE_MODE = {"auto": "auto", "none": "none", "any": "required", "tool": "function"}


def _chat_tool_choice(
    choice: ToolChoice | None, tools: list[dict[str, Any]] | None
) -> tuple[str | dict[str, Any] | None, bool | None]:
    """(chat tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    tag = choice.__struct_config__.tag
    name = getattr(choice, "name", None)
    chat = chat_tool_choice(_CHOICE_MODE[tag], name, tools, f"type {tag!r}")
    if chat is None:
        return None, None
    return chat, False if getattr(choice, "disable_parallel_tool_use", None) else None


_MESSAGES = Decoder("messages", MessagesBody)
_COUNT_TOKENS = Decoder("messages", CountTokensBody)


def _parse(
    raw: bytes, decoder: Decoder, earlier: Iterable[Layout] = ()
) -> tuple[Request, Layout | None]:
    try:
        body, layout = decoder.decode(raw, earlier)
    except msgspec.DecodeError as err:
        raise _decode_error(err) from None
    messages, prefill, translated = _chat_messages(body, layout)
    tools = _chat_tools(body.tools)
    tool_choice, parallel = _chat_tool_choice(body.tool_choice, tools)
    if layout is not None:  # checked: the requests resumed from this one take it up
        layout.derived = translated
    return Request(body, messages, tools, tool_choice, parallel, prefill), layout


def parse_request(raw: bytes) -> Request:
    """Decode and validate a `POST /v1/messages` body."""
    return parse(raw)[0]


def parse(raw: bytes, earlier: Iterable[Layout] = ()) -> tuple[Request, Layout | None]:
    """`parse_request`, decoding from an `earlier` request's layout where it can, and the body's
    own layout for the requests after it."""
    return _parse(raw, _MESSAGES, earlier)


def parse_count_tokens(raw: bytes) -> Request:
    """Decode and validate a `POST /v1/messages/count_tokens` body (no max_tokens needed)."""
    return _parse(raw, _COUNT_TOKENS)[0]


def _template_fields(req: Request) -> dict[str, Any]:
    # A final assistant turn is a prefill: the model continues it instead of opening a new one.
    if req.prefill:
        return {"add_generation_prompt": False, "continue_final_message": True}
    return {"add_generation_prompt": True}


def to_upstream(req: Request) -> tuple[dict[str, Any], Context]:
    body = req.body
    if not isinstance(body, MessagesBody):
        raise TypeError("a count_tokens request goes upstream through count_tokens_request")
    upstream: dict[str, Any] = {
        "messages": req.messages,
        "max_tokens": body.max_tokens,
        "stream": bool(body.stream),
    }
    if req.tools:
        upstream["tools"] = req.tools
    if req.tool_choice is not None:
        upstream["tool_choice"] = req.tool_choice
    if req.parallel_tool_calls is not None:
        upstream["parallel_tool_calls"] = req.parallel_tool_calls
    if body.stop_sequences:
        upstream["stop"] = list(body.stop_sequences)
    if req.prefill:
        upstream.update(_template_fields(req))
    ctx = Context(
        model=body.model,
        message_id=_new_id("msg_"),
        stop_sequences=tuple(body.stop_sequences or ()),
    )
    return upstream, ctx


def count_tokens_request(req: Request) -> dict[str, Any]:
    """Body for vLLM's `POST /tokenize` (chat form); the caller adds `model`."""
    body: dict[str, Any] = {"messages": req.messages, **_template_fields(req)}
    if req.tools:
        body["tools"] = req.tools
    return body


def count_tokens_response(tokenize_resp: dict[str, Any]) -> bytes:
    return msgspec.json.encode({"input_tokens": tokenize_resp["count"]})


# ---------------------------------------------------------------------------------------------
# Response side: a mapping of the engine's output segments (see segments.py)


def _stop(acc: Accumulator, ctx: Context) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    reason = acc.finish_reason()
    if reason == segments.LENGTH:
        return "max_tokens", None
    if reason == segments.TOOL_CALLS:
        return "tool_use", None
    if reason == segments.STOP:
        if isinstance(acc.matched, str) and acc.matched in ctx.stop_sequences:
            return "stop_sequence", acc.matched
        return "end_turn", None
    raise GatewayError(502, f"upstream finished with reason {acc.raw_finish!r}", "upstream_error")


def _output_tokens(acc: Accumulator) -> int:
    completion = (acc.usage or {}).get("completion_tokens")
    return acc.output_tokens if completion is None else completion


def _tool_input(arguments: str) -> dict[str, Any]:
    if not arguments:
        return {}
    try:
        value = msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _block(seg: Segment) -> dict[str, Any]:
    """The content block of `seg` as a whole response holds it."""
    if seg.kind == REASONING:
        return {"type": "thinking", "thinking": seg.text(), "signature": ""}
    if seg.kind == TEXT:
        return {"type": "text", "text": seg.text()}
    return {
        "type": "tool_use",
        "id": seg.call_id or _new_id("toolu_"),
        "name": seg.name,
        "input": _tool_input(seg.text()),
    }


def from_upstream(resp: dict[str, Any], ctx: Context) -> bytes:
    acc = Accumulator()
    acc.feed(resp)
    stop_reason, stop_sequence = _stop(acc, ctx)
    input_tokens = (acc.usage or {}).get("prompt_tokens")
    return msgspec.json.encode(
        {
            "id": ctx.message_id,
            "type": "message",
            "role": "assistant",
            "model": ctx.model,
            "content": [_block(seg) for seg in acc.segments],
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {
                "input_tokens": acc.prompt_tokens if input_tokens is None else input_tokens,
                "output_tokens": _output_tokens(acc),
            },
        }
    )


_encode = msgspec.json.encode


def _frame(event: bytes, data: dict[str, Any]) -> bytes:
    return b"".join((b"event: ", event, b"\ndata: ", _encode(data), b"\n\n"))


_PING = _frame(b"ping", {"type": "ping"})
_MESSAGE_STOP = _frame(b"message_stop", {"type": "message_stop"})
_EMPTY_BLOCK = {
    REASONING: {"type": "thinking", "thinking": "", "signature": ""},
    TEXT: {"type": "text", "text": ""},
}


class Stream(StreamBase, segments.Sink):
    """vLLM chat-completion chunks in, Anthropic SSE events out.

    Each segment is a content block, with consecutive indices; at most one is open, and the
    next segment or the finish closes it. `message_delta` goes out with the upstream usage
    chunk (the core always asks for it); `message_stop` only from `close()`.
    """

    __slots__ = ("_ctx", "_acc", "_out", "_started", "_index", "_open", "_delta_sent")

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._acc = Accumulator()
        self._out: list[bytes] = []
        self._started = False
        self._index = -1  # index of the newest block
        self._open: Segment | None = None  # the segment whose block is open
        self._delta_sent = False

    def _start(self, prompt_tokens: int) -> None:
        self._started = True
        message = {
            "id": self._ctx.message_id,
            "type": "message",
            "role": "assistant",
            "model": self._ctx.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
        }
        self._out.append(_frame(b"message_start", {"type": "message_start", "message": message}))
        self._out.append(_PING)

    def _close_block(self) -> None:
        if self._open is not None:
            self._out.append(
                _frame(b"content_block_stop", {"type": "content_block_stop", "index": self._index})
            )
            self._open = None

    def start(self, seg: Segment) -> None:
        self._close_block()
        self._index += 1
        self._open = seg
        if seg.kind == TOOL_CALL:
            block = {
                "type": "tool_use",
                "id": seg.call_id or _new_id("toolu_"),
                "name": seg.name,
                "input": {},
            }
        else:
            block = _EMPTY_BLOCK[seg.kind]
        self._out.append(
            _frame(
                b"content_block_start",
                {"type": "content_block_start", "index": self._index, "content_block": block},
            )
        )

    def delta(self, seg: Segment, text: str) -> None:
        if seg is not self._open:
            if seg.kind == TOOL_CALL:
                # Blocks cannot interleave; vLLM's parsers finish one call before the next.
                raise GatewayError(
                    502, "upstream interleaved the arguments of two tool calls", "upstream_error"
                )
            self.start(seg)  # text after the finish: a block of its own
        kind = seg.kind
        if kind == TEXT:
            delta = {"type": "text_delta", "text": text}
        elif kind == REASONING:
            delta = {"type": "thinking_delta", "thinking": text}
        else:
            delta = {"type": "input_json_delta", "partial_json": text}
        self._out.append(
            _frame(
                b"content_block_delta",
                {"type": "content_block_delta", "index": self._index, "delta": delta},
            )
        )

    def end(self, seg: Segment) -> None:
        if seg is self._open:
            self._close_block()

    def finish(self) -> None:
        self._close_block()

    def usage(self) -> None:
        if self._acc.raw_finish and not self._delta_sent:
            self._message_delta()

    def _message_delta(self) -> None:
        self._close_block()
        stop_reason, stop_sequence = _stop(self._acc, self._ctx)
        self._out.append(
            _frame(
                b"message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": {"output_tokens": _output_tokens(self._acc)},
                },
            )
        )
        self._delta_sent = True

    def _flush(self) -> bytes:
        out = b"".join(self._out)
        self._out.clear()
        return out

    def feed(self, chunk: dict[str, Any]) -> bytes:
        if not self._started:
            self._start(engine_ids.count(chunk.get(engine_ids.KEY)))
        self._acc.feed(chunk, self)
        return self._flush()

    def close(self) -> bytes:
        if not self._started:
            self._start(0)
        if not self._delta_sent:
            self._message_delta()
        self._out.append(_MESSAGE_STOP)
        return self._flush()

    def fail(self, err: GatewayError) -> bytes:
        _, body = _error_body(err)
        return _frame(b"error", body)


# ---------------------------------------------------------------------------------------------
# Errors

_TYPE_BY_KIND = {
    "invalid_request_error": "invalid_request_error",
    "authentication_error": "authentication_error",
    "permission_error": "permission_error",
    "not_found_error": "not_found_error",
    "request_too_large": "request_too_large",
    "rate_limit_error": "rate_limit_error",
    "overloaded_error": "overloaded_error",
}
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

# vLLM 0.32's two token-count overflow messages (renderers/params.py, serve/utils/api_utils.py).
_OVERFLOW = (
    re.compile(
        r"maximum context length is (?P<limit>\d+) tokens\. However, your prompt contains "
        r"(?:at least )?(?P<count>\d+) input tokens"
    ),
    re.compile(
        r"Input length \((?P<count>\d+)\) exceeds model's maximum context length "
        r"\((?P<limit>\d+)\)"
    ),
)


def _prompt_too_long(message: str) -> str:
    """Claude Code compacts on a message containing "prompt is too long" (case-insensitive);
    Anthropic's own wording is `prompt is too long: 210118 tokens > 200000 maximum`."""
    for pattern in _OVERFLOW:
        match = pattern.search(message)
        if match:
            return f"prompt is too long: {match['count']} tokens > {match['limit']} maximum"
    return f"prompt is too long: {message}"


def _error_body(err: GatewayError) -> tuple[int, dict[str, Any]]:
    status, message = err.status, err.message
    if err.kind == "context_length_exceeded":
        status, kind, message = 400, "invalid_request_error", _prompt_too_long(message)
    elif err.kind == "overloaded_error":  # Anthropic's own status for it
        status, kind = 529, "overloaded_error"
    elif err.kind in _TYPE_BY_KIND:
        kind = _TYPE_BY_KIND[err.kind]
    elif status in _TYPE_BY_STATUS:
        kind = _TYPE_BY_STATUS[status]
    else:
        # Anthropic uses invalid_request_error for 4xx codes it does not list.
        kind = "api_error" if status >= 500 else "invalid_request_error"
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def render_error(err: GatewayError) -> tuple[int, bytes]:
    status, body = _error_body(err)
    return status, msgspec.json.encode(body)


class AnthropicAdapter(Adapter[Request, Context]):
    name = NAME
    normalises_messages = True  # see `_chat_messages`

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
