"""The request-side helpers every protocol's translation shares: the texts of request errors
(with msgspec's path turned into the request field), tools and tool choice in chat form with
the checks on them, and text content and system prompts as chat messages.

vLLM accepts a malformed tool schema and runs the request anyway (the tool parser and the
grammar then misbehave quietly), so the gateway refuses it with the field that is wrong."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import msgspec

from gateway.protocols.errors import GatewayError

# -- request errors ------------------------------------------------------------------------------


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, "invalid_request_error", param=param)


def text_only(kind: str, path: str, param: str | None = None) -> GatewayError:
    """`kind` content (image, document, audio...) at `path` of the request: refused, with a
    message that says why, because the served models read text only."""
    return bad_request(
        f"{path}: {kind} content is not supported: the served model is text-only",
        param=param or path,
    )


_AT = " - at `$"
_MISSING = re.compile(r"^Object missing required field `([^`]+)`$")


def invalid_field(exc: msgspec.DecodeError, root: str = "") -> tuple[str, str, bool]:
    """msgspec's message split into (what is wrong, the request field it names, whether the
    field is missing). The path is msgspec's (`messages[0].content`, under `root`); a missing
    field is named itself, not the object that lacks it."""
    text, sep, at = str(exc).partition(_AT)
    path = root + (at[:-1] if sep else "")
    missing = _MISSING.match(text)
    if missing:
        path = f"{path}.{missing[1]}"
    return text, path.lstrip("."), missing is not None


# -- text content --------------------------------------------------------------------------------


def text_content(texts: list[str]) -> str | list[dict[str, str]]:
    """Chat content of a message's text parts: one stays a string, several stay separate parts,
    as the client sent them."""
    if len(texts) == 1:
        return texts[0]
    return [{"type": "text", "text": t} for t in texts]


def system_messages(text: str | None) -> list[dict[str, Any]]:
    """The chat system message of a system prompt or instructions; none for None."""
    return [] if text is None else [{"role": "system", "content": text}]


# -- tools ---------------------------------------------------------------------------------------


def check_object_schema(schema: Any, path: str) -> None:
    """`schema` (at `path` in the request) must describe a JSON object: type 'object', and
    `properties` / `required` of the right kinds when present."""
    if not isinstance(schema, dict):
        raise bad_request(f"{path}: must be a JSON Schema object", param=path)
    if schema.get("type") != "object":
        raise bad_request(
            f"{path}.type: must be 'object', got {schema.get('type')!r}", param=f"{path}.type"
        )
    properties = schema.get("properties")
    if properties is not None and not (
        isinstance(properties, dict) and all(isinstance(v, dict) for v in properties.values())
    ):
        raise bad_request(
            f"{path}.properties: must map each parameter name to its schema",
            param=f"{path}.properties",
        )
    required = schema.get("required")
    if required is not None and not (
        isinstance(required, list) and all(isinstance(r, str) for r in required)
    ):
        raise bad_request(
            f"{path}.required: must be a list of parameter names", param=f"{path}.required"
        )


def chat_tool(
    name: str, parameters: Any, description: str | None, strict: bool | None, path: str
) -> dict[str, Any]:
    """A chat-completions function tool; `path` names the parameter schema in the request."""
    if parameters is not None:
        check_object_schema(parameters, path)
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    if strict is not None:
        # Strict tool use: vLLM then holds the arguments to the schema, and only then does a
        # small model produce valid calls.
        function["strict"] = strict
    return {"type": "function", "function": function}


def check_unique_names(tools: list[dict[str, Any]], param_of: Callable[[int], str]) -> None:
    """Two tools of one name would leave the engine's parser to guess which one a call means;
    `param_of(i)` names the field of the i-th tool in the request."""
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if name in seen:
            param = param_of(i)
            raise bad_request(f"{param}: tool names must be unique; {name!r} repeats", param=param)
        seen.add(name)


def chat_tool_choice(
    mode: str, name: str | None, tools: list[dict[str, Any]] | None, label: str
) -> str | dict[str, Any] | None:
    """The chat form of a tool choice: `mode` is 'auto', 'none', 'required' or 'function' (the
    tool `name`); None when no tool reaches the model, so there is nothing to choose. `label` is
    the choice as the client's protocol names it, for the error."""
    if mode in ("auto", "none"):
        return mode if tools else None
    if not tools:
        raise bad_request(
            f"tool_choice: {label} needs tools, and the request offers the model none",
            param="tool_choice",
        )
    if mode == "required":
        return "required"
    if not any(tool["function"]["name"] == name for tool in tools):
        raise bad_request(
            f"tool_choice.name: no tool named {name!r} in tools", param="tool_choice.name"
        )
    return {"type": "function", "function": {"name": name}}
