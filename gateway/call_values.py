"""One model call as values, one per stage of `gateway.pipeline`: the harness's request parsed
(`ParsedCall`), what the engine did (`EngineResult`), and the frozen `Outcome` recording
persists. The continuation plan between them is `gateway.continuation.planner.Turn`."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from gateway.continuation.planner import Turn
    from gateway.protocols.resumable import Layout


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """A harness request, translated to the engine's chat form and pinned to the policy: what is
    recorded of the request, whatever the engine does with it."""

    protocol: str
    raw: bytes  # the body as the harness sent it
    # A retry of an earlier call (same body, or the SDK's retry header) makes the merge mark the
    # earlier attempt abandoned.
    digest: bytes
    retry_count: int
    user_agent: str | None
    model: str
    requested: dict[str, Any]  # the harness's sampling fields, as asked
    applied: dict[str, Any]  # the policy's, as sent
    offered_tools: bool
    constraints: list[str]
    layout: Layout | None  # where the body's messages lie, for the rollout's next request


@dataclass(frozen=True, slots=True)
class EngineResult:
    """What the engine sampled for one call, as its response (or what came of it) said."""

    upstream: str | None
    rerouted: str | None  # why the call left its rollout's replica
    prompt: np.ndarray  # int32; empty if the engine gave none
    completion: np.ndarray  # int32
    logprobs: np.ndarray  # float32, one per completion id
    versions: np.ndarray  # int32, the policy version each completion id was sampled under
    message: dict[str, Any]  # the assistant message as the client received it, in chat form
    finish_reason: str | None
    usage: dict[str, Any] | None
    ttft_ms: float | None


@dataclass(frozen=True, slots=True)
class Outcome:
    """A finished call, whatever became of it: what recording stores, and all it needs to."""

    call_id: uuid.UUID
    rollout_id: uuid.UUID
    status: str  # ok | failed | aborted
    error: str | None
    started_at: datetime
    latency_ms: float
    request: ParsedCall
    plan: Turn | None  # the continuation step (chat-completions upstreams)
    result: EngineResult
    # What a stateful protocol keeps of its response for a later request to continue from.
    stored_state: dict[str, Any] | None
    # The engine's prompt ids as JSON pieces (gateway.engine_ids), kept beside the ids for the
    # calls that continue this one.
    prompt_json: tuple[bytes, ...] | None
