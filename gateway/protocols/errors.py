"""The one error type every layer raises; each protocol renders it in its own wire shape."""

from __future__ import annotations


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
