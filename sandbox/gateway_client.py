"""The runner's HTTP client for the gateway's admin API (the only way `sandbox` talks to it).

Transient failures (connection errors, 5xx) are retried with backoff; 4xx are not, they mean
the request itself is wrong.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal, TypeVar
from urllib.parse import urlencode

import aiohttp
import msgspec

RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0)

GatewayStatus = Literal["finished", "failed", "timeout"]


class RolloutAccess(msgspec.Struct, frozen=True):
    """What the harness gets from the gateway: its rollout's key and the base URLs. Never the
    admin key."""

    rollout_id: str
    api_key: str
    openai_base_url: str
    anthropic_base_url: str


class GatewayError(RuntimeError):
    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class CallInfo(msgspec.Struct, frozen=True):
    seq: int
    status: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None


class RolloutInfo(msgspec.Struct, frozen=True):
    rollout_id: str
    status: str
    task_id: str | None = None
    group_id: str | None = None
    reward: float | None = None
    calls: list[CallInfo] = []
    # Read for display only, so any shape is accepted.
    metadata: Any = None
    merge: Any = None  # {"stats": {...}, "options": {...}} once merged
    stats: Any = None

    @property
    def merge_stats(self) -> dict[str, Any] | None:
        nested = self.merge.get("stats") if isinstance(self.merge, dict) else None
        if isinstance(nested, dict):
            return nested
        return self.stats if isinstance(self.stats, dict) else None


class FinishReply(msgspec.Struct, frozen=True):
    rollout_id: str
    status: str
    reward: float | None = None
    merge: Any = None


class Backlog(msgspec.Struct, frozen=True):
    run_id: str
    running: int
    waiting: int  # ended, not yet taken by a trainer bridge


class Policy(msgspec.Struct, frozen=True):
    version: int


Method = Literal["GET", "POST"]
T = TypeVar("T")


class AdminClient:
    """`async with AdminClient(url, key) as admin: ...`"""

    def __init__(self, base_url: str, admin_key: str, *, timeout_s: float = 60.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {admin_key}"}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> AdminClient:
        self._session = aiohttp.ClientSession(headers=self._headers, timeout=self._timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def _request(self, method: Method, path: str, body: Any = None) -> bytes:
        assert self._session is not None, "use AdminClient as an async context manager"
        url = f"{self.base_url}{path}"
        data = msgspec.json.encode(body) if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else None
        last: Exception | None = None
        for delay in (*RETRY_DELAYS_S, None):
            try:
                async with self._session.request(method, url, data=data, headers=headers) as r:
                    payload = await r.read()
                    if r.status < 400:
                        return payload
                    text = payload[:500].decode(errors="replace")
                    error = GatewayError(f"{method} {path}: HTTP {r.status}: {text}", r.status)
                    if r.status < 500:
                        raise error
                    last = error
            except (TimeoutError, aiohttp.ClientConnectionError) as exc:
                last = GatewayError(f"{method} {path}: {exc!r}")
            if delay is None:
                break
            await asyncio.sleep(delay)
        assert last is not None
        raise last

    async def _call(self, method: Method, path: str, body: Any, reply: type[T]) -> T:
        payload = await self._request(method, path, body)
        try:
            return msgspec.json.decode(payload, type=reply)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise GatewayError(f"{method} {path}: unexpected reply: {exc}") from None

    async def create_rollout(
        self,
        *,
        task_id: str,
        group_id: str,
        metadata: dict[str, Any],
        timeout_s: float,
        side_calls: str = "auto",
    ) -> RolloutAccess:
        body = {"task_id": task_id, "group_id": group_id, "metadata": metadata,
                "timeout_s": timeout_s, "side_calls": side_calls}
        return await self._call("POST", "/admin/rollouts", body, RolloutAccess)

    async def finish_rollout(
        self,
        rollout_id: str,
        *,
        reward: float | None,
        status: GatewayStatus,
        metrics: dict[str, Any],
    ) -> FinishReply:
        body = {"reward": reward, "status": status, "metrics": metrics}
        path = f"/admin/rollouts/{rollout_id}/finish"
        return await self._call("POST", path, body, FinishReply)

    async def abort_rollout(self, rollout_id: str, why: str) -> FinishReply:
        """Finishes a rollout as `aborted` (never trained, `why` in its ledger); the gateway
        first ends its calls in flight."""
        body = {"reward": None, "status": "aborted", "metrics": {"aborted": why}}
        return await self._call("POST", f"/admin/rollouts/{rollout_id}/finish", body, FinishReply)

    async def policy_version(self) -> int:
        """The policy version the gateway stamps on new tokens (the trainer's pushes)."""
        return (await self._call("GET", "/admin/policy", None, Policy)).version

    async def backlog(self, run_id: str) -> Backlog:
        path = f"/admin/backlog?{urlencode({'run_id': run_id})}"
        return await self._call("GET", path, None, Backlog)

    async def get_rollout(self, rollout_id: str) -> RolloutInfo:
        return await self._call("GET", f"/admin/rollouts/{rollout_id}", None, RolloutInfo)
