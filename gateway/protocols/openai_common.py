"""Pieces the OpenAI-style protocols share: the error shape, SSE `data:` framing, and removing
the capture fields the gateway added to a request before the client sees the response."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import msgspec

from gateway.protocols.errors import GatewayError
from gateway.protocols.resumable import Decoder, Layout

encode = msgspec.json.encode

DONE = b"data: [DONE]\n\n"


def render_error(err: GatewayError) -> tuple[int, bytes]:
    # OpenAI reports an overlong prompt as an invalid request with code
    # `context_length_exceeded`; harnesses key on the code to compact their history.
    overflow = err.kind == "context_length_exceeded"
    return err.status, encode(
        {
            "error": {
                "message": err.message,
                "type": "invalid_request_error" if overflow else err.kind,
                "param": err.param,
                "code": "context_length_exceeded" if overflow else err.code,
            }
        }
    )


def data_frame(obj) -> bytes:
    return b"data: " + encode(obj) + b"\n\n"


class Echo(msgspec.Struct, frozen=True):
    """Which engine-side fields the client itself asked for; everything else the gateway added
    for capture is removed before the response leaves."""

    token_ids: bool = False
    logprobs: bool = False
    # `include_reasoning: false`: the engine is asked for reasoning anyway (capture needs its
    # token ids), and the client does not see it.
    reasoning: bool = True


def strip_capture(obj: dict, echo: Echo) -> dict:
    """Removes capture fields in place (top level and per choice); returns `obj`."""
    if not echo.token_ids:
        obj.pop("prompt_token_ids", None)
    obj.pop("kv_transfer_params", None)
    for choice in obj.get("choices") or ():
        if not echo.token_ids:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
        if not echo.logprobs:
            choice.pop("logprobs", None)
        if not echo.reasoning:
            for part in (choice.get("delta"), choice.get("message")):
                if isinstance(part, dict):
                    part.pop("reasoning_content", None)
                    part.pop("reasoning", None)
    return obj


_DECODER = Decoder("messages")


class Checked(NamedTuple):
    body: dict  # passed on to the engine as it is
    shape: Any  # the fields that must hold for the engine to accept it
    layout: Layout | None  # where its messages lie (gateway/protocols/resumable.py)
    first: int  # the index in the body of `shape.messages[0]`: those before it were checked


def decode_checked(
    raw: bytes,
    shape: type,
    hint: str = "",
    earlier: Iterable[Layout] = (),
    decoder: Decoder = _DECODER,
) -> Checked:
    """The body, decoded from an `earlier` request's where it can be, and checked against
    `shape` (with msgspec's path to any wrong field).

    The messages a body resumed from an earlier request's were checked with that request (a
    decoder's layouts are kept only of bodies that passed its protocol's checks), so `shape`
    holds only the messages after them, and the caller checks only those: a later call's
    checks do not grow with its conversation. Where they fail, the whole body is checked, so
    that msgspec's path names the message by its index in the request."""
    try:
        body, layout = decoder.decode(raw, earlier)
    except msgspec.DecodeError as exc:
        raise GatewayError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "request body must be a JSON object")
    try:
        if layout is not None and layout.resumed:
            new = {**body, decoder.field: layout.items[layout.resumed :]}
            try:
                return Checked(body, msgspec.convert(new, shape), layout, layout.resumed)
            except msgspec.ValidationError:
                pass
        return Checked(body, msgspec.convert(body, shape), layout, 0)
    except msgspec.ValidationError as exc:
        raise GatewayError(400, f"invalid request: {exc}{hint}") from None


def check_single_choice(body: dict) -> None:
    n = body.get("n")
    if n is not None and (type(n) is not int or n != 1):  # `true` is not 1
        raise GatewayError(
            400,
            "`n` must be 1: every sample is recorded as its own call; send "
            "several requests instead",
            param="n",
        )
