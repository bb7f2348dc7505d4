"""The first stage of a model call: the harness's body parsed, translated to the engine's chat
form and pinned to the training policy's sampling (`ParsedCall`, with the body to send)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, NamedTuple

from core.store import bodies, values
from gateway import response_chain
from gateway.call_values import ParsedCall
from gateway.constraints import CAPTURE_OFF, constraints, strip_unknown
from gateway.protocols.adapter import Adapter
from gateway.protocols.errors import GatewayError
from gateway.protocols.normalize import normalize_messages
from gateway.protocols.resumable import Layout

# Sampling parameters a harness may ask for. They are recorded as requested and replaced by the
# training policy's: the trainer's importance ratio is only right if the recorded logprobs are
# those of the policy being trained.
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "logit_bias",
    "top_logprobs",
    "logprobs",
)


# Fields the stage takes out of the body itself (below), so the allow-list need not name them.
_HANDLED = frozenset((*SAMPLING_KEYS, *CAPTURE_OFF))


def sampling_policy(temperature: float) -> dict[str, Any]:
    """The sampling every call is pinned to: the training policy's temperature over the whole
    distribution (no truncation, no penalties). Published in `GET /admin/policy`, where the
    trainer bridge checks it against its own before it trains on a single token."""
    return {
        "temperature": temperature,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
    }


def pin_sampling(body: dict, temperature: float, upstream_path: str) -> tuple[dict, dict]:
    """Moves the harness's sampling fields out of `body` and sets the policy's; returns
    (requested, applied)."""
    requested = {k: body.pop(k) for k in SAMPLING_KEYS if k in body}
    applied = sampling_policy(temperature)
    body.update(applied)
    body["return_token_ids"] = True
    if upstream_path.endswith("/chat/completions"):
        body["logprobs"] = True
        body["top_logprobs"] = 0
    else:  # legacy completions: an integer count of alternatives, 0 = only the sampled token
        body["logprobs"] = 0
    if body.get("stream"):
        body["stream_options"] = {"include_usage": True}
    return requested, applied


def retry_count(headers: Mapping[str, str]) -> int:
    """The OpenAI and Anthropic SDKs (both Stainless-generated) number their retries."""
    try:
        return max(0, min(int(headers.get("x-stainless-retry-count", "0")), 1_000_000))
    except ValueError:
        return 0


class Translated(NamedTuple):
    """A parsed call, the body the engine is to be sent, and what the protocol's response side
    needs of the request (`ctx`, and `stored_state` for a stateful protocol)."""

    call: ParsedCall
    body: dict[str, Any]
    ctx: Any
    stored_state: Callable[[dict[str, Any] | bytes], dict[str, Any]] | None
    client_ids: bool  # the harness asked for the engine's ids itself


def decode(
    proto: Adapter[Any, Any], raw: bytes, earlier: Iterable[Layout]
) -> tuple[Any, Layout | None]:
    """The protocol's request, decoded from where the rollout's earlier requests left off."""
    return proto.parse(raw, earlier)


async def translate(
    proto: Adapter[Any, Any],
    req: Any,
    layout: Layout | None,
    raw: bytes,
    headers: Mapping[str, str],
    stored_state: Callable[[str], Awaitable[dict[str, Any] | None]],
    check_model: Callable[[str], Awaitable[None]],
    temperature: float,
    default_max_tokens: int | None,
) -> Translated:
    """`req` in the engine's terms, with the conversation a stateful protocol continues read
    through `stored_state(response_id)`; a model the replicas do not serve fails first."""
    history = None
    if proto.stateful:
        prev_id = proto.previous_id(req)
        # A NUL cannot be in a stored id (nor be sent to Postgres): such an id is not found.
        if prev_id and "\x00" not in prev_id:
            history = await response_chain.items_async(prev_id, stored_state)
    body, ctx = proto.to_upstream(req, history)
    await check_model(ctx.model)
    if "messages" in body and not proto.normalises_messages:
        body["messages"] = normalize_messages(body["messages"], raw)
    offered_tools = bool(body.get("tools"))
    client_ids = bool(body.get("return_token_ids"))
    stripped = strip_unknown(body, _HANDLED)
    requested, applied = pin_sampling(body, temperature, proto.upstream_path)
    for key in CAPTURE_OFF:
        if key in body:
            requested[key] = body.pop(key)
    bad = values.problem(requested)
    if bad:
        raise GatewayError(400, f"invalid request: {bad}", param=bad.partition(":")[0])
    if stripped:
        applied["stripped"] = stripped
    constrained_by = constraints(body)
    if constrained_by:
        applied["constrained_by"] = constrained_by
    if default_max_tokens and not body.get("max_tokens") and not body.get("max_completion_tokens"):
        # Some harnesses (Codex) set no output cap; a random policy then writes until the
        # context is full.
        body["max_tokens"] = applied["max_tokens"] = default_max_tokens
    body["model"] = ctx.model
    call = ParsedCall(
        protocol=proto.name,
        raw=raw,
        digest=bodies.digest(raw),
        retry_count=retry_count(headers),
        user_agent=headers.get("User-Agent"),
        model=ctx.model,
        requested=requested,
        applied=applied,
        offered_tools=offered_tools,
        constraints=constrained_by,
        layout=layout,
    )
    state = (lambda resp_body: proto.stored_state(req, ctx, resp_body)) if proto.stateful else None
    return Translated(call, body, ctx, state, client_ids)
