"""The one walk of a `previous_response_id` chain (Responses API): each stored response names
the one it continued; the conversation is their items, oldest first. The walk is written once,
without I/O, and driven by a lookup that reads the database (a live call) or a dict (export)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator

from gateway.protocols.errors import GatewayError

# Each link is a query on the call's path: a rollout that chains every response to the one
# before would otherwise make its n-th call walk n of them (issue #28).
MAX_LINKS = 256

# Yields each response id to look up, is sent its stored state (None if there is none), and
# returns the chain's items (None if not even the first was found).
Walk = Generator[str, dict | None, list | None]


def _walk(response_id: str | None) -> Walk:
    chain: list[list] = []
    while response_id:
        if len(chain) == MAX_LINKS:
            raise GatewayError(
                400, f"previous_response_id: the chain of stored responses is longer than "
                f"{MAX_LINKS}; send the conversation as `input` (with `store: false`) instead",
                param="previous_response_id")
        state = yield response_id
        if state is None:
            break
        chain.append(state["items"])
        response_id = state.get("previous_response_id")
    return [item for items in reversed(chain) for item in items] if chain else None


def items(response_id: str | None, lookup: Callable[[str], dict | None]) -> list | None:
    """The chain's items, oldest first, with `lookup(response_id)` giving each stored state."""
    walk = _walk(response_id)
    try:
        wanted = next(walk)
        while True:
            wanted = walk.send(lookup(wanted))
    except StopIteration as done:
        return done.value


async def items_async(
    response_id: str | None, lookup: Callable[[str], Awaitable[dict | None]]
) -> list | None:
    """As `items`, with a lookup that has to wait (the database)."""
    walk = _walk(response_id)
    try:
        wanted = next(walk)
        while True:
            wanted = walk.send(await lookup(wanted))
    except StopIteration as done:
        return done.value
