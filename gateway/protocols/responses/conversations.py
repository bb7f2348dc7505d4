"""Stored conversation state (`previous_response_id`): what a Responses call stores so that a
later request can continue from it, and which stored response a request continues. The relay
calls these through the adapter, as for every stateful protocol."""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.protocols.responses.translate import input_items
from gateway.protocols.responses.types import Context, Request


def conversation_items(
    req: Request, resp_body: dict[str, Any] | bytes, previous_items: list[Any] | None = None
) -> list[dict[str, Any]]:
    """What to store under this response's id so a later `previous_response_id` can resume:
    the earlier conversation (if given), this request's input items and this response's output
    items, as Responses items. Instructions are not carried over, as in the OpenAI API.
    `resp_body` is the response object: `from_upstream`'s bytes or `Stream.response()`."""
    response = resp_body if isinstance(resp_body, dict) else msgspec.json.decode(resp_body)
    items: list[dict[str, Any]] = list(previous_items or ())
    items.extend(msgspec.to_builtins(input_items(req.body)))
    items.extend(response["output"])
    return items



def previous_id(req: Request) -> str | None:
    """The stored response this request continues, if any."""
    return req.body.previous_response_id


def stored_state(
    req: Request, ctx: Context, resp_body: dict[str, Any] | bytes
) -> dict[str, Any]:
    """What the core stores with the call so a later request can continue from it: only this
    call's own items and a pointer to its predecessor, so a chain of N responses is stored in
    O(N), and resolved by walking the pointers (`conversation_items` with the earlier items)."""
    return {
        "response_id": ctx.response_id,
        "previous_response_id": req.body.previous_response_id,
        "items": conversation_items(req, resp_body),
    }
