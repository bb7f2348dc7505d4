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

import time
import uuid
from collections.abc import Collection, Iterable
from typing import Any, Literal, NamedTuple

import msgspec

from gateway.protocols import segments
from gateway.protocols.adapter import Adapter
from gateway.protocols.adapter import Stream as StreamBase
from gateway.protocols.errors import GatewayError, bad_request, invalid_field, text_only
from gateway.protocols.openai_common import render_error
from gateway.protocols.resumable import Decoder, Layout
from gateway.protocols.segments import REASONING, TEXT, TOOL_CALL, Accumulator, Segment
from gateway.protocols.tools import chat_tool, chat_tool_choice, check_unique_names

NAME = "responses"
UPSTREAM_PATH = "/v1/chat/completions"
__all__ = [
    "NAME",
    "UPSTREAM_PATH",
    "Context",
    "Request",
    "parse",
    "parse_request",
    "to_upstream",
    "from_upstream",
    "conversation_items",
    "Stream",
    "render_error",
    "ADAPTER",
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
    """A validated request: the body plus its tools in chat form, and its input as chat
    messages unless it continues a stored response (whose items `to_upstream` is given)."""

    body: Body
    chat_tools: list[dict[str, Any]]
    chat_tool_choice: str | dict[str, Any] | None
    namespaced: dict[str, tuple[str, str]]  # chat tool name -> (namespace, name)
    dropped_tools: list[str]
    messages: list[dict] | None = None


class _Translated(NamedTuple):
    """A body's input items as converted and as chat messages (its instructions apart), taken
    up by a request resumed from it (gateway/protocols/resumable.py) that opens with all of its
    items: only the new items are converted and translated. These items passed the checks with
    this body. Translation takes up after the last item that left no assistant turn open
    (`done` items made `size` messages); `call_ids` are of all the items' function calls."""

    items: list[Item]
    out: list[dict]
    done: int
    size: int
    call_ids: set[str]


class Context(msgspec.Struct):
    model: str
    response_id: str
    created_at: int
    echo: dict[str, Any]  # request fields every response object repeats
    namespaced: dict[str, tuple[str, str]]
    dropped_tools: list[str]


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
    taken = _taken(layout)
    new = 0 if taken is None else len(taken.items)
    _tag_messages(obj["input"][new:] if new else obj.get("input"))
    body = _body(obj, taken)
    chat_tools, namespaced, dropped = _tools(body.tools)
    choice = _tool_choice(body.tool_choice, chat_tools)
    messages = None
    if body.previous_response_id is None:
        translated = _translate(body, taken)
        messages = _with_instructions(body.instructions, translated.out)
        if layout is not None:  # checked: the requests resumed from this one take it up
            layout.derived = translated
    return Request(body, chat_tools, choice, namespaced, dropped, messages), layout


def _taken(layout: Layout | None) -> _Translated | None:
    """The earlier request's translation, if this body opens with all of its items."""
    earlier = None if layout is None else layout.derived_from()
    return earlier if earlier is not None and layout.resumed == len(earlier.items) else None


def _body(obj: dict, taken: _Translated | None) -> Body:
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


def _translate(body: Body, taken: _Translated | None) -> _Translated:
    """The body's input items as chat messages, taking up `taken`'s translation of its first
    items."""
    items = _input_items(body)
    if taken is None:
        out: list[dict] = []
        call_ids: set[str] = set()
        start = 0
    else:
        out, call_ids, start = taken.out[: taken.size], set(taken.call_ids), taken.done
    done, size = _chat_messages([("input", items, start)], out, call_ids)
    return _Translated(items, out, done, size, call_ids)


# -- tools ---------------------------------------------------------------------------------------


def _function_tool(obj: dict, path: str, namespace: str | None = None) -> dict:
    fn = _convert(obj, _FunctionTool, path)
    name = fn.name if namespace is None else namespace + _NS_SEP + fn.name
    return chat_tool(name, fn.parameters, fn.description, fn.strict, f"{path}.parameters")


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
    if join is not None:
        return join.join(texts)
    if len(texts) == 1:
        return texts[0]
    return [{"type": "text", "text": t} for t in texts]


def _with_instructions(instructions: str | None, messages: list[dict]) -> list[dict]:
    """A new list (`messages` may be a translation that later requests take up)."""
    system = [] if instructions is None else [{"role": "system", "content": instructions}]
    return [*system, *messages]


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
                if text:
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
    messages = req.messages
    if messages is None:
        sources: list[tuple[str, list[Item], int]] = []
        if previous_items:
            prev = [dict(it) if isinstance(it, dict) else it for it in previous_items]
            _tag_messages(prev)
            sources.append(("previous_items", _convert(prev, list[Item], "previous_items"), 0))
        sources.append(("input", _input_items(body), 0))
        out: list[dict] = []
        _chat_messages(sources, out, set())
        messages = _with_instructions(body.instructions, out)
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


# -- response objects: a mapping of the engine's output segments (see segments.py) -------------

_PREFIX = {REASONING: "rs", TEXT: "msg", TOOL_CALL: "fc"}


def _item_id(ctx: Context, prefix: str, index: int) -> str:
    return f"{prefix}_{ctx.response_id[5:]}{index:04x}"


def _item(ctx: Context, seg: Segment, status: str) -> dict:
    """The output item of `seg` as the response object holds it."""
    item_id = _item_id(ctx, _PREFIX[seg.kind], seg.index)
    text = seg.text()
    if seg.kind == TEXT:
        return {
            "id": item_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }
    if seg.kind == REASONING:
        return {
            "id": item_id,
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
            "encrypted_content": None,
            "status": status,
        }
    item = {
        "id": item_id,
        "type": "function_call",
        "call_id": seg.call_id or _item_id(ctx, "call", seg.index),
        "name": seg.name,
        "arguments": text,
        "status": status,
    }
    mapped = ctx.namespaced.get(seg.name)
    if mapped is not None:
        item["namespace"], item["name"] = mapped
    return item


def _output(
    ctx: Context, acc: Accumulator, cut: str, rest: str, closed: Collection[int] = ()
) -> list[dict]:
    """Every item in its final form. Items not `closed` yet close as `cut` if last (the one
    being generated when the output stopped), else as `rest`."""
    last = len(acc.segments) - 1
    return [
        _item(
            ctx,
            seg,
            "completed" if seg.index in closed else cut if seg.index == last else rest,
        )
        for seg in acc.segments
    ]


def _status(acc: Accumulator) -> tuple[str, dict | None]:
    reason = acc.finish_reason()
    if reason == segments.LENGTH:
        return "incomplete", {"reason": "max_output_tokens"}
    if reason == segments.CONTENT_FILTER:
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


def _final_response(ctx: Context, acc: Accumulator) -> dict:
    # Only the last item can still be open when the output ends: a new item closes the one
    # before, except function calls, which the stream closes last (see `Stream`).
    status, incomplete = _status(acc)
    output = _output(ctx, acc, status, "completed")
    return _response(ctx, status, output, _usage(acc.usage), incomplete)


def from_upstream(resp: dict, ctx: Context) -> bytes:
    acc = Accumulator()
    acc.feed(resp)
    return _encode(_final_response(ctx, acc))


# -- streaming -----------------------------------------------------------------------------------

_DELTA = {
    REASONING: "response.reasoning_text.delta",
    TEXT: "response.output_text.delta",
    TOOL_CALL: "response.function_call_arguments.delta",
}
_DONE = {
    REASONING: "response.reasoning_text.done",
    TEXT: "response.output_text.done",
}
_ADDED = {
    REASONING: ("reasoning", {"type": "reasoning_text", "text": ""}),
    TEXT: ("message", {"type": "output_text", "text": "", "annotations": []}),
}


class Stream(StreamBase, segments.Sink):
    """Chat chunks in, Responses SSE events out; each segment is an output item. Function calls
    stay open until `close()`: a harness runs a call when its `output_item.done` arrives, which
    must not happen before the call is recorded."""

    __slots__ = ("_ctx", "_acc", "_out", "_seq", "_started", "_ids", "_closed")

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._acc = Accumulator()
        self._out: list[bytes] = []
        self._seq = 0
        self._started = False
        self._ids: list[str] = []  # item id per segment
        self._closed: set[int] = set()  # segments whose item is done

    def _event(self, kind: str, fields: dict) -> None:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        self._out.append(b"event: %s\ndata: %s\n\n" % (kind.encode(), _encode(payload)))

    def _start(self) -> None:
        self._started = True
        resp = _response(self._ctx, "in_progress", [], None)
        self._event("response.created", {"response": resp})
        self._event("response.in_progress", {"response": resp})

    def start(self, seg: Segment) -> None:
        item_id = _item_id(self._ctx, _PREFIX[seg.kind], seg.index)
        self._ids.append(item_id)
        if seg.kind == TOOL_CALL:
            added = _item(self._ctx, seg, "in_progress")
            self._event("response.output_item.added", {"output_index": seg.index, "item": added})
            return
        kind, part = _ADDED[seg.kind]
        added = {"id": item_id, "type": kind, "status": "in_progress", "content": []}
        if seg.kind == TEXT:
            added["role"] = "assistant"
        else:
            added["summary"] = []
        self._event("response.output_item.added", {"output_index": seg.index, "item": added})
        self._event(
            "response.content_part.added",
            {"item_id": item_id, "output_index": seg.index, "content_index": 0, "part": part},
        )

    def delta(self, seg: Segment, text: str) -> None:
        # The per-chunk event: one dict, built in its final key order.
        kind, index = seg.kind, seg.index
        seq = self._seq
        self._seq = seq + 1
        name = _DELTA[kind]
        payload = {
            "type": name,
            "sequence_number": seq,
            "item_id": self._ids[index],
            "output_index": index,
        }
        if kind != TOOL_CALL:
            payload["content_index"] = 0
        payload["delta"] = text
        if kind == TEXT:
            payload["logprobs"] = []
        self._out.append(b"event: %s\ndata: %s\n\n" % (name.encode(), _encode(payload)))

    def end(self, seg: Segment) -> None:
        if seg.kind != TOOL_CALL:
            self._close_item(seg, "completed")

    def _close_item(self, seg: Segment, status: str) -> None:
        self._closed.add(seg.index)
        final = _item(self._ctx, seg, status)
        where = {"item_id": final["id"], "output_index": seg.index}
        if seg.kind == TOOL_CALL:
            self._event(
                "response.function_call_arguments.done", {**where, "arguments": final["arguments"]}
            )
        else:
            part = final["content"][0]
            done = {**where, "content_index": 0, "text": part["text"]}
            if seg.kind == TEXT:
                done["logprobs"] = []
            self._event(_DONE[seg.kind], done)
            self._event("response.content_part.done", {**where, "content_index": 0, "part": part})
        self._event("response.output_item.done", {"output_index": seg.index, "item": final})

    def _flush(self) -> bytes:
        out = b"".join(self._out)
        self._out.clear()
        return out

    def feed(self, chunk: dict) -> bytes:
        if not self._started:
            self._start()
        self._acc.feed(chunk, self)
        return self._flush()

    def response(self) -> dict:
        """The response object `close()` will send, for the core to store before it does."""
        return _final_response(self._ctx, self._acc)

    def close(self) -> bytes:
        if not self._started:
            self._start()
        resp = self.response()
        for seg, final in zip(self._acc.segments, resp["output"]):
            if seg.index not in self._closed:
                self._close_item(seg, final["status"])
        self._event(f"response.{resp['status']}", {"response": resp})
        return self._flush()

    def fail(self, err: GatewayError) -> bytes:
        """`error`, then `response.failed` with what was generated so far. Open items are not
        closed: a harness would run a half-streamed function call."""
        self._out.clear()  # events of a chunk the protocol could not take
        if not self._started:
            self._start()
        code = err.code or (
            "context_length_exceeded" if err.kind == "context_length_exceeded" else "server_error"
        )
        self._event("error", {"code": code, "message": err.message, "param": err.param})
        resp = _response(
            self._ctx,
            "failed",
            _output(self._ctx, self._acc, "incomplete", "incomplete", self._closed),
            _usage(self._acc.usage),
            error={"code": code, "message": err.message},
        )
        self._event("response.failed", {"response": resp})
        return self._flush()


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


class ResponsesAdapter(Adapter[Request, Context]):
    name = NAME
    stateful = True

    def parse(self, raw: bytes, earlier: Iterable[Layout] = ()) -> tuple[Request, Layout | None]:
        return parse(raw, earlier)

    def previous_id(self, req: Request) -> str | None:
        return previous_id(req)

    def to_upstream(
        self, req: Request, history: list[Any] | None = None
    ) -> tuple[dict[str, Any], Context]:
        return to_upstream(req, history)

    def stored_state(
        self, req: Request, ctx: Context, response: dict[str, Any] | bytes
    ) -> dict[str, Any]:
        return stored_state(req, ctx, response)

    def from_upstream(self, resp: dict[str, Any], ctx: Context) -> bytes:
        return from_upstream(resp, ctx)

    def stream(self, ctx: Context) -> Stream:
        return Stream(ctx)

    def render_error(self, err: GatewayError) -> tuple[int, bytes]:
        return render_error(err)


ADAPTER = ResponsesAdapter()
