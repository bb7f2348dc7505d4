"""One model call's record: from a finished capture to a durable row.

`Recording.record` is the only way a call reaches the `calls` table. It chooses the call's base
(delta encoding against committed calls only), builds the row, waits for its commit, and only
then updates what later calls read: the recent-calls cache and the continuation reply index. A
row that was refused therefore never becomes anyone's base, so one failed commit cannot make
later calls of its rollout (or, through a shared batch, of others) fail too.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING

import asyncpg
import msgspec
import numpy as np

from gateway import engine_ids
from gateway.merge import best_base
from gateway.protocols.errors import GatewayError
from gateway.recording.recorder import Recorder, Unavailable
from gateway.store import bodies
from gateway.store import calls as calls_store
from gateway.store.db import UNAVAILABLE
from gateway.store.tokens import IDS, LOGPROBS, RecentCalls
from gateway.store.values import clean_text

if TYPE_CHECKING:
    from gateway.continuer import Continuer

log = logging.getLogger(__name__)

__all__ = ["Recorder", "Recording", "RETRY_AFTER_S"]

# What a client is told to wait when the database is behind or away.
RETRY_AFTER_S = 2

_encode = msgspec.json.encode
_DB_ERRORS = (Unavailable, asyncpg.PostgresError, *UNAVAILABLE)


class Recording:
    def __init__(
        self,
        pool: asyncpg.Pool,
        recorder: Recorder,
        recent: RecentCalls,
        continuer: Continuer,
        record_bodies: bool,
    ) -> None:
        self._pool = pool
        self.recorder = recorder
        self._recent = recent
        self._continuer = continuer
        self._record_bodies = record_bodies

    def admit(self) -> None:
        """Raises 503 (529 on the Anthropic API) if a new call could not be recorded soon."""
        why = self.recorder.busy()
        if why is not None:
            raise GatewayError(
                503,
                f"the gateway cannot record calls right now: {why}; retry in a few seconds",
                "overloaded_error",
                retry_after=RETRY_AFTER_S,
            )

    async def record(self, call, status: str, error: str | None = None) -> calls_store.CallRecord:
        """Stores `call` (a relay call with its capture); returns the row once it is committed.
        Raises a GatewayError the client can be given if it was not."""
        cap = call.capture
        rollout_id = call.rollout_id
        prompt = cap.prompt_ids if cap.prompt_ids is not None else np.zeros(0, IDS)
        prompt = prompt.astype(IDS, copy=False)
        completion = np.frombuffer(cap.completion_ids, dtype=np.int32).astype(IDS, copy=False)
        try:
            candidates = self._recent.get(rollout_id)
            if candidates is None:
                async with self._pool.acquire() as conn:
                    candidates = await calls_store.recent_full_ids(
                        conn, rollout_id, self._recent.per_rollout
                    )
                self._recent.load(rollout_id, candidates)
        except _DB_ERRORS as exc:
            raise _failure(exc) from exc
        turn = call.turn
        opens = None
        if turn is not None:
            turn.confirm(prompt)
            candidates = turn.candidates(candidates)
            opens = turn.opens(prompt, candidates)
        base_id, prefix_len = best_base(prompt, candidates, opens) if len(prompt) else (None, 0)
        message = cap.message()
        response_summary = {
            "message": message,
            "finish_reason": cap.finish_reason,
            "usage": cap.usage,
        }
        response_id = None
        if call.state is not None and call.state_source is not None and status == "ok":
            response_summary.update(call.state(call.state_source))
            response_id = response_summary["response_id"]
        reply_keys = turn.keys.reply_keys(message) if turn and status == "ok" else None
        summary = _encode(response_summary)
        request_body, request_base = self._request_body(rollout_id, base_id, call)
        rec = calls_store.CallRecord(
            id=call.id,
            rollout_id=rollout_id,
            protocol=call.protocol,
            status=status,
            started_at=call.started_at,
            base_id=base_id,
            prefix_len=prefix_len,
            prompt_len=len(prompt),
            prompt_delta=prompt[prefix_len:].tobytes(),
            completion_ids=completion.tobytes(),
            logprobs=np.frombuffer(cap.logprobs, dtype=np.float32)
            .astype(LOGPROBS, copy=False)
            .tobytes(),
            versions=cap.versions().astype(IDS, copy=False).tobytes(),
            finish_reason=clean_text(cap.finish_reason),
            offered_tools=call.offered_tools,
            model=call.model,
            requested=call.requested,
            applied=call.applied,
            request_body=request_body,
            # Kept even without --record-bodies when it carries conversation state a later
            # request may continue from.
            response_body=bodies.whole(summary)
            if self._record_bodies or response_id
            else None,
            upstream=call.upstream,
            latency_ms=(time.perf_counter() - call.started) * 1000,
            ttft_ms=call.ttft_ms,
            error=clean_text(error),
            user_agent=clean_text(call.user_agent),
            response_id=response_id,
            continuation=msgspec.to_builtins(turn.record) if turn else None,
            reply_keys=reply_keys,
            rerouted=call.rerouted,
            constrained=bool(call.constraints),
            body_digest=call.digest,
            retry_count=call.retry_count,
            request_base=request_base,
        )
        try:
            await self.recorder.record(rec)
        except _DB_ERRORS as exc:
            raise _failure(exc) from exc
        # Committed: from now on a later call may use it as its base or continue from it.
        if len(prompt):
            self._recent.add(
                rollout_id,
                call.id,
                turn.full(prompt, completion) if turn else np.concatenate((prompt, completion)),
                turn.keys if turn else None,
                body=call.raw if self._record_bodies else None,
                reply=summary if self._record_bodies else b"",
                full_json=None
                if call.prompt_json is None
                else engine_ids.extend(call.prompt_json, _encode(completion.tolist())),
                supersedes=base_id if _continues(base_id, prefix_len, candidates) else None,
                request=None if call.layout is None else call.layout.kept(),
            )
        if reply_keys:
            self._continuer.remember(rollout_id, call.id, reply_keys)
        return rec

    def _request_body(self, rollout_id, base_id, call) -> tuple[bytes | None, uuid.UUID | None]:
        """(stored body, the call it is a delta against): the token base's body is the parent
        (the same conversation, one turn earlier); whole when that body is not at hand."""
        if not self._record_bodies:
            return None, None
        base = self._recent.find(rollout_id, base_id) if base_id is not None else None
        if base is None or base.body is None:
            return bodies.whole(call.raw), None
        known = 0 if call.layout is None else call.layout.shared_with(base.body)
        return bodies.delta(base.body, call.raw, base.reply, known), base_id


def _continues(base_id, prefix_len: int, candidates) -> bool:
    """Whether a prompt whose longest shared prefix with `base_id`'s ids is `prefix_len` holds
    all of them: the call continues that one."""
    return base_id is not None and any(
        cid == base_id and full.size == prefix_len for cid, full in candidates
    )


def _failure(exc: BaseException) -> GatewayError:
    """The client's error for a call that was not recorded."""
    if getattr(exc, "sqlstate", None) == "RT409":
        return GatewayError(
            409,
            "this rollout has ended (finished or past its deadline) while the call ran; the "
            "call was not recorded",
            code="rollout_ended",
        )
    if isinstance(exc, (Unavailable, *UNAVAILABLE)):
        return GatewayError(
            503,
            f"the call could not be recorded: database unavailable ({exc}); retry shortly",
            "service_unavailable",
            retry_after=RETRY_AFTER_S,
        )
    log.error("call record refused by the database: %r", exc)
    return GatewayError(
        500, f"the call could not be recorded: the database refused it ({exc})", "api_error"
    )
