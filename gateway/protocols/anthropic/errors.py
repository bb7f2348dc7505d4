"""Errors in Anthropic's shape: the error types it names, its statuses, and the wording of an
overlong prompt that Claude Code compacts on."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from gateway.protocols.errors import GatewayError

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


def error_body(err: GatewayError) -> tuple[int, dict[str, Any]]:
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
    status, body = error_body(err)
    return status, msgspec.json.encode(body)
