"""The splice of an exact continuation (the parent's ids, the template's turn end, the render of
what follows) and the record of what was decided for a call, with its reasons."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec
import numpy as np

PATHS = ("exact", "render", "fallback")

# Why a call was rendered plainly (path "render") or could not continue exactly ("fallback").
FIRST_TURN = "first turn"  # no assistant message to continue from
NO_PARENT = "no parent"  # assistant turns, but none is the reply of a recorded call
CONFIGURED = "render configured"  # --continuation render
MEDIA = "media content"  # the engine renders non-text content itself
ECHO = "echo requested"  # vLLM renders the messages to echo them
PARENT_TOKENS = "parent tokens unavailable"
RENDER_FAILED = "render failed"
TEMPLATE_PROBE = "template turn end unknown"
REWRITES_HISTORY = "template rewrites history"  # full render does not extend the turn render
TURN_END = "turn end differs"  # the assistant turn ends unlike the probed template turn end
IGNORED = "engine ignored prompt ids"  # its echoed prompt is not the splice

class ContinuationRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the gateway did for one call, stored with it."""

    path: str  # exact | render | fallback
    reason: str | None = None
    parent: str | None = None  # call id of the continued call
    messages: int = 0  # request messages covered by the parent's request + reply
    render_ms: float | None = None  # time spent rendering for the splice
    rendered_by: str | None = None  # engine | local
    window: str | None = None  # reply | frame: the part of the conversation rendered, if not all


def assistant_suffix(generation: Sequence[int], empty_turn: Sequence[int]) -> tuple[int, ...]:
    """The tokens a template puts after an assistant message's content (end-of-turn token and
    the glue before the next message), from two renders of one user message: with the
    generation prompt, and followed by an empty assistant message. Empty if they say nothing."""
    shared = 0
    for a, b in zip(generation, empty_turn):
        if a != b:
            break
        shared += 1
    return tuple(empty_turn[shared:])


def splice(
    parent_full: np.ndarray,
    turn_end: Sequence[int],
    tail: Sequence[int],
    suffix: Sequence[int],
    spare: int = 0,
) -> tuple[np.ndarray | None, str | None]:
    """(prompt ids, None) for an exact continuation, or (None, reason) when there is none.

    `parent_full`: the parent's prompt + sampled ids. `turn_end`: the last tokens of the render
    of the request up to and including the parent's reply; `tail`: the render of the whole
    request past that point (see engine_render.Around). `suffix`: the template's assistant turn end.
    `spare`: ids of room left after the prompt in its array (`ids.base`), where the call's own
    sampled ids can follow it without copying the prompt again (see `Turn.full`)."""
    n = len(suffix)
    if not n:
        return None, TEMPLATE_PROBE
    if len(turn_end) < n or tuple(turn_end[-n:]) != tuple(suffix):
        return None, TURN_END
    glue = suffix[1:] if parent_full.size and parent_full[-1] == suffix[0] else suffix
    # int32, as the capture keeps prompt ids: a wider array would be copied again there.
    at, end = parent_full.size, parent_full.size + len(glue)
    room = np.empty(end + len(tail) + spare, dtype=np.int32)
    room[:at] = parent_full
    room[at:end] = glue
    room[end : end + len(tail)] = tail
    return room[: end + len(tail)], None


def counts(records: Iterable[dict | None]) -> dict:
    """Per path and per reason, over the calls' stored continuation records."""
    paths = dict.fromkeys(PATHS, 0)
    reasons: dict[str, int] = {}
    for rec in records:
        if not rec:
            continue
        paths[rec["path"]] = paths.get(rec["path"], 0) + 1
        if rec.get("reason"):
            key = f"{rec['path']}: {rec['reason']}"
            reasons[key] = reasons.get(key, 0) + 1
    return {**paths, "reasons": dict(sorted(reasons.items()))}
