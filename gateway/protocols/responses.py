"""OpenAI Responses API on top of vLLM chat completions: request items to chat messages, a
chat completion to a `response` object, and a stream adapter that turns each chat chunk into
Responses events as it arrives.

Decisions (see the tests for each):
- `reasoning` input items become the `reasoning` field of the assistant message they precede
  (vLLM hands it to the chat template); items with only a summary or encrypted content carry no
  text the model produced and are dropped.
- Tools: `function` tools pass through; `namespace` tools are flattened to `<namespace>__<name>`
  (vLLM's own Responses server does the same) and calls are mapped back to `name` + `namespace`,
  which Codex needs to route them. Hosted tools the server would run (web search, file search,
  code interpreter, ...) are dropped and listed in `Context.dropped_tools`: nothing here can run
  them. Client tools with their own call item types (`custom`, `local_shell`, `shell`,
  `apply_patch`) are rejected: dropping them would hide a tool the harness relies on.
- `previous_response_id`: the core resolves the id and passes the earlier conversation to
  `to_upstream`; `conversation_items` gives what to store for the next link.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

import msgspec

from gateway.protocols.errors import GatewayError, bad_request
from gateway.protocols.openai_common import render_error
from gateway.protocols.tools import check_object_schema

NAME = "responses"
UPSTREAM_PATH = "/v1/chat/completions"
__all__ = [
    "NAME",
    "UPSTREAM_PATH",
    "Context",
    "Request",
    "parse_request",
    "to_upstream",
    "from_upstream",
    "conversation_items",
    "Stream",
    "render_error",
]

_encode = msgspec.json.encode

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


# -- request wire types ------------------------------------------------------------------------


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


class _FunctionTool(msgspec.Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _NamespaceTool(msgspec.Struct):
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
    """A validated request: the body plus its tools in chat form."""

    body: Body
    chat_tools: list[dict[str, Any]]
    chat_tool_choice: str | dict[str, Any] | None
    namespaced: dict[str, tuple[str, str]]  # chat tool name -> (namespace, name)
    dropped_tools: list[str]


class Context(msgspec.Struct):
    model: str
    response_id: str
    created_at: int
    echo: dict[str, Any]  # request fields every response object repeats
    namespaced: dict[str, tuple[str, str]]
    dropped_tools: list[str]


# -- validation helpers --------------------------------------------------------------------------

_MISSING = re.compile(r"Object missing required field `([^`]+)`")


def _invalid(exc: msgspec.ValidationError, root: str = "") -> GatewayError:
    """msgspec's message with its `$`-path turned into the request field it names."""
    msg, sep, at = str(exc).partition(" - at `$")
    path = root + (at[:-1] if sep else "")
    missing = _MISSING.match(msg)
    if missing:
        path = f"{path}.{missing[1]}"
    path = path.lstrip(".")
    return bad_request(f"invalid '{path}': {msg}" if path else msg, param=path or None)


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


def parse_request(raw: bytes) -> Request:
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise bad_request("request body must be a JSON object")
    _tag_messages(obj.get("input"))
    body = _convert(obj, Body, "")
    chat_tools, namespaced, dropped = _tools(body.tools)
    choice = _tool_choice(body.tool_choice, chat_tools)
    return Request(body, chat_tools, choice, namespaced, dropped)


# -- tools ---------------------------------------------------------------------------------------


def _function_tool(obj: dict, path: str, namespace: str | None = None) -> dict:
    fn = _convert(obj, _FunctionTool, path)
    if fn.parameters is not None:
        check_object_schema(fn.parameters, f"{path}.parameters")
    name = fn.name if namespace is None else namespace + _NS_SEP + fn.name
    spec: dict[str, Any] = {"name": name}
    if fn.description is not None:
        spec["description"] = fn.description
    if fn.parameters is not None:
        spec["parameters"] = fn.parameters
    if fn.strict is not None:
        spec["strict"] = fn.strict
    return {"type": "function", "function": spec}


def _tool_kind(obj: dict, path: str, allowed: str) -> str:
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
            ns = _convert(obj, _NamespaceTool, path)
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
    names = [t["function"]["name"] for t in chat]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise bad_request(f"tool name {dup!r} is declared more than once", param="tools")
    return chat, namespaced, dropped


def _tool_choice(choice: str | dict, chat_tools: list[dict]) -> str | dict | None:
    """The chat form of `tool_choice`, or None when no tool reaches the model."""
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise bad_request(
                f"'tool_choice' must be 'auto', 'none', 'required' or a function, not {choice!r}",
                param="tool_choice",
            )
        if choice == "required" and not chat_tools:
            raise bad_request(
                "tool_choice 'required' needs at least one function tool", param="tool_choice"
            )
        return choice if chat_tools else None
    if choice.get("type") != "function":
        raise bad_request(
            f"tool_choice of type {choice.get('type')!r} is not supported; use 'auto', 'none', "
            "'required' or {'type': 'function', 'name': ...}",
            param="tool_choice.type",
        )
    name = choice.get("name")
    if not any(t["function"]["name"] == name for t in chat_tools):
        raise bad_request(
            f"tool_choice names function {name!r}, which is not among the function tools",
            param="tool_choice.name",
        )
    return {"type": "function", "function": {"name": name}}


# -- items to messages ---------------------------------------------------------------------------


def _text(parts: str | list, path: str, join: str | None) -> str | list[dict] | None:
    """Text content of a message or tool output. `join` glues the parts into one string (an
    assistant turn was one contiguous generation); None keeps several parts as chat text parts."""
    if isinstance(parts, str):
        return parts
    texts = []
    for j, p in enumerate(parts):
        if not isinstance(p, (InputText, OutputText)):
            kind = type(p).__name__
            raise bad_request(
                f"'{path}[{j}]': {kind} content is not supported; this gateway serves text-only "
                "models",
                param=f"{path}[{j}].type",
            )
        texts.append(p.text)
    if join is not None:
        return join.join(texts)
    if len(texts) == 1:
        return texts[0]
    return [{"type": "text", "text": t} for t in texts]


def _messages(instructions: str | None, sources: list[tuple[str, list[Item]]]) -> list[dict]:
    """Chat messages, in order. Consecutive assistant-side items (reasoning, text, calls) form
    one assistant turn, the way the model generated them, so re-rendering reproduces it."""
    out: list[dict] = []
    if instructions is not None:
        out.append({"role": "system", "content": instructions})
    turn: dict | None = None
    call_ids: set[str] = set()
    for src, items in sources:
        for i, item in enumerate(items):
            if isinstance(item, FunctionCall):
                if turn is None:
                    turn = {"role": "assistant", "content": None}
                name = item.name if item.namespace is None else item.namespace + _NS_SEP + item.name
                turn.setdefault("tool_calls", []).append(
                    {
                        "id": item.call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": item.arguments},
                    }
                )
                call_ids.add(item.call_id)
            elif isinstance(item, Reasoning):
                text = "".join(c.text for c in item.content or ())
                if not text:
                    continue
                if turn is not None:
                    out.append(turn)
                turn = {"role": "assistant", "content": None, "reasoning": text}
            elif isinstance(item, Message) and item.role == "assistant":
                if turn is not None and (turn["content"] is not None or "tool_calls" in turn):
                    out.append(turn)
                    turn = None
                if turn is None:
                    turn = {"role": "assistant", "content": None}
                turn["content"] = _text(item.content, f"{src}[{i}].content", "")
            else:
                if turn is not None:
                    out.append(turn)
                    turn = None
                if isinstance(item, FunctionCallOutput):
                    if item.call_id not in call_ids:
                        raise bad_request(
                            f"'{src}[{i}]': function_call_output for call_id {item.call_id!r} "
                            "has no earlier function_call with that call_id",
                            param=f"{src}[{i}].call_id",
                        )
                    out.append(
                        {
                            "role": "tool",
                            "tool_call_id": item.call_id,
                            "content": _text(item.output, f"{src}[{i}].output", None),
                        }
                    )
                else:
                    role = "system" if item.role == "developer" else item.role
                    content = _text(item.content, f"{src}[{i}].content", None)
                    out.append({"role": role, "content": content})
    if turn is not None:
        out.append(turn)
    return out


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


def _input_items(body: Body) -> list[Item]:
    if isinstance(body.input, str):
        return [Message(role="user", content=body.input)]
    return body.input


def to_upstream(req: Request, previous_items: list | None = None) -> tuple[dict, Context]:
    """`previous_items`: the stored conversation of `previous_response_id` (see
    `conversation_items`); the core resolves the id and passes None when there is none."""
    body = req.body
    if body.previous_response_id is not None and previous_items is None:
        raise bad_request(
            f"previous response with id {body.previous_response_id!r} not found",
            param="previous_response_id",
        )
    sources: list[tuple[str, list[Item]]] = []
    if previous_items:
        prev = [dict(it) if isinstance(it, dict) else it for it in previous_items]
        _tag_messages(prev)
        sources.append(("previous_items", _convert(prev, list[Item], "previous_items")))
    sources.append(("input", _input_items(body)))
    messages = _messages(body.instructions, sources)
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


def conversation_items(
    req: Request, resp_body: dict | bytes, previous_items: list | None = None
) -> list[dict]:
    """What to store under this response's id so a later `previous_response_id` can resume:
    the earlier conversation (if given), this request's input items and this response's output
    items, as Responses items. Instructions are not carried over, as in the OpenAI API.
    `resp_body` is the response object: `from_upstream`'s bytes or `Stream.response()`."""
    if not isinstance(resp_body, dict):
        resp_body = msgspec.json.decode(resp_body)
    items = list(previous_items or ())
    items.extend(msgspec.to_builtins(_input_items(req.body)))
    items.extend(resp_body["output"])
    return items


# -- response objects ----------------------------------------------------------------------------


def _item_id(ctx: Context, prefix: str, index: int) -> str:
    return f"{prefix}_{ctx.response_id[5:]}{index:04x}"


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "encrypted_content": None,
        "status": status,
    }


def _call_item(
    ctx: Context, item_id: str, call_id: str, chat_name: str, arguments: str, status: str
) -> dict:
    item = {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": chat_name,
        "arguments": arguments,
        "status": status,
    }
    mapped = ctx.namespaced.get(chat_name)
    if mapped is not None:
        item["namespace"], item["name"] = mapped
    return item


def _status(finish_reason: str | None) -> tuple[str, dict | None]:
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def _usage(u: dict | None) -> dict | None:
    if not u:
        return None
    prompt = u.get("prompt_tokens") or 0
    completion = u.get("completion_tokens") or 0
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (u.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": u.get("total_tokens") or prompt + completion,
    }


def _response(
    ctx: Context,
    status: str,
    output: list[dict],
    usage: dict | None,
    incomplete: dict | None = None,
    error: dict | None = None,
) -> dict:
    return {
        "id": ctx.response_id,
        "object": "response",
        "created_at": ctx.created_at,
        "status": status,
        "error": error,
        "incomplete_details": incomplete,
        "model": ctx.model,
        "output": output,
        "usage": usage,
        **ctx.echo,
    }


def from_upstream(resp: dict, ctx: Context) -> bytes:
    choice = resp["choices"][0]
    msg = choice.get("message") or {}
    status, incomplete = _status(choice.get("finish_reason"))
    output: list[dict] = []
    reasoning = msg.get("reasoning") or msg.get("reasoning_content")
    if reasoning:
        output.append(_reasoning_item(_item_id(ctx, "rs", len(output)), reasoning, "completed"))
    if msg.get("content"):
        output.append(_message_item(_item_id(ctx, "msg", len(output)), msg["content"], "completed"))
    for tc in msg.get("tool_calls") or ():
        fn = tc.get("function") or {}
        k = len(output)
        call_id = tc.get("id") or _item_id(ctx, "call", k)
        output.append(
            _call_item(
                ctx,
                _item_id(ctx, "fc", k),
                call_id,
                fn.get("name", ""),
                fn.get("arguments", ""),
                "completed",
            )
        )
    if status == "incomplete" and output:
        output[-1]["status"] = "incomplete"  # only the item being generated was cut off
    return _encode(_response(ctx, status, output, _usage(resp.get("usage")), incomplete))


# -- streaming -----------------------------------------------------------------------------------


class _Out:
    """One output item while it streams."""

    __slots__ = ("kind", "id", "index", "parts", "status", "call_id", "name")

    def __init__(self, kind: str, item_id: str, index: int) -> None:
        self.kind = kind  # "reasoning" | "message" | "function_call"
        self.id = item_id
        self.index = index
        self.parts: list[str] = []
        self.status: str | None = None  # None while open
        self.call_id = ""
        self.name = ""


_PREFIX = {"reasoning": "rs", "message": "msg", "function_call": "fc"}
_DELTA = {"reasoning": "response.reasoning_text.delta", "message": "response.output_text.delta"}
_DONE = {"reasoning": "response.reasoning_text.done", "message": "response.output_text.done"}
_EMPTY_PART = {
    "reasoning": {"type": "reasoning_text", "text": ""},
    "message": {"type": "output_text", "text": "", "annotations": []},
}


class Stream:
    """Chat chunks in, Responses SSE events out. Function calls stay open until `close()`: a
    harness runs a call when its `output_item.done` arrives, which must not happen before the
    call is recorded."""

    __slots__ = ("_ctx", "_seq", "_started", "_items", "_open", "_calls", "_finish", "_usage")

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._seq = 0
        self._started = False
        self._items: list[_Out] = []
        self._open: _Out | None = None  # the reasoning or message item receiving text
        self._calls: dict[int, _Out] = {}  # upstream tool-call index -> item
        self._finish: str | None = None
        self._usage: dict | None = None

    def _event(self, out: list[bytes], kind: str, fields: dict) -> None:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        out.append(b"event: %s\ndata: %s\n\n" % (kind.encode(), _encode(payload)))

    def _start(self, out: list[bytes]) -> None:
        self._started = True
        resp = _response(self._ctx, "in_progress", [], None)
        self._event(out, "response.created", {"response": resp})
        self._event(out, "response.in_progress", {"response": resp})

    def _add(self, kind: str, out: list[bytes]) -> _Out:
        index = len(self._items)
        item = _Out(kind, _item_id(self._ctx, _PREFIX[kind], index), index)
        self._items.append(item)
        if kind == "function_call":
            return item  # announced by the caller once call_id and name are set
        added = {"id": item.id, "type": kind, "status": "in_progress", "content": []}
        if kind == "message":
            added["role"] = "assistant"
        else:
            added["summary"] = []
        self._event(out, "response.output_item.added", {"output_index": index, "item": added})
        self._event(
            out,
            "response.content_part.added",
            {
                "item_id": item.id,
                "output_index": index,
                "content_index": 0,
                "part": _EMPTY_PART[kind],
            },
        )
        return item

    def _final(self, item: _Out, status: str) -> dict:
        text = "".join(item.parts)
        if item.kind == "message":
            return _message_item(item.id, text, status)
        if item.kind == "reasoning":
            return _reasoning_item(item.id, text, status)
        return _call_item(self._ctx, item.id, item.call_id, item.name, text, status)

    def _close_item(self, item: _Out, status: str, out: list[bytes]) -> None:
        item.status = status
        final = self._final(item, status)
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "function_call":
            self._event(
                out,
                "response.function_call_arguments.done",
                {**where, "arguments": final["arguments"]},
            )
        else:
            part = final["content"][0]
            done = {**where, "content_index": 0, "text": part["text"]}
            if item.kind == "message":
                done["logprobs"] = []
            self._event(out, _DONE[item.kind], done)
            self._event(
                out, "response.content_part.done", {**where, "content_index": 0, "part": part}
            )
        self._event(out, "response.output_item.done", {"output_index": item.index, "item": final})

    def _text(self, kind: str, delta: str, out: list[bytes]) -> None:
        item = self._open
        if item is None or item.kind != kind:
            if item is not None:
                self._close_item(item, "completed", out)
            item = self._open = self._add(kind, out)
        item.parts.append(delta)
        fields = {
            "item_id": item.id,
            "output_index": item.index,
            "content_index": 0,
            "delta": delta,
        }
        if kind == "message":
            fields["logprobs"] = []
        self._event(out, _DELTA[kind], fields)

    def _call(self, tc: dict, out: list[bytes]) -> None:
        fn = tc.get("function") or {}
        key = tc.get("index", 0)
        item = self._calls.get(key)
        if item is None:
            if self._open is not None:
                self._close_item(self._open, "completed", out)
                self._open = None
            item = self._calls[key] = self._add("function_call", out)
            item.call_id = tc.get("id") or _item_id(self._ctx, "call", item.index)
            item.name = fn.get("name") or ""
            added = self._final(item, "in_progress")
            self._event(
                out, "response.output_item.added", {"output_index": item.index, "item": added}
            )
        elif fn.get("name"):
            item.name += fn["name"]
        args = fn.get("arguments")
        if args:
            item.parts.append(args)
            self._event(
                out,
                "response.function_call_arguments.delta",
                {"item_id": item.id, "output_index": item.index, "delta": args},
            )

    def feed(self, chunk: dict) -> bytes:
        out: list[bytes] = []
        if not self._started:
            self._start(out)
        choices = chunk.get("choices")
        if choices:
            choice = choices[0]
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning") or delta.get("reasoning_content")
            if reasoning:
                self._text("reasoning", reasoning, out)
            content = delta.get("content")
            if content:
                self._text("message", content, out)
            for tc in delta.get("tool_calls") or ():
                self._call(tc, out)
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        usage = chunk.get("usage")
        if usage:
            self._usage = usage
        return b"".join(out)

    def _output(self, cut: str, rest: str) -> list[dict]:
        """Every item in its final form. Items still open close as `cut` if last (the one being
        generated when the stream stopped), else as `rest`."""
        last = len(self._items) - 1
        return [
            self._final(it, it.status or (cut if it.index == last else rest)) for it in self._items
        ]

    def response(self) -> dict:
        """The response object `close()` will send, for the core to store before it does."""
        status, incomplete = _status(self._finish)
        return _response(
            self._ctx, status, self._output(status, "completed"), _usage(self._usage), incomplete
        )

    def close(self) -> bytes:
        out: list[bytes] = []
        if not self._started:
            self._start(out)
        resp = self.response()
        for item, final in zip(self._items, resp["output"]):
            if item.status is None:
                self._close_item(item, final["status"], out)
        self._event(out, f"response.{resp['status']}", {"response": resp})
        return b"".join(out)

    def fail(self, err: GatewayError) -> bytes:
        """`error`, then `response.failed` with what was generated so far. Open items are not
        closed: a harness would run a half-streamed function call."""
        out: list[bytes] = []
        if not self._started:
            self._start(out)
        code = err.code or (
            "context_length_exceeded" if err.kind == "context_length_exceeded" else "server_error"
        )
        self._event(out, "error", {"code": code, "message": err.message, "param": err.param})
        resp = _response(
            self._ctx,
            "failed",
            self._output("incomplete", "incomplete"),
            _usage(self._usage),
            error={"code": code, "message": err.message},
        )
        self._event(out, "response.failed", {"response": resp})
        return b"".join(out)


# -- stored conversation state (`previous_response_id`) ------------------------------------------
# The core calls these two hooks for protocols that keep server-side conversation state.


def previous_id(req: Request) -> str | None:
    """The stored response this request continues, if any."""
    return req.body.previous_response_id


def stored_state(req: Request, ctx: Context, resp_body: dict | bytes) -> dict:
    """What the core stores with the call so a later request can continue from it: only this
    call's own items and a pointer to its predecessor, so a chain of N responses is stored in
    O(N), and resolved by walking the pointers (`conversation_items` with the earlier items)."""
    return {
        "response_id": ctx.response_id,
        "previous_response_id": req.body.previous_response_id,
        "items": conversation_items(req, resp_body),
    }
