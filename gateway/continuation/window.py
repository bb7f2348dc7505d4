"""Renders for a continuation whose size follows the new messages, not the conversation.

An exact continuation needs only the template's rendering of what follows the continued reply
(`Around`). Rendering the whole conversation twice for it costs, at 32k tokens, about a
megabyte on the wire and a parse per call. Most chat templates render a message from the
message itself and its neighbours, so the same tail comes out of a window of the conversation.
Two windows are tried, smallest first:

- `reply`: the reply and everything after it, without the tools: what most templates need.
- `frame`: the leading system and developer messages, the last user message before the reply
  and everything from the reply on, with the tools: for templates that want a conversation to
  open with a user message, or that place tools or reasoning by the last user query.

That is a property of a template, not a guarantee, so it is checked where it is used
(`rendering.Crosscheck`), per request context and per shape of what the window renders (the roles
from the reply on: a template may treat a user message after tool results differently from
another tool result). The first continuation of a shape is rendered whole and in each window,
and a window is used only where it agreed; one in 32 of its later uses is rendered whole again
in the background, and a disagreement ends that window's use there.
"""

from __future__ import annotations

import functools
import hashlib
from typing import TYPE_CHECKING

import msgspec

from gateway.continuation.keys import context_key
from gateway.continuation.rendering import Around, Crosscheck, Encoded, RenderError

if TYPE_CHECKING:
    from gateway.continuation.checked_render import CheckedRenderer
    from gateway.continuation.engine_render import EngineRenderer

_FRAME_ROLES = ("system", "developer")
WINDOWS = ("reply", "frame")
_encode = msgspec.json.encode


def window(messages: list, upto: int, kind: str) -> list[int] | None:
    """Indices of the messages window `kind` keeps to render around message `upto - 1` (see
    the module's docstring), or None when that is nearly all of them."""
    head = 0
    if kind == "frame":
        while head < len(messages) and _role(messages[head]) in _FRAME_ROLES:
            head += 1
    start = max(upto - 1, head)
    query = None
    if kind == "frame":
        query = next((i for i in range(start - 1, head - 1, -1) if _role(messages[i]) == "user"),
                     None)  # fmt: skip
    kept = [*range(head), *([] if query is None else [query]), *range(start, len(messages))]
    return kept if len(kept) + 1 < len(messages) else None


def shape(messages: list, upto: int) -> bytes:
    """What a window's render depends on besides the request context: the roles from the
    reply on, and which of those messages call tools; as a digest, so that a request of any
    length keys the crosscheck in a few bytes."""
    h = hashlib.blake2b(digest_size=16)
    for m in messages[upto - 1 :]:
        role = _role(m)
        name = role.encode(errors="replace") if isinstance(role, str) else b""
        calls = isinstance(m, dict) and bool(m.get("tool_calls"))
        h.update(b"%d %d %b" % (calls, len(name), name))
    return h.digest()


def _role(message) -> object:
    return message.get("role") if isinstance(message, dict) else None


class WindowedRenderer:
    """`inner` asked to render windows of the conversation where that gives the same ids."""

    def __init__(self, inner: EngineRenderer | CheckedRenderer, sample_every: int = 32) -> None:
        self._inner = inner
        self._check = Crosscheck("windowed rendering", "the whole conversation's", sample_every)
        self.stats = self._check.stats

    async def render(self, upstream: str, body: dict) -> list[int]:
        return await self._inner.render(upstream, body)

    async def around(
        self,
        upstream: str,
        body: dict,
        upto: int,
        encoded: Encoded | None = None,
        context: bytes | None = None,
    ) -> Around | None:
        """As `EngineRenderer.around`; `context`: `context_key(body)` if the caller has it
        (hashing a harness's tools takes about 100 µs at 80 kB of them)."""
        whole = functools.partial(self._inner.around, upstream, body, upto, encoded)
        messages = body["messages"]
        where = (upstream, context or context_key(body), shape(messages, upto))
        reference = None
        for kind in WINDOWS:
            kept = window(messages, upto, kind)
            key = (*where, kind)
            trusted = self._check.trusted(key)
            if kept is None or trusted is False:
                continue
            windowed = self._windowed(upstream, body, upto, kept, kind)
            if trusted:
                try:
                    answer = await windowed()
                except RenderError:
                    return await whole()
                self._check.used(key, answer, whole)
                return None if answer is None else answer._replace(window=kind)
            # A new context or shape: rendered whole, and in each window until one agrees.
            if reference is None:
                reference = await whole()
            try:
                self._check.judge(key, await windowed(), reference)
            except RenderError as exc:  # e.g. a template that wants a user message first
                self._check.distrust(key, f"the window did not render: {exc}")
            if self._check.trusted(key):
                return reference
        return reference if reference is not None else await whole()

    def _windowed(self, upstream: str, body: dict, upto: int, kept: list[int], kind: str):
        messages = body["messages"]
        part = [messages[i] for i in kept]
        narrow = {**body, "messages": part}
        if kind == "reply":
            narrow.pop("tools", None)
        return functools.partial(
            self._inner.around,
            upstream,
            narrow,
            len(kept) - (len(messages) - upto),
            functools.partial(_encode, part),
        )
