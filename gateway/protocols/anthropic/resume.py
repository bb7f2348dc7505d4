"""The Anthropic translation's resume cache: a body's messages as translated turn by turn, kept
on its layout (gateway/protocols/resumable.py) so that a request resumed from that body
translates only the turns after the last one the two share whole.

The shared turns passed the checks with the earlier body and translate the same. The system
prompt is not part of it: Claude Code changes it every call (its billing line), so it is
translated anew. Deleting this module's use changes only speed: every request would then
translate all its turns."""

from __future__ import annotations

from bisect import bisect_right
from typing import TYPE_CHECKING, Any

from gateway.protocols.anthropic.types import Message

if TYPE_CHECKING:  # named in annotations only
    from gateway.protocols.resumable import Layout


def opens_turn(messages: list[Message], index: int) -> bool:
    """Whether `messages[index]` starts a turn: consecutive user or assistant messages form one
    turn, and a system message is a turn of its own."""
    role = messages[index].role
    return index == 0 or role == "system" or role != messages[index - 1].role


class TurnLog:
    """The chat messages of a body's turns so far (its system prompt apart), with where each
    turn ends. Built per request, taking up an earlier body's, and extended turn by turn by
    the translation (one append to each list a turn); read-only once on a layout."""

    __slots__ = ("out", "ends", "sizes", "open_ids")

    def __init__(
        self,
        out: list[dict[str, Any]],
        ends: list[int],
        sizes: list[int],
        open_ids: list[set[str]],
    ) -> None:
        self.out = out  # the chat messages
        self.ends = ends  # per turn: the index of the message after it
        self.sizes = sizes  # per turn: len(out) after it
        self.open_ids = open_ids  # per turn: the tool_use ids a user turn after it may answer

    @classmethod
    def resumed(cls, messages: list[Message], layout: Layout | None) -> TurnLog:
        """The log of the turns this body shares whole with the one it was resumed from: those
        within the earlier body's messages, the last of them only if no new message joins it.
        Empty for a body decoded whole."""
        earlier = None if layout is None else layout.derived_from()
        if not isinstance(earlier, TurnLog) or layout is None:
            return cls([], [], [], [])
        t = bisect_right(earlier.ends, layout.resumed)
        shared = t - 1 if t and not opens_turn(messages, earlier.ends[t - 1]) else t
        if not shared:
            return cls([], [], [], [])
        return cls(
            earlier.out[: earlier.sizes[shared - 1]],
            earlier.ends[:shared],
            earlier.sizes[:shared],
            earlier.open_ids[:shared],
        )

    def start(self) -> int:
        """The index of the first message still to translate."""
        return self.ends[-1] if self.ends else 0

    def open_tool_ids(self) -> set[str]:
        """The tool_use ids the next turn may answer."""
        return self.open_ids[-1] if self.open_ids else set()
