"""The vLLM replicas: one shared connection pool, placement, health, SSE reading.

Placement is sticky: a rollout's calls stay on the replica of its last call (its prompt prefix
is cached there) unless that replica is ejected, draining or removed; then the next call goes
to the best live replica by rendezvous hashing and is recorded as rerouted, with the reason.

Paused engines: a trainer bridge pauses replicas to load new weights, and one that dies mid-push
would leave them paused, every call on them frozen. So a bridge leases the pause from the
gateway (`lease_pause`, renewed while it pushes), and the prober resumes a paused replica whose
lease ran out. A pause nobody leased (an operator's) is left alone; both are reported
(`paused_since`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from uuid import UUID

import aiohttp
import numpy as np

from gateway.engine_client import EngineClient, EngineResponse
from gateway.protocols.errors import GatewayError
from gateway.routing import Health, place, replica_seed

log = logging.getLogger(__name__)

_PLACEMENTS_KEPT = 200_000  # rollouts whose replica is remembered in memory
# An idle connection is given up before the engine's own idle timeout (vLLM's
# VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s) could close it under a request being sent.
_KEEPALIVE_S = 4.0


class Replica:
    __slots__ = ("url", "seed", "draining", "health", "in_flight", "_aborts", "paused_since",
                 "pause_lease_until")

    def __init__(self, url: str, eject_after: int) -> None:
        self.url = url
        self.seed = replica_seed(url)
        self.draining = False
        self.health = Health(eject_after=eject_after)
        self.in_flight = 0
        # Calls waiting for a whole (non-streamed) response: a frozen engine never answers
        # them, so ejecting the replica ends them (streams have their own idle timeout).
        self._aborts: set[Callable[[str], None]] = set()
        self.paused_since: float | None = None  # wall clock, when a probe first saw it paused
        self.pause_lease_until: float | None = None  # monotonic; None: no bridge holds one

    @property
    def available(self) -> bool:
        return not self.draining and not self.health.ejected

    def unavailable_reason(self) -> str:
        if self.draining:
            return f"replica {self.url} is draining"
        return f"replica {self.url} is ejected ({self.health.reason})"

    def describe(self) -> dict:
        h = self.health
        return {
            "url": self.url,
            "state": "draining" if self.draining else "ejected" if h.ejected else "healthy",
            "in_flight": self.in_flight,
            "consecutive_failures": h.failures,
            "last_failure": h.reason,
            # how long it has been ejected or back (None: never ejected)
            "state_for_s": round(time.monotonic() - h.since, 1) if h.since else None,
            "paused_since": self.paused_since,
            "pause_lease_s": None if self.pause_lease_until is None
            else round(max(self.pause_lease_until - time.monotonic(), 0.0), 1),
        }


def pause_expired(paused: bool, lease_until: float | None, now: float) -> bool:
    """A paused replica is to be resumed: the bridge that leased its pause stopped renewing."""
    return paused and lease_until is not None and now >= lease_until


class Upstreams:
    def __init__(
        self,
        urls: list[str],
        timeout_s: float,
        *,
        eject_after: int = 3,
        probe_interval_s: float = 2.0,
        probe_timeout_s: float = 5.0,
        replica_max_inflight: int | None = None,
    ) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=10)
        self._engine = EngineClient(timeout_s, connect_timeout_s=10, keepalive_s=_KEEPALIVE_S)
        self._eject_after = eject_after
        self._probe_interval_s = probe_interval_s
        self._probe_timeout_s = probe_timeout_s
        self._max_inflight = replica_max_inflight
        self.replicas: dict[str, Replica] = {}
        self._placed: dict[UUID, str] = {}
        self._list: list[Replica] = []
        self._live: list[Replica] = []  # available: not ejected, not draining
        self._live_seeds = np.zeros(0, dtype=np.uint64)
        self.session: aiohttp.ClientSession | None = None
        self._prober: asyncio.Task | None = None
        # replica -> its last probe's result; `/healthz` reads it instead of probing
        self.last_health: dict[str, str] = {}
        self.on_change: Callable[[Replica], None] | None = None  # metrics hook
        for url in urls:
            self.add(url)

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self._list]

    async def open(self) -> None:
        # One pool for all requests; no per-host cap: concurrency is bounded by the harnesses.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=_KEEPALIVE_S),
            timeout=self._timeout,
            auto_decompress=True,
        )
        self._prober = asyncio.create_task(self._probe_forever(), name="rolltap-probe")

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
        if self.session is not None:
            await self.session.close()
        self._engine.close()

    # -- the replica set ---------------------------------------------------------------------

    def add(self, url: str) -> Replica:
        """Adds a replica (or takes a draining one back into service)."""
        url = url.rstrip("/")
        replica = self.replicas.get(url)
        if replica is None:
            replica = self.replicas[url] = Replica(url, self._eject_after)
        replica.draining = False
        self._changed(replica)
        return replica

    def drain(self, url: str) -> Replica | None:
        """No new calls for `url`; its in-flight calls finish."""
        replica = self.replicas.get(url.rstrip("/"))
        if replica is not None:
            replica.draining = True
            self._changed(replica)
        return replica

    def remove(self, url: str) -> Replica | None:
        """Forgets `url`; calls already streaming from it finish on their open connections."""
        replica = self.replicas.pop(url.rstrip("/"), None)
        if replica is not None:
            replica.draining = True
            self._changed(replica)
        return replica

    def _changed(self, replica: Replica) -> None:
        # Placement reads these on every new rollout; they change only with the replica set.
        self._list = list(self.replicas.values())
        self._live = [r for r in self._list if r.available]
        self._live_seeds = np.array([r.seed for r in self._live], dtype=np.uint64)
        if self.on_change is not None:
            self.on_change(replica)

    # -- placement ---------------------------------------------------------------------------

    def placed(self, rollout_id: UUID) -> str | None:
        return self._placed.get(rollout_id)

    def route(
        self, rollout_id: UUID, previous: str | None, avoid: str | None = None
    ) -> tuple[str, str | None]:
        """(replica for the next call of `rollout_id`, why it moved or None). `previous` is
        where its last call went (None for a new rollout); `avoid` a replica that just failed."""
        reason = None
        if previous is not None:
            replica = self.replicas.get(previous)
            usable = replica is not None and (
                replica.available or (not self._live and not replica.draining)
            )
            if usable and previous != avoid:
                self._placed[rollout_id] = previous
                return previous, None
            if replica is None:
                reason = f"replica {previous} was removed"
            elif previous == avoid:
                reason = f"replica {previous} failed: {replica.health.reason}"
            else:
                reason = replica.unavailable_reason()
        url = self._place_new(rollout_id, avoid)
        if len(self._placed) > _PLACEMENTS_KEPT:
            self._placed.clear()  # re-read from the calls table on the next call of each
        self._placed[rollout_id] = url
        return url, reason

    def _place_new(self, rollout_id: UUID, avoid: str | None) -> str:
        live, seeds, eligible = self._live, self._live_seeds, None
        if not live:
            # Every replica ejected: health checks may be wrong (an overloaded engine answers
            # /health late), and trying beats refusing every call.
            live = [r for r in self._list if not r.draining]
            seeds = np.array([r.seed for r in live], dtype=np.uint64)
        if avoid is not None or self._max_inflight is not None:
            eligible = np.array([r.url != avoid for r in live], dtype=bool)
            if self._max_inflight is not None:
                roomy = eligible & np.array(
                    [r.in_flight < self._max_inflight for r in live], dtype=bool
                )
                if roomy.any():  # all full: the gateway's own --max-inflight pushes back
                    eligible = roomy
        i = place(rollout_id.int, seeds, eligible)
        if i < 0:
            states = ", ".join(f"{r.url} {r.describe()['state']}" for r in self._list) or "none"
            raise GatewayError(
                503,
                f"no healthy upstream replica (replicas: {states}); retry shortly, or add one "
                "with POST /admin/upstreams",
                "overloaded_error",
            )
        return live[i].url

    # -- health ------------------------------------------------------------------------------

    def failed(self, url: str, reason: str, rollout_id: UUID | None = None) -> None:
        """`url` could not connect, got a 5xx, broke or froze: on a call of `rollout_id`, or
        on a probe (None). See `routing.Health` for how each counts."""
        replica = self.replicas.get(url)
        if replica is not None and replica.health.failure(time.monotonic(), reason, rollout_id):
            log.warning("ejecting replica %s: %s", url, reason)
            self._changed(replica)
            for abort in list(replica._aborts):
                abort(f"replica {url} was ejected: {reason}")

    def succeeded(self, url: str) -> None:
        replica = self.replicas.get(url)
        if replica is not None and replica.health.success(time.monotonic()):
            log.warning("replica %s is back", url)
            self._changed(replica)

    async def _probe_forever(self) -> None:
        while True:
            health = await self.health()
            # Only replicas that answer: a frozen one would hold up the next round of probes.
            await self.watch_pauses([url for url, result in health.items() if result == "ok"])
            await asyncio.sleep(self._probe_interval_s)

    def lease_pause(self, url: str, seconds: float) -> Replica | None:
        """A bridge holds `url` paused for `seconds` more (0: it resumed it, the lease ends)."""
        replica = self.replicas.get(url.rstrip("/"))
        if replica is not None:
            replica.pause_lease_until = time.monotonic() + seconds if seconds > 0 else None
        return replica

    async def watch_pauses(self, urls: list[str]) -> None:
        """Note which of `urls` are paused, and resume those whose pause lease ran out."""
        timeout = aiohttp.ClientTimeout(total=self._probe_timeout_s)

        async def one(replica: Replica) -> None:
            try:
                assert self.session is not None
                async with self.session.get(replica.url + "/is_paused", timeout=timeout) as resp:
                    # 404: a vLLM without VLLM_SERVER_DEV_MODE, which cannot be paused either.
                    paused = resp.status == 200 and bool((await resp.json())["is_paused"])
                if not paused:
                    replica.paused_since = None
                    return
                replica.paused_since = replica.paused_since or time.time()
                if pause_expired(paused, replica.pause_lease_until, time.monotonic()):
                    log.warning("replica %s: the bridge that paused it stopped renewing its "
                                "lease (it died mid-push?); resuming it", replica.url)
                    async with self.session.post(replica.url + "/resume", timeout=timeout) as r:
                        if r.status == 200:
                            replica.pause_lease_until = None
                            replica.paused_since = None
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError, KeyError) as exc:
                log.warning("replica %s: pause check failed: %s", replica.url, exc)

        await asyncio.gather(*(one(r) for url in urls if (r := self.replicas.get(url))))

    def probed(self) -> dict[str, str]:
        """Each replica's last probe result, as the prober left it (no probe here)."""
        return {url: self.last_health.get(url, "not probed yet") for url in self.urls}

    async def health(self) -> dict[str, str]:
        """Probes every replica's /health, feeding the result into its health state."""
        timeout = aiohttp.ClientTimeout(total=self._probe_timeout_s)

        async def one(url: str) -> str:
            try:
                assert self.session is not None
                async with self.session.get(url + "/health", timeout=timeout) as resp:
                    result = "ok" if resp.status == 200 else f"health check: HTTP {resp.status}"
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                result = f"health check: {exc or type(exc).__name__}"
            if result == "ok":
                self.succeeded(url)
            else:
                self.failed(url, result)
            return result

        urls = self.urls
        results = await asyncio.gather(*(one(u) for u in urls))
        self.last_health = dict(zip(urls, results))
        return self.last_health

    # -- calls -------------------------------------------------------------------------------

    def begin(self, url: str, abort: Callable[[str], None] | None = None) -> None:
        replica = self.replicas.get(url)
        if replica is not None:
            replica.in_flight += 1
            if abort is not None:
                replica._aborts.add(abort)

    def end(self, url: str, abort: Callable[[str], None] | None = None) -> None:
        replica = self.replicas.get(url)
        if replica is not None:
            replica.in_flight -= 1
            replica._aborts.discard(abort)

    async def post(self, base: str, path: str, body: bytes) -> aiohttp.ClientResponse:
        assert self.session is not None
        try:
            return await self.session.post(
                base + path, data=body, headers={"Content-Type": "application/json"}
            )
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise _unreachable(base, exc) from exc

    async def post_whole(
        self, base: str, path: str, body: bytes
    ) -> aiohttp.ClientResponse | EngineResponse:
        """`post` for a whole (non-streamed) answer: through the lean engine client where it
        can (plain HTTP), aiohttp's otherwise."""
        if not self._engine.handles(base):
            return await self.post(base, path, body)
        try:
            return await self._engine.post(base, path, body)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise _unreachable(base, exc) from exc

    async def get_json(self, base: str, path: str, timeout_s: float = 5.0):
        assert self.session is not None
        async with self.session.get(
            base + path, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            resp.raise_for_status()
            return await resp.json(content_type=None)

    async def served_models(self) -> set[str]:
        names: set[str] = set()
        for replica in self._list:
            if not replica.available:
                continue
            try:
                data = await self.get_json(replica.url, "/v1/models")
            except (TimeoutError, aiohttp.ClientError, OSError):
                continue
            names.update(m["id"] for m in data.get("data", ()))
        return names


def _unreachable(base: str, exc: BaseException) -> GatewayError:
    return GatewayError(
        502, f"upstream {base} unreachable: {exc or type(exc).__name__}", "upstream_error"
    )


class StreamStalled(Exception):
    """The engine sent nothing for longer than the call's first-token or idle timeout."""


class _Watchdog:
    """Fails a response's reads once nothing arrived for `timeout` seconds. One timer per
    stream, moved lazily: a read only stores the time (a per-read asyncio.timeout costs tens
    of µs of scheduling on every chunk)."""

    __slots__ = ("_loop", "_content", "_timeout", "_what", "_deadline", "_handle", "_due")

    def __init__(self, content, timeout: float, what: str) -> None:
        self._loop = asyncio.get_running_loop()
        self._content = content
        self._timeout, self._what = timeout, what
        self._deadline = self._loop.time() + timeout
        self._schedule()

    def _schedule(self) -> None:
        self._due = self._deadline
        self._handle = self._loop.call_at(self._due, self._check)

    def fed(self, timeout: float, what: str) -> None:
        self._timeout, self._what = timeout, what
        self._deadline = self._loop.time() + timeout
        if self._deadline < self._due:  # a shorter timeout now (idle after the first token)
            self._handle.cancel()
            self._schedule()

    def _check(self) -> None:
        if self._loop.time() >= self._deadline:
            self._content.set_exception(StreamStalled(
                f"engine sent no {self._what} for {self._timeout:g}s "
                "(frozen or overloaded replica)"
            ))
        else:
            self._schedule()

    def cancel(self) -> None:
        self._handle.cancel()


async def sse_batches(
    resp: aiohttp.ClientResponse, first_timeout_s: float, idle_timeout_s: float
) -> AsyncGenerator[list[bytes], None]:
    """The `data:` payloads of a server-sent-event stream, grouped by what arrived together,
    so the pipeline answers each network read with one write instead of one per event. Raises
    StreamStalled when the first read takes over `first_timeout_s` or a later one over
    `idle_timeout_s`: a frozen engine keeps its connection open but sends nothing."""
    pending = b""
    content = resp.content
    watchdog = _Watchdog(content, first_timeout_s, "first token")
    try:
        while block := await content.readany():
            watchdog.fed(idle_timeout_s, "next chunk")
            lines = (pending + block).split(b"\n")
            pending = lines.pop()  # an incomplete last line waits for the next read
            batch = [line[5:].strip() for line in lines if line.startswith(b"data:")]
            if batch:
                yield batch
    finally:
        watchdog.cancel()
    if pending.startswith(b"data:"):
        yield [pending[5:].strip()]
