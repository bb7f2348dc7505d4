"""Responses requests to chat-completions requests: pure translation of input items, tools and
settings, with the checks the Responses API makes (see the package's docstring)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from typing import Any

import msgspec

from gateway.protocols.errors import GatewayError
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
from gateway.protocols.responses.resume import ItemLog, resume_point, taken_from
from gateway.protocols.responses.types import (
    Body,
    Context,
    FunctionCall,
    FunctionCallOutput,
    FunctionTool,
    InputText,
    Item,
    Message,
    NamespaceTool,
    OutputText,
    Reasoning,
    Request,
    TextConfig,
)
from gateway.protocols.resumable import Decoder, Layout

# Server-run tools; without the server there is nothing to run them, so they are left out.
_HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_2025_08_26",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "image_generation",
        "computer",
        "computer_use_preview",
        "mcp",
        "tool_search",
        "programmatic_tool_calling",
    }
)
_CLIENT_SPECIAL_TOOLS = frozenset({"custom", "local_shell", "shell", "apply_patch"})
_NS_SEP = "__"


# -- validation helpers --------------------------------------------------------------------------


def _invalid(exc: msgspec.ValidationError, root: str = "") -> GatewayError:
    """msgspec's message with its `$`-path turned into the request field it names."""
    text, path, _ = invalid_field(exc, root)
    return bad_request(f"invalid '{path}': {text}" if path else text, param=path or None)


def _convert(obj: Any, typ: Any, root: str) -> Any:
    try:
        return msgspec.convert(obj, typ)
    except msgspec.ValidationError as exc:
        raise _invalid(exc, root) from None


def _tag_messages(items: Any) -> None:
    """An item with a role and no type is a message (the API's "easy input message")."""
    if isinstance(items, list):
        for it in items:
            if isinstance(it, dict) and "type" not in it and "role" in it:
                it["type"] = "message"


_INPUT = Decoder("input")


def parse_request(raw: bytes) -> Request:
    return parse(raw)[0]


def parse(raw: bytes, earlier: Iterable[Layout] = ()) -> tuple[Request, Layout | None]:
    """The validated request, decoding its input items from an `earlier` request's layout where
    it can, and the body's own layout for the requests after it. (Items are tagged in place;
    tagging a tagged item again changes nothing, so shared items stay as a fresh decoding.)"""
    try:
        obj, layout = _INPUT.decode(raw, earlier)
    except msgspec.DecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise bad_request("request body must be a JSON object")
    taken = taken_from(layout)
    new = 0 if taken is None else len(taken.items)
    _tag_messages(obj["input"][new:] if new else obj.get("input"))
    body = _body(obj, taken)
    chat_tools, namespaced, dropped = _tools(body.tools)
    choice = _tool_choice(body.tool_choice, chat_tools)
    messages = None
    if body.previous_response_id is None:
        log = _translate(body, taken)
        messages = _with_instructions(body.instructions, log.out)
        if layout is not None:  # checked: the requests resumed from this one take it up
            layout.derived = log
    return Request(body, chat_tools, choice, namespaced, dropped, messages), layout


def _body(obj: dict, taken: ItemLog | None) -> Body:
    """`obj` as a Body: only the items after those `taken` are converted, unless they fail
    (converted whole then, for the error to name the item by its index in the request)."""
    if taken is not None:
        try:
            body = msgspec.convert({**obj, "input": obj["input"][len(taken.items) :]}, Body)
        except msgspec.ValidationError:
            pass
        else:
            if isinstance(body.input, list):
                return msgspec.structs.replace(body, input=taken.items + body.input)
    return _convert(obj, Body, "")


def _translate(body: Body, taken: ItemLog | None) -> ItemLog:
    """The body's input items as chat messages, taking up `taken`'s translation of its first
    items."""
    items = input_items(body)
    out, call_ids, start = resume_point(taken)
    done, size = _chat_messages([("input", items, start)], out, call_ids)
    return ItemLog(items, out, done, size, call_ids)


# -- tools ---------------------------------------------------------------------------------------


def _function_tool(obj: dict, path: str, namespace: str | None = None) -> dict:
    fn = _convert(obj, FunctionTool, path)
    name = fn.name if namespace is None else namespace + _NS_SEP + fn.name
    return chat_tool(name, fn.parameters, fn.description, fn.strict, f"{path}.parameters")


def _tool_kind(obj: dict, path: str, allowed: str) -> str | None:
    kind = obj.get("type")
    if kind in _CLIENT_SPECIAL_TOOLS:
        raise bad_request(
            f"'{path}': tools of type {kind!r} are not supported; this gateway offers the "
            f"model {allowed} only",
            param=f"{path}.type",
        )
    return kind


def _tools(raw: list[dict]) -> tuple[list[dict], dict[str, tuple[str, str]], list[str]]:
    chat: list[dict] = []
    namespaced: dict[str, tuple[str, str]] = {}
    dropped: list[str] = []
    for i, obj in enumerate(raw):
        path = f"tools[{i}]"
        kind = _tool_kind(obj, path, "function and namespace tools")
        if kind == "function":
            chat.append(_function_tool(obj, path))
        elif kind == "namespace":
            ns = _convert(obj, NamespaceTool, path)
            for j, sub in enumerate(ns.tools):
                sub_path = f"{path}.tools[{j}]"
                if _tool_kind(sub, sub_path, "function tools inside a namespace") != "function":
                    raise bad_request(
                        f"'{sub_path}': a namespace may hold function tools only",
                        param=f"{sub_path}.type",
                    )
                tool = _function_tool(sub, sub_path, ns.name)
                chat.append(tool)
                chat_name = tool["function"]["name"]
                namespaced[chat_name] = (ns.name, chat_name[len(ns.name) + len(_NS_SEP) :])
        elif kind in _HOSTED_TOOLS:
            dropped.append(kind)
        else:
            raise bad_request(f"'{path}': unknown tool type {kind!r}", param=f"{path}.type")
    # Namespaced names are only unique once flattened, so the field named is the whole list.
    check_unique_names(chat, lambda i: "tools")
    return chat, namespaced, dropped


def _tool_choice(choice: str | dict, chat_tools: list[dict]) -> str | dict | None:
    """The chat form of `tool_choice`, or None when no tool reaches the model."""
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise bad_request(
                f"'tool_choice' must be 'auto', 'none', 'required' or a function, not {choice!r}",
                param="tool_choice",
            )
        return chat_tool_choice(choice, None, chat_tools, repr(choice))
    if choice.get("type") != "function":
        raise bad_request(
            f"tool_choice of type {choice.get('type')!r} is not supported; use 'auto', 'none', "
            "'required' or {'type': 'function', 'name': ...}",
            param="tool_choice.type",
        )
    return chat_tool_choice("function", choice.get("name"), chat_tools, "a function")


# -- items to messages ---------------------------------------------------------------------------


def _text(parts: str | list, path: str, join: str | None) -> str | list[dict] | None:
    """Text content of a message or tool output. `join` glues the parts into one string (an
    assistant turn was one contiguous generation); None keeps several parts as chat text parts."""
    if isinstance(parts, str):
        return parts
    texts = []
    for j, p in enumerate(parts):
        if not isinstance(p, (InputText, OutputText)):
            raise text_only(p.__struct_config__.tag, f"{path}[{j}]", f"{path}[{j}].type")
        texts.append(p.text)
    return text_content(texts) if join is None else join.join(texts)


def _with_instructions(instructions: str | None, messages: list[dict]) -> list[dict]:
    """A new list (`messages` may be a translation that later requests take up)."""
    return [*system_messages(instructions), *messages]


def _with_call(turn: dict | None, item: FunctionCall) -> dict:
    """The open assistant turn (a new one if none is open) with `item`'s call added."""
    if turn is None:
        turn = {"role": "assistant", "content": None}
    name = item.name if item.namespace is None else item.namespace + _NS_SEP + item.name
    turn.setdefault("tool_calls", []).append(
        {"id": item.call_id, "type": "function",
         "function": {"name": name, "arguments": item.arguments}}
    )
    return turn


def _with_text(turn: dict | None, out: list[dict], text) -> dict:
    """The assistant turn `text` belongs to: the open one if it holds only reasoning so far,
    else a new one (the open one, done, goes to `out`)."""
    if turn is not None and (turn["content"] is not None or "tool_calls" in turn):
        out.append(turn)
        turn = None
    if turn is None:
        turn = {"role": "assistant", "content": None}
    turn["content"] = text
    return turn


def _caller_message(item: Message | FunctionCallOutput, where: str, call_ids: set[str]) -> dict:
    """The chat message of an item from the caller's side: a function call's output (of a
    call made earlier) or a user, system or developer message."""
    if isinstance(item, FunctionCallOutput):
        if item.call_id not in call_ids:
            raise bad_request(
                f"'{where}': function_call_output for call_id {item.call_id!r} "
                "has no earlier function_call with that call_id",
                param=f"{where}.call_id",
            )
        return {"role": "tool", "tool_call_id": item.call_id,
                "content": _text(item.output, f"{where}.output", None)}
    role = "system" if item.role == "developer" else item.role
    return {"role": role, "content": _text(item.content, f"{where}.content", None)}


def _chat_messages(
    sources: list[tuple[str, list[Item], int]], out: list[dict], call_ids: set[str]
) -> tuple[int, int]:
    """Appends the chat messages of the sources' items (from each one's start on) to `out`, in
    order, and the ids of their function calls to `call_ids`. Consecutive assistant-side items
    (reasoning, text, calls) form one assistant turn, the way the model generated them, so
    re-rendering reproduces it. Returns (done, size): after the last source's first `done`
    items, no assistant turn was open, and `out` held `size` messages."""
    turn: dict | None = None
    done = size = 0
    for src, items, start in sources:
        done, size = start, len(out)
        for i in range(start, len(items)):
            item = items[i]
            if isinstance(item, FunctionCall):
                turn = _with_call(turn, item)
                call_ids.add(item.call_id)
            elif isinstance(item, Reasoning):
                text = "".join(c.text for c in item.content or ())
                if text:
                    if turn is not None:
                        out.append(turn)
                    turn = {"role": "assistant", "content": None, "reasoning": text}
            elif isinstance(item, Message) and item.role == "assistant":
                turn = _with_text(turn, out, _text(item.content, f"{src}[{i}].content", ""))
            else:
                if turn is not None:
                    out.append(turn)
                    turn = None
                out.append(_caller_message(item, f"{src}[{i}]", call_ids))
            if turn is None:
                done, size = i + 1, len(out)
    if turn is not None:
        out.append(turn)
    return done, size


def _response_format(text: TextConfig | None) -> dict | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.name is None or fmt.schema is None:
        raise bad_request(
            "text.format of type 'json_schema' needs 'name' and 'schema'", param="text.format"
        )
    spec: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema}
    if fmt.strict is not None:
        spec["strict"] = fmt.strict
    if fmt.description is not None:
        spec["description"] = fmt.description
    return {"type": "json_schema", "json_schema": spec}


def input_items(body: Body) -> list[Item]:
    if isinstance(body.input, str):
        return [Message(role="user", content=body.input)]
    return body.input


def to_upstream(
    req: Request, previous_items: list[Any] | None = None
) -> tuple[dict[str, Any], Context]:
    """`previous_items`: the stored conversation of `previous_response_id` (see
    `conversation_items`); the core resolves the id and passes None when there is none."""
    body = req.body
    if body.previous_response_id is not None and previous_items is None:
        raise bad_request(
            f"previous response with id {body.previous_response_id!r} not found",
            param="previous_response_id",
        )
    messages = req.messages
    if messages is None:
        sources: list[tuple[str, list[Item], int]] = []
        if previous_items:
            prev = [dict(it) if isinstance(it, dict) else it for it in previous_items]
            _tag_messages(prev)
            sources.append(("previous_items", _convert(prev, list[Item], "previous_items"), 0))
        sources.append(("input", input_items(body), 0))
        chat: list[dict] = []
        _chat_messages(sources, chat, set())
        messages = _with_instructions(body.instructions, chat)
    if not messages:
        raise bad_request("'input' holds no message for the model", param="input")

    out: dict[str, Any] = {"messages": messages, "stream": body.stream}
    if req.chat_tool_choice is not None:
        out["tools"] = req.chat_tools
        out["tool_choice"] = req.chat_tool_choice
        out["parallel_tool_calls"] = body.parallel_tool_calls
    if body.max_output_tokens is not None:
        out["max_tokens"] = body.max_output_tokens
    # Sampling fields go along so the core records what the harness asked for (it pins them).
    for key in ("temperature", "top_p", "top_logprobs"):
        value = getattr(body, key)
        if value is not None:
            out[key] = value
    if body.reasoning is not None and body.reasoning.effort is not None:
        out["reasoning_effort"] = body.reasoning.effort
    response_format = _response_format(body.text)
    if response_format is not None:
        out["response_format"] = response_format

    rid = uuid.uuid4().hex
    echo = {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": msgspec.to_builtins(body.reasoning) if body.reasoning else None,
        "store": body.store,
        "temperature": body.temperature,
        "text": msgspec.to_builtins(body.text) if body.text else {"format": {"type": "text"}},
        "tool_choice": body.tool_choice,
        "tools": body.tools,
        "top_p": body.top_p,
        "truncation": "disabled",
    }
    ctx = Context(
        model=body.model,
        response_id=f"resp_{rid}",
        created_at=int(time.time()),
        echo=echo,
        namespaced=req.namespaced,
        dropped_tools=req.dropped_tools,
    )
    return out, ctx
