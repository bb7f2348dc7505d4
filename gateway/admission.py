"""Which model calls this gateway takes: its in-flight limit (--max-inflight), refusing new
calls while it shuts down, and ending the calls still running when the drain time is up."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from datetime import UTC, datetime

from aiohttp import web

from gateway.app_keys import RETRY_AFTER
from gateway.path_protocol import protocol_of
from gateway.protocols.errors import GatewayError

log = logging.getLogger(__name__)

_RETRY_AFTER_S = "1"


class RunningCall:
    """One model call while it runs, as admission sees it: something a shutdown can end."""

    __slots__ = ("id", "rollout_id", "started", "started_at", "aborted", "task", "recording")

    def __init__(self, rollout_id: uuid.UUID) -> None:
        self.id = uuid.uuid4()
        self.rollout_id = rollout_id
        self.started = time.perf_counter()
        self.started_at = datetime.now(UTC)
        # Set by `abort` (shutdown deadline, ejected replica): (status to record, why).
        self.aborted: tuple[str, str] | None = None
        self.task: asyncio.Task | None = None  # set once it may be aborted
        self.recording = False  # past the point of no abort

    def abort(self, status: str, reason: str) -> None:
        """Ends the call from outside: it stops waiting on the engine, records `status` and
        answers with an error in its protocol. No-op once it is recording."""
        # A call whose own failure ejects its replica is already ending; it is not aborted.
        task = self.task
        if (
            self.aborted is None
            and not self.recording
            and task is not None
            and task is not asyncio.current_task()
        ):
            self.aborted = (status, reason)
            task.cancel()

class Admission:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0  # model-route requests being served
        self.closing = False  # set on SIGTERM: new calls are refused, in-flight ones finish
        # Model calls in flight (each with an `abort`), ended in their protocol's terms when a
        # shutdown's drain time is up.
        self.calls: set[RunningCall] = set()

    def enter(self, request: web.Request) -> None:
        """Counts a model request in, or refuses it in its protocol's terms: OpenAI's 429
        rate_limit_error, Anthropic's 529 overloaded_error, with Retry-After, so harnesses back
        off and retry. Each `enter` is followed by one `leave`."""
        if self.closing:
            request[RETRY_AFTER] = _RETRY_AFTER_S
            raise GatewayError(
                503, "this gateway is shutting down; retry (another gateway will take the call)",
                "overloaded_error",
            )
        if self.in_flight >= self.limit:
            request[RETRY_AFTER] = _RETRY_AFTER_S
            message = (f"this gateway is serving its limit of {self.limit} calls at once "
                       f"(--max-inflight); retry after {_RETRY_AFTER_S} s")
            if protocol_of(request.path) == "anthropic":
                raise GatewayError(529, message, "overloaded_error")
            raise GatewayError(429, message, "rate_limit_error", code="rate_limit_exceeded")
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1

    async def drain(self, timeout_s: float) -> None:
        """Lets in-flight calls finish for `timeout_s`, then ends the rest: each is recorded
        `aborted` and its client gets an error in its protocol."""
        self.closing = True
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight:
            log.warning("drain timeout: aborting %d calls still in flight", len(self.calls))
            for call in list(self.calls):
                call.abort("aborted", f"the gateway shut down ({timeout_s:g} s drain timeout)")
            # Each aborted call records itself and writes its error event; give them the time.
            finish_by = time.monotonic() + 30
            while self.in_flight and time.monotonic() < finish_by:
                await asyncio.sleep(0.05)
