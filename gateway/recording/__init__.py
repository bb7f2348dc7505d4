"""One model call's record: from its frozen outcome to a durable row.

`Recording.record` is the only way a call reaches the `calls` table, and the only writer of the
rollout memory (`gateway.rollout_memory`). It chooses the call's base
(delta encoding against committed calls only), builds the row, waits for its commit, and only
then updates what later calls read: the recent-calls cache and the continuation reply index. A
row that was refused therefore never becomes anyone's base, so one failed commit cannot make
later calls of its rollout (or, through a shared batch, of others) fail too.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import asyncpg  # pyright: ignore[reportMissingTypeStubs] - asyncpg ships no type stubs
import msgspec
import numpy as np

from core.merge.prefixes import best_base
from core.store import bodies
from core.store import calls as calls_store
from core.store.db import UNAVAILABLE
from gateway import engine_ids
from gateway.call_values import Outcome, ParsedCall
from gateway.protocols.errors import GatewayError
from gateway.recording.recorder import Recorder, Stalled, Unavailable
from gateway.rollout_memory import RolloutMemory

if TYPE_CHECKING:
    from core.store.conn import Pool

log = logging.getLogger(__name__)

__all__ = ["Recorder", "Recording", "RETRY_AFTER_S"]

# What a client is told to wait when the database is behind or away.
RETRY_AFTER_S = 2

_encode = msgspec.json.encode
_OVER_LIMITS_KEPT = 10_000
_DB_ERRORS = (Unavailable, asyncpg.PostgresError, *UNAVAILABLE)


class Recording:
    def __init__(
        self,
        pool: Pool,
        recorder: Recorder,
        memory: RolloutMemory,
        record_bodies: bool,
        on_recorded: Callable[[calls_store.CallRecord], None],
    ) -> None:
        self._pool = pool
        self.recorder = recorder
        self._recent = memory.recent
        self._replies = memory.replies
        self._record_bodies = record_bodies
        self._on_recorded = on_recorded
        # Rollouts the database refused a call of for their limits: their next calls are
        # refused before the engine works for them (a limit is never lifted).
        self._over_limits: OrderedDict[uuid.UUID, GatewayError] = OrderedDict()

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

    def admit_rollout(self, rollout_id: uuid.UUID) -> None:
        """Raises the error of `rollout_id`'s last call refused for its limits, if there was one."""
        refused = self._over_limits.get(rollout_id)
        if refused is not None:
            raise refused

    async def record(self, out: Outcome) -> calls_store.CallRecord:
        """Stores `out`; returns the row once it is committed. Raises a GatewayError the client
        can be given if it was not."""
        rollout_id = out.rollout_id
        res, req, turn = out.result, out.request, out.plan
        prompt, completion = res.prompt, res.completion
        candidates = self._recent.get(rollout_id)
        if candidates is None:
            try:
                # Within the commit's bound too: a frozen database must not hold the call here.
                candidates = await asyncio.wait_for(
                    self._read_recent(rollout_id), self.recorder.commit_wait_s)
            except TimeoutError:
                raise _failure(Stalled("database stalled: the rollout's earlier calls could "
                                       "not be read")) from None
            except _DB_ERRORS as exc:
                raise _failure(exc) from exc
            self._recent.load(rollout_id, candidates)
        opens = None
        if turn is not None:
            candidates = turn.candidates(candidates)
            opens = turn.opens(prompt, candidates)
        base_id, prefix_len = best_base(prompt, candidates, opens) if len(prompt) else (None, 0)
        response_summary: dict[str, Any] = {
            "message": res.message,
            "finish_reason": res.finish_reason,
            "usage": res.usage,
        }
        response_id = None
        if out.stored_state is not None:
            response_summary.update(out.stored_state)
            response_id = response_summary["response_id"]
        ok = out.status == "ok"
        reply_keys = turn.keys.reply_keys(res.message) if turn and ok else None
        summary = _encode(response_summary)
        request_body, request_base = self._request_body(rollout_id, base_id, req)
        rec = calls_store.CallRecord(
            id=out.call_id,
            rollout_id=rollout_id,
            protocol=req.protocol,
            status=out.status,
            started_at=out.started_at,
            base_id=base_id,
            prefix_len=prefix_len,
            prompt_len=len(prompt),
            prompt_delta=prompt[prefix_len:].tobytes(),
            completion_ids=completion.tobytes(),
            logprobs=res.logprobs.tobytes(),
            versions=res.versions.tobytes(),
            finish_reason=res.finish_reason,
            offered_tools=req.offered_tools,
            model=req.model,
            requested=req.requested,
            applied=req.applied,
            request_body=request_body,
            # Kept even without --record-bodies when it carries conversation state a later
            # request may continue from.
            response_body=bodies.whole(summary)
            if self._record_bodies or response_id
            else None,
            upstream=res.upstream,
            latency_ms=out.latency_ms,
            ttft_ms=res.ttft_ms,
            error=out.error,
            user_agent=req.user_agent,
            response_id=response_id,
            continuation=msgspec.to_builtins(turn.record) if turn else None,
            reply_keys=reply_keys,
            rerouted=res.rerouted,
            constrained=bool(req.constraints),
            body_digest=req.digest,
            retry_count=req.retry_count,
            request_base=request_base,
        )
        try:
            await self.recorder.record(rec)
        except _DB_ERRORS as exc:
            failure = _failure(exc)
            if failure.code == "rollout_limit":
                self._over_limits[rollout_id] = failure
                if len(self._over_limits) > _OVER_LIMITS_KEPT:
                    self._over_limits.popitem(last=False)
            raise failure from exc
        # Committed: from now on a later call may use it as its base or continue from it.
        if len(prompt):
            self._recent.add(
                rollout_id,
                out.call_id,
                turn.full(prompt, completion) if turn else np.concatenate((prompt, completion)),
                turn.keys if turn else None,
                body=req.raw if self._record_bodies else None,
                reply=summary if self._record_bodies else b"",
                full_json=None
                if out.prompt_json is None
                else engine_ids.extend(out.prompt_json, _encode(completion.tolist())),
                supersedes=base_id if _continues(base_id, prefix_len, candidates) else None,
                request=None if req.layout is None else req.layout.kept(),
            )
        if reply_keys:
            self._replies.add(rollout_id, out.call_id, reply_keys)
        self._on_recorded(rec)
        return rec

    async def _read_recent(self, rollout_id: uuid.UUID) -> list[tuple[uuid.UUID, np.ndarray]]:
        async with self._pool.acquire() as conn:
            return await calls_store.recent_full_ids(conn, rollout_id, self._recent.per_rollout)

    def _request_body(
        self, rollout_id: uuid.UUID, base_id: uuid.UUID | None, req: ParsedCall
    ) -> tuple[bytes | None, uuid.UUID | None]:
        """(stored body, the call it is a delta against): the token base's body is the parent
        (the same conversation, one turn earlier); whole when that body is not at hand."""
        if not self._record_bodies:
            return None, None
        base = self._recent.find(rollout_id, base_id) if base_id is not None else None
        if base is None or base.body is None:
            return bodies.whole(req.raw), None
        known = 0 if req.layout is None else req.layout.shared_with(base.body)
        return bodies.delta(base.body, req.raw, base.reply, known), base_id


def _continues(
    base_id: uuid.UUID | None, prefix_len: int, candidates: Iterable[tuple[uuid.UUID, np.ndarray]]
) -> bool:
    """Whether a prompt whose longest shared prefix with `base_id`'s ids is `prefix_len` holds
    all of them: the call continues that one."""
    return base_id is not None and any(
        cid == base_id and full.size == prefix_len for cid, full in candidates
    )


def _failure(exc: BaseException) -> GatewayError:
    """The client's error for a call that was not recorded."""
    if getattr(exc, "sqlstate", None) == "RT413":
        what = "storage quota (--rollout-max-stored-mb)" if "storage" in str(exc) else (
            "limit of calls (the merge takes at most that many)")
        return GatewayError(
            413,
            f"this rollout is past its {what}; the call was not recorded, and its next calls "
            "will not be either: end the rollout",
            "request_too_large",
            code="rollout_limit",
        )
    if getattr(exc, "sqlstate", None) == "RT409":
        return GatewayError(
            409,
            "this rollout has ended (finished or past its deadline) while the call ran; the "
            "call was not recorded",
            code="rollout_ended",
        )
    if isinstance(exc, Unavailable):
        # Stalled or away: the recorder holds the record and writes it once the database
        # answers, so the client hears "not yet", not "lost"; its retry reads as one.
        stalled = isinstance(exc, Stalled)
        return GatewayError(
            503,
            f"the call's record was not committed ({exc}); it will be written when the "
            "database answers again: retry shortly",
            "overloaded_error" if stalled else "service_unavailable",
            retry_after=RETRY_AFTER_S,
        )
    if isinstance(exc, UNAVAILABLE):
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
