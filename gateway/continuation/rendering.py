"""What the continuation's renderers share: a request rendered around the reply it continues
(`Around`), the render requests they make, the split of two renders into that, and the
cross-check by which a cheaper render stands in for a reference one (`Crosscheck`)."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from typing import NamedTuple

import msgspec

from gateway import engine_ids
from gateway.continuation.keys import CONTEXT_FIELDS

log = logging.getLogger(__name__)

_encode = msgspec.json.encode

# Tokens kept from the end of the render up to the parent's reply: enough for any template's
# end of an assistant turn.
TURN_END_TOKENS = 16


class RenderError(Exception):
    """The engine could not render a request (its message says why)."""


class Around(NamedTuple):
    """A request rendered around the reply it continues."""

    turn_end: tuple[int, ...]  # the last tokens of the render up to and including the reply
    tail: list[int]  # the render of the whole request past that point
    by: str  # engine | local
    window: str | None = None  # the window of the conversation rendered (window.py), if any

    def same_ids(self, other: Around) -> bool:
        """Whether two renders agree (a local one may keep fewer end tokens)."""
        a, b = self.turn_end, other.turn_end
        n = min(len(a), len(b))
        return self.tail == other.tail and a[len(a) - n :] == b[len(b) - n :]


# A request's messages as compact JSON (as msgspec encodes them), made when a render needs
# them: the caller may have them at hand, or encode them only for the renders that send them.
Encoded = Callable[[], bytes]


def render_body(body: dict, messages: list[dict] | msgspec.Raw, *, ending: str) -> dict:
    """A render request for `messages` with `body`'s template settings, ending as `body` ends
    (`ending="request"`: generation prompt or continued final message), with the generation
    prompt ("generation") or with neither ("none"). Sampling and tool-choice fields are left out:
    they do not change the prompt, and a forced tool choice would make the engine build a grammar
    for nothing."""
    out = {k: body[k] for k in CONTEXT_FIELDS if k in body}
    out["messages"] = messages
    if body.get("tool_choice") == "none":  # may drop the tools from the prompt
        out["tool_choice"] = "none"
    if ending == "request":
        for k in ("add_generation_prompt", "continue_final_message"):
            if k in body:
                out[k] = body[k]
    else:
        out["add_generation_prompt"] = ending == "generation"
    return out


def opening_messages(messages_json: bytes, messages: list, upto: int) -> bytes:
    """The JSON of `messages[:upto]` cut from `messages_json`, the compact JSON of all of them:
    the conversation is not encoded again for each render, only the messages past `upto`."""
    if upto >= len(messages):
        return messages_json
    if upto <= 0:
        return b"[]"
    rest = len(_encode(messages[upto:]))  # `[` + the rest's items + `]`, after a comma
    return messages_json[: len(messages_json) - rest] + b"]"


def split_around(turn: list[int], full: list[int], by: str) -> Around | None:
    """`full` cut after `turn`; None if it does not start with `turn` (the template renders the
    earlier conversation differently once more messages follow)."""
    n = len(turn)
    if len(full) < n or full[:n] != turn:
        return None
    return Around(tuple(turn[-TURN_END_TOKENS:]), full[n:], by)


_COMMA = ord(",")


def split_spans(turn: bytes, full: bytes, by: str) -> Around | None:
    """`split_around` of two renders as the engine wrote them (JSON id arrays), without turning
    the conversation into Python ints: when the turn's text opens the full one's up to a comma,
    their ids agree that far, and only the turn's last ids and the tail are parsed. Otherwise
    (a rewritten history, or arrays written with other spacing) both are parsed whole."""
    t, f = turn[1:-1], full[1:-1]
    if not (t.strip() and f.startswith(t) and (len(f) == len(t) or f[len(t)] == _COMMA)):
        return split_around(engine_ids.parse(turn).tolist(), engine_ids.parse(full).tolist(), by)
    end = t.rsplit(b",", TURN_END_TOKENS)[-TURN_END_TOKENS:]
    return Around(
        tuple(int(x) for x in end),
        engine_ids.parse(b"[" + f[len(t) + 1 :] + b"]").tolist(),
        by,
    )


async def side_by_side(first: Awaitable, second: Awaitable) -> tuple:
    """(await first, await second), run concurrently with one task (gather makes two; a task
    costs tens of µs, and every continued call renders twice)."""
    task = asyncio.ensure_future(first)
    try:
        other = await second
    except BaseException:
        task.cancel()
        task.add_done_callback(_heard)  # a failure of its own adds nothing to this one
        raise
    return await task, other


def _heard(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


class Crosscheck:
    """Where a cheaper render (`what`) may stand in for the reference one (`reference`).

    Per key (an upstream and request context, and whatever else the cheaper render depends on):
    unknown until a request there is rendered both ways, then trusted while the two agree. One
    in `sample_every` later uses is checked again in the background, one in twice as many after
    each check that agrees, down to one in `8 * sample_every` (a reference render costs what the
    cheaper one saves: at 32k tokens, milliseconds); one disagreement ends the cheaper render's
    use for that key and brings the checks back to one in `sample_every`."""

    def __init__(
        self, what: str, reference: str, sample_every: int = 32, keys: int = 4096
    ) -> None:
        self._what = what
        self._reference = reference
        self._sample_every = sample_every
        self._interval = self._due = sample_every
        # Bounded, the least recently used forgotten first: a forgotten key is learnt again at
        # the cost of one more reference render, while requests of endless new shapes (a
        # hostile harness) would otherwise grow it without end.
        self._keys: OrderedDict[Hashable, bool] = OrderedDict()
        self._max_keys = keys
        self._checks: set[asyncio.Task] = set()
        self.stats = {"used": 0, "checked": 0, "mismatches": 0}

    def trusted(self, key: Hashable) -> bool | None:
        found = self._keys.get(key)
        if found is not None:
            self._keys.move_to_end(key)
        return found

    def _set(self, key: Hashable, trusted: bool) -> None:
        self._keys[key] = trusted
        self._keys.move_to_end(key)
        while len(self._keys) > self._max_keys:
            self._keys.popitem(last=False)

    def judge(self, key: Hashable, cheap: Around | None, reference: Around | None) -> None:
        same = (reference is None and cheap is None) or (
            reference is not None and cheap is not None and reference.same_ids(cheap)
        )
        self.stats["checked"] += 1
        if same:
            if key not in self._keys:
                log.info("%s agrees with %s at %s; used there", self._what, self._reference,
                         _describe(key))
            self._set(key, True)
        else:
            self.distrust(key, f"it differs from {self._reference}")

    def distrust(self, key: Hashable, why: str) -> None:
        self.stats["mismatches"] += 1
        self._set(key, False)
        log.warning("%s not used at %s again: %s", self._what, _describe(key), why)

    def used(
        self,
        key: Hashable,
        cheap: Around | None,
        reference: Callable[[], Awaitable[Around | None]],
    ) -> None:
        """Counts a use of the cheaper render; the sampled ones are checked against
        `reference()` in the background (the call does not wait for it)."""
        self.stats["used"] += 1
        self._due -= 1
        if self._due > 0:
            return
        self._due = self._interval
        task = asyncio.create_task(self._sample(key, cheap, reference))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _sample(self, key, cheap, reference) -> None:
        try:
            expected = await reference()
        except RenderError:
            return  # nothing learnt; a later sample checks again
        self.judge(key, cheap, expected)
        agreed = self._keys.get(key) is True
        self._interval = (
            min(self._interval * 2, 8 * self._sample_every) if agreed else self._sample_every
        )


def _describe(key: Hashable) -> str:
    parts = key if isinstance(key, tuple) else (key,)
    return " ".join(p.hex()[:12] if isinstance(p, bytes) else str(p) for p in parts)
