"""Which model calls this gateway takes: each rollout's share (--rollout-max-inflight calls at
once, --rollout-max-rps started a second), the gateway's in-flight limit (--max-inflight),
refusing new calls while it shuts down, and ending the calls still running when the drain time
is up.

A rollout's share is taken at its request head, so bodies it sends slowly count against its
own share only; a slot of the gateway's limit is taken once the body is in, so nobody's slow
bodies hold the slots other rollouts' calls need (issue #28, attack 9)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

from aiohttp import web

from gateway.app_keys import RETRY_AFTER
from gateway.path_protocol import protocol_of
from gateway.protocols.errors import GatewayError
from gateway.ratelimit import TokenBuckets

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

def _busy(request: web.Request, message: str, retry_after: float) -> GatewayError:
    """A refusal a harness backs off from and retries: OpenAI's 429 rate_limit_error,
    Anthropic's 529 overloaded_error, with Retry-After."""
    request[RETRY_AFTER] = str(max(1, math.ceil(retry_after)))
    if protocol_of(request.path) == "anthropic":
        return GatewayError(529, message, "overloaded_error")
    return GatewayError(429, message, "rate_limit_error", code="rate_limit_exceeded")


class Admission:
    def __init__(self, limit: int, rollout_limit: int, rollout_rate: float) -> None:
        self.limit = limit
        self.rollout_limit = rollout_limit
        self.in_flight = 0  # model calls being served (bodies read)
        self.closing = False  # set on SIGTERM: new calls are refused, in-flight ones finish
        # Model calls in flight (each with an `abort`), ended in their protocol's terms when a
        # shutdown's drain time is up.
        self.calls: set[RunningCall] = set()
        self._by_rollout: dict[uuid.UUID, int] = {}  # requests per rollout, from their heads
        self._starts = TokenBuckets(rate=rollout_rate, burst=max(1.0, 2 * rollout_rate),
                                    max_keys=100_000)

    def _refuse_if_closing(self, request: web.Request) -> None:
        if self.closing:
            request[RETRY_AFTER] = _RETRY_AFTER_S
            raise GatewayError(
                503, "this gateway is shutting down; retry (another gateway will take the call)",
                "overloaded_error",
            )

    @contextmanager
    def rollout_share(self, request: web.Request, rollout_id: uuid.UUID) -> Iterator[None]:
        """Holds one of `rollout_id`'s slots while its request is read and served, or refuses
        it: the gateway is closing, or the rollout is past its share."""
        self._refuse_if_closing(request)
        held = self._by_rollout.get(rollout_id, 0)
        if held >= self.rollout_limit:
            raise _busy(request, f"this rollout has {held} calls in flight, its share "
                        f"(--rollout-max-inflight); retry after {_RETRY_AFTER_S} s", 1)
        now = time.monotonic()
        wait = self._starts.wait(rollout_id, now)
        if wait > 0:
            raise _busy(request, f"this rollout starts calls faster than its share of "
                        f"{self._starts.rate:g} a second (--rollout-max-rps); retry after "
                        f"{wait:.1f} s", wait)
        self._starts.spend(rollout_id, now)
        self._by_rollout[rollout_id] = held + 1
        try:
            yield
        finally:
            left = self._by_rollout[rollout_id] - 1
            if left:
                self._by_rollout[rollout_id] = left
            else:
                del self._by_rollout[rollout_id]

    @contextmanager
    def gateway_slot(self, request: web.Request) -> Iterator[None]:
        """Holds one of the gateway's --max-inflight slots while a call (its body read) is
        served, or refuses it."""
        self._refuse_if_closing(request)
        if self.in_flight >= self.limit:
            raise _busy(request, f"this gateway is serving its limit of {self.limit} calls at "
                        f"once (--max-inflight); retry after {_RETRY_AFTER_S} s", 1)
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    async def abort_rollout(self, rollout_id: uuid.UUID, reason: str, timeout_s: float) -> int:
        """Ends `rollout_id`'s calls in flight (each recorded `aborted`, its engine request
        cancelled) and waits up to `timeout_s` for them to be recorded, so the rollout can
        end after them; returns how many were ended."""
        mine = [c for c in self.calls if c.rollout_id == rollout_id]
        for call in mine:
            call.abort("aborted", f"its rollout was aborted: {reason}")
        deadline = time.monotonic() + timeout_s
        while any(c in self.calls for c in mine) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return len(mine)

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
