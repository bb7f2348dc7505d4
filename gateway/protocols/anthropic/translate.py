"""Anthropic Messages requests to chat-completions requests: pure translation, with the checks
the Messages API makes (see the package's docstring for the decisions)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import msgspec

from gateway.protocols.anthropic.resume import TurnLog
from gateway.protocols.anthropic.types import (
    Block,
    Context,
    CountTokensBody,
    DocumentBlock,
    ImageBlock,
    Message,
    MessagesBody,
    RedactedThinkingBlock,
    Request,
    TextBlock,
    ThinkingBlock,
    Tool,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
    new_id,
)
from gateway.protocols.errors import GatewayError
from gateway.protocols.normalize import normalize_messages
from gateway.protocols.request_common import (
    bad_request,
    chat_tool,
    chat_tool_choice,
    check_unique_names,
    invalid_field,
    system_messages,
    text_content,
    text_only,
)
from gateway.protocols.resumable import Decoder, Layout

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
        tool_messages.append({"role": "user", "content": text_content(texts) if texts else ""})
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
    message: dict[str, Any] = {
        "role": "assistant",
        "content": text_content(texts) if texts else None,
    }
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
        items: list[tuple[str, Block]]
        if isinstance(message.content, str):
            items = [(f"messages.{i}.content", TextBlock(message.content))]
        else:
            items = [(f"messages.{i}.content.{j}", b) for j, b in enumerate(message.content)]
        if turns and turns[-1][0] == message.role != "system":
            turns[-1][2].extend(items)
        else:
            turns.append((message.role, i, items))
    return turns


def _system_message(system: str | list[TextBlock] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    text = system if isinstance(system, str) else "\n".join(block.text for block in system)
    return system_messages(text or None)


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
    if isinstance(message.content, str):
        return _system_message(message.content)
    blocks: list[TextBlock] = []
    for j, block in enumerate(message.content):
        if not isinstance(block, TextBlock):
            raise _misplaced(block, "system", f"messages.{index}.content.{j}")
        blocks.append(block)
    return _system_message(blocks)


def _chat_messages(
    body: CountTokensBody, layout: Layout | None = None
) -> tuple[list[dict[str, Any]], bool, TurnLog]:
    """The upstream chat messages (normalised, so the relay does not go over them again),
    whether the last turn is an assistant prefill that the model continues, and the turns'
    log for the requests resumed from this one (see resume.py)."""
    if not body.messages:
        raise bad_request("messages: at least one message is required", param="messages")
    log = TurnLog.resumed(body.messages, layout)
    open_tool_ids = log.open_tool_ids()
    turns = _turns(body.messages, log.start())
    # The log's lists, appended to in the loop itself (a method call a turn costs 3 % of a
    # long conversation's translation).
    out, ends, sizes, open_ids = log.out, log.ends, log.sizes, log.open_ids
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
    return messages, last_role == "assistant", log


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
    tag = str(choice.__struct_config__.tag)
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
    messages, prefill, log = _chat_messages(body, layout)
    tools = _chat_tools(body.tools)
    tool_choice, parallel = _chat_tool_choice(body.tool_choice, tools)
    if layout is not None:  # checked: the requests resumed from this one take it up
        layout.derived = log
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
        message_id=new_id("msg_"),
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
