"""OpenAI Responses API on top of vLLM chat completions. The package: types.py (the wire
types), translate.py (request items to chat messages), resume.py (the translation's resume
cache), emit.py (a chat completion to a `response` object, and each chat chunk to Responses
events as it arrives), conversations.py (the stored state of `previous_response_id`); here,
the adapter the relay serves it through. Errors are OpenAI's (openai_common.py).

Decisions (see the tests for each):
- `reasoning` input items become the `reasoning` field of the assistant message they precede
  (vLLM hands it to the chat template); items with only a summary or encrypted content carry no
  text the model produced and are dropped.
- Tools: `function` tools pass through; `namespace` tools are flattened to `<namespace>__<name>`
  (vLLM's own Responses server does the same) and calls are mapped back to `name` + `namespace`,
  which Codex needs to route them. Hosted tools the server would run (web search, file search,
  code interpreter, ...) are dropped and listed in `Context.dropped_tools`: nothing here can run
  them. Client tools with their own call item types (`custom`, `local_shell`, `shell`,
  `apply_patch`) are rejected: dropping them would hide a tool the harness relies on.
- `previous_response_id`: the core resolves the id and passes the earlier conversation to
  `to_upstream`; `conversation_items` gives what to store for the next link.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gateway.protocols.adapter import Adapter
from gateway.protocols.errors import GatewayError
from gateway.protocols.openai_common import render_error
from gateway.protocols.responses.conversations import (
    conversation_items,
    previous_id,
    stored_state,
)
from gateway.protocols.responses.emit import Stream, from_upstream
from gateway.protocols.responses.translate import parse, parse_request, to_upstream
from gateway.protocols.responses.types import Context, Request
from gateway.protocols.resumable import Layout

NAME = "responses"
__all__ = [
    "ADAPTER",
    "NAME",
    "Context",
    "Request",
    "Stream",
    "conversation_items",
    "from_upstream",
    "parse",
    "parse_request",
    "previous_id",
    "render_error",
    "stored_state",
    "to_upstream",
]


class ResponsesAdapter(Adapter[Request, Context]):
    name = NAME
    stateful = True

    def parse(self, raw: bytes, earlier: Iterable[Layout] = ()) -> tuple[Request, Layout | None]:
        return parse(raw, earlier)

    def previous_id(self, req: Request) -> str | None:
        return previous_id(req)

    def to_upstream(
        self, req: Request, history: list[Any] | None = None
    ) -> tuple[dict[str, Any], Context]:
        return to_upstream(req, history)

    def stored_state(
        self, req: Request, ctx: Context, response: dict[str, Any] | bytes
    ) -> dict[str, Any]:
        return stored_state(req, ctx, response)

    def from_upstream(self, resp: dict[str, Any], ctx: Context) -> bytes:
        return from_upstream(resp, ctx)

    def stream(self, ctx: Context) -> Stream:
        return Stream(ctx)

    def render_error(self, err: GatewayError) -> tuple[int, bytes]:
        return render_error(err)


ADAPTER = ResponsesAdapter()
