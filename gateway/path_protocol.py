"""Which API family a request path belongs to: the shape its errors take, and its label in the
gateway's metrics."""

from __future__ import annotations


def protocol_of(path: str) -> str:
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith("/v1/"):
        return "openai"
    if path.startswith("/admin"):
        return "admin"
    return "other"
