"""Chat messages to prompt token ids with the model's chat template, without generating.

`EngineRenderer` asks the replica (`POST /v1/chat/completions/render`, served by vLLM started
with `--enable-scale-out`): the ids are by construction the ones the engine would use, at the
cost of a round trip. `LocalTemplate` renders in the gateway with the model's chat template and
a tiktoken encoding built from its byte-level BPE, and tokenizes only the new part of a
continued conversation. It only approximates what the engine does (vLLM's message
preprocessing, Hugging Face's tokenizer), so `CheckedRenderer` uses it only for a replica and
model where it reproduced the engine's ids on a probe set, and for a request context (tools,
template settings) where it agreed with the engine on the first request; it cross-checks a
sample of later requests too, and stops using it for a context on any mismatch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import aiohttp
import msgspec

from gateway import engine_ids
from gateway.continuation.keys import CONTEXT_FIELDS
from gateway.protocols.errors import GatewayError
from gateway.upstream import Upstreams

log = logging.getLogger(__name__)


RENDER_PATH = "/v1/chat/completions/render"
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


class _Rendered(msgspec.Struct):
    token_ids: msgspec.Raw


_decode_rendered = msgspec.json.Decoder(_Rendered).decode


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


_encode = msgspec.json.encode


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


class EngineRenderer:
    def __init__(self, upstreams: Upstreams) -> None:
        self._upstreams = upstreams

    async def render(self, upstream: str, body: dict) -> list[int]:
        span = await self._span(upstream, body)
        try:
            return engine_ids.parse(span).tolist()
        except (msgspec.DecodeError, ValueError, TypeError, OverflowError) as exc:
            raise RenderError(f"{RENDER_PATH} answered unreadable ids: {exc}") from exc

    async def _span(self, upstream: str, body: dict) -> bytes:
        """The rendered ids as the engine wrote them: a JSON array."""
        try:
            resp = await self._upstreams.post(upstream, RENDER_PATH, _encode(body))
        except GatewayError as exc:
            raise RenderError(exc.message) from exc
        try:
            async with resp:
                raw = await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise RenderError(f"{RENDER_PATH} broke off: {exc or type(exc).__name__}") from exc
        if resp.status != 200:
            raise RenderError(f"{RENDER_PATH} answered {resp.status}: {raw[:500]!r}")
        # The ids are cut out as text rather than decoded (they are most of the answer).
        rest, span = engine_ids.split(raw, "token_ids")
        try:
            rendered = msgspec.json.decode(rest)
            if not (
                isinstance(rendered, dict) and engine_ids.is_sentinel(rendered.get("token_ids"))
            ):
                span = bytes(_decode_rendered(raw).token_ids)  # the key came first elsewhere
        except msgspec.DecodeError as exc:
            raise RenderError(f"{RENDER_PATH} answered unreadable JSON: {exc}") from exc
        return span

    async def around(
        self, upstream: str, body: dict, upto: int, encoded: Encoded | None = None
    ) -> Around | None:
        """`body` rendered around its message `upto - 1` (the reply it continues);
        `encoded`: its messages' JSON, if the caller has it or makes it cheaper."""
        messages = body["messages"]
        messages_json = _encode(messages) if encoded is None else encoded()
        turn_json = opening_messages(messages_json, messages, upto)
        turn, full = await side_by_side(
            self._span(upstream, render_body(body, msgspec.Raw(turn_json), ending="none")),
            self._span(upstream, render_body(body, msgspec.Raw(messages_json), ending="request")),
        )
        try:
            return split_spans(turn, full, "engine")
        except (msgspec.DecodeError, ValueError, TypeError, OverflowError) as exc:
            raise RenderError(f"{RENDER_PATH} answered unreadable ids: {exc}") from exc


