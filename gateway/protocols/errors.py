"""The one error type every layer raises (each protocol renders it in its own wire shape), and
the texts of the request errors several protocols share."""

from __future__ import annotations

import re

import msgspec


class GatewayError(Exception):
    """A failure with an HTTP status and a protocol-neutral kind.

    `kind` uses the OpenAI names (`invalid_request_error`, `authentication_error`,
    `permission_error`, `not_found_error`, `request_too_large`, `context_length_exceeded`,
    `upstream_error`, `api_error`); the Anthropic renderer maps them to its own.
    """

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code
        self.retry_after = retry_after  # seconds, sent as Retry-After


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
