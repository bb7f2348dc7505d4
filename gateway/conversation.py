"""A recorded call's conversation in OpenAI chat form: the messages and tools the engine was
given (whatever protocol the harness spoke), followed by the reply it sampled. What `rolltap
export` writes as message-level rows for supervised fine-tuning.

It runs the gateway's own request translation on the recorded request body, so the
conversation is the one the engine saw, not a re-interpretation of it."""

from __future__ import annotations

from collections.abc import Callable

from gateway import response_chain
from gateway.protocols import anthropic, chat, completions, responses
from gateway.protocols.adapter import CHAT_PATH, Adapter
from gateway.protocols.normalize import normalize_messages

_PROTOCOLS: dict[str, Adapter] = {
    p.name: p for p in (chat.ADAPTER, completions.ADAPTER, responses.ADAPTER, anthropic.ADAPTER)
}


def chat_view(
    protocol: str,
    request_raw: bytes,
    reply: dict | None,
    stored_state: Callable[[str], dict | None] = lambda _id: None,
) -> tuple[list[dict], list[dict]] | None:
    """(messages, tools) of one call, its reply appended; None for a call with no chat
    conversation (legacy completions) or a body the gateway cannot read back.

    `stored_state(response_id)` returns the state a Responses call stored (see
    `responses.stored_state`); it resolves `previous_response_id` chains."""
    proto = _PROTOCOLS.get(protocol)
    if proto is None or proto.upstream_path != CHAT_PATH:
        return None
    req = proto.parse_request(request_raw)
    history = (
        response_chain.items(proto.previous_id(req), stored_state) if proto.stateful else None
    )
    body, _ = proto.to_upstream(req, history)
    messages = normalize_messages(body.get("messages") or [])
    if reply is not None:
        messages = [*messages, reply]
    return messages, body.get("tools") or []

