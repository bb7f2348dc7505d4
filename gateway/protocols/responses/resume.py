"""The Responses translation's resume cache: a body's input items as converted and as chat
messages (its instructions apart), kept on its layout (gateway/protocols/resumable.py) and
taken up by a request resumed from that body that opens with all of its items: only the new
items are converted and translated.

The taken items passed the checks with the earlier body. Translation takes up after the last
item that left no assistant turn open. Deleting this module's use changes only speed: every
request would then convert and translate all its items."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from gateway.protocols.responses.types import Item

if TYPE_CHECKING:  # named in annotations only
    from gateway.protocols.resumable import Layout


class ItemLog(NamedTuple):
    """`done` items made `size` messages of `out` with no assistant turn open after them;
    `call_ids` are of all the items' function calls."""

    items: list[Item]
    out: list[dict[str, Any]]
    done: int
    size: int
    call_ids: set[str]


def taken_from(layout: Layout | None) -> ItemLog | None:
    """The earlier request's log, if this body opens with all of its items."""
    if layout is None:
        return None
    earlier = layout.derived_from()
    if isinstance(earlier, ItemLog) and layout.resumed == len(earlier.items):
        return earlier
    return None


def resume_point(taken: ItemLog | None) -> tuple[list[dict[str, Any]], set[str], int]:
    """(the chat messages so far, the function call ids so far, the index of the first item
    still to translate): new containers, which the translation of this body extends."""
    if taken is None:
        return [], set(), 0
    return taken.out[: taken.size], set(taken.call_ids), taken.done
