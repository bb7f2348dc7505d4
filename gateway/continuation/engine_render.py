"""Chat messages to prompt token ids with the model's chat template, without generating, by the
engine; the other renderers stand in for it where they agree with it.

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

import logging
from typing import TYPE_CHECKING

import aiohttp
import msgspec

from gateway import engine_ids
from gateway.continuation.rendering import (
    Around,
    Encoded,
    RenderError,
    opening_messages,
    render_body,
    side_by_side,
    split_spans,
)
from gateway.protocols.errors import GatewayError

if TYPE_CHECKING:
    from gateway.upstream import Upstreams

log = logging.getLogger(__name__)


RENDER_PATH = "/v1/chat/completions/render"

_encode = msgspec.json.encode


class _Rendered(msgspec.Struct):
    token_ids: msgspec.Raw


_decode_rendered = msgspec.json.Decoder(_Rendered).decode


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
        assert span is not None  # a sentinel there means split cut the array out
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


