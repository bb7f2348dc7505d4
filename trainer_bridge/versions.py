"""The new policy version to the gateways, and the pause of the replicas leased from them.

- `PolicyAnnouncer` sets the version in Postgres (every gateway on it hears the NOTIFY) and on
  each listed gateway (`POST /admin/policy`).
- `VersionedTransfer` wraps a weight sync (trainer_bridge/weights.py) and tells every gateway the
  new version while the engines are still paused, so no token sampled by the new weights is
  stamped with the old version. With a `PauseLease` it leases the pause from every gateway for
  the length of the push, so an engine whose bridge dies mid-push is resumed by the gateways
  within the lease.

Versions: TRL counts pushes from 1; the gateways get `offset` + that count, where `offset` is the
highest version any gateway had when the run began, so versions only ever grow across runs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor

import asyncpg
import httpx
import torch

from core.store import rollouts as rollouts_store
from trainer_bridge.faults import crash_point
from trainer_bridge.replies import attempt, ok

log = logging.getLogger(__name__)


class PolicyAnnouncer:
    """Sets the policy version: in Postgres (with `database_url`), whose NOTIFY reaches every
    gateway on that database, and on each listed gateway (`POST /admin/policy`), which has it
    before this returns."""

    def __init__(
        self,
        gateways: Iterable[str],
        admin_key: str,
        offset: int,
        timeout: float = 60,
        policies: dict[str, dict] | None = None,
        database_url: str | None = None,
    ):
        self.gateways = [g.rstrip("/") for g in gateways]
        self.offset = offset
        self.policies = policies or {}  # each gateway's GET /admin/policy at the start
        self.database_url = database_url
        self.announced: list[int] = []  # gateway versions, in order
        self._http = httpx.Client(
            timeout=timeout, headers={"Authorization": f"Bearer {admin_key}"}
        )

    @classmethod
    def from_gateways(cls, gateways: Iterable[str], admin_key: str) -> PolicyAnnouncer:
        """An announcer whose offset is the highest version the gateways hold now."""
        gateways = [g.rstrip("/") for g in gateways]
        with httpx.Client(timeout=30, headers={"Authorization": f"Bearer {admin_key}"}) as http:
            policies = {g: ok(http.get(f"{g}/admin/policy")).json() for g in gateways}
        offset = max(p["version"] for p in policies.values())
        return cls(gateways, admin_key, offset, policies=policies)

    def use_database(self, database_url: str) -> None:
        """Announce through Postgres too (every gateway on it hears the NOTIFY); the offset
        rises to the version stored there if that is higher."""
        self.database_url = database_url
        self.offset = max(self.offset, _in_database(database_url, rollouts_store.policy_version))

    def announce(self, trainer_version: int) -> int:
        """Stamp new tokens with the gateway version of `trainer_version`; returns it."""
        version = self.offset + trainer_version
        if self.database_url:
            _in_database(self.database_url, rollouts_store.set_policy_version, version)
        for gateway in self.gateways:
            ok(self._http.post(f"{gateway}/admin/policy", json={"version": version}))
        self.announced.append(version)
        return version


def gateway_upstreams(gateways: Iterable[str], admin_key: str,
                      timeout: float = 30) -> dict[str, list[str]]:
    """The vLLM replicas each gateway routes to, as its `GET /admin/upstreams` names them."""
    with httpx.Client(timeout=timeout, headers={"Authorization": f"Bearer {admin_key}"}) as http:
        return {g: [u["url"] for u in ok(http.get(f"{g.rstrip('/')}/admin/upstreams"))
                    .json()["upstreams"]]
                for g in gateways}


def unsynced_upstreams(
    upstreams: Mapping[str, Iterable[str]], vllm_urls: Iterable[str]
) -> list[tuple[str, str]]:
    """(gateway, replica) pairs where the gateway routes to a replica the bridge does not push
    weights to: that replica keeps its weights while the gateway stamps new versions on what it
    samples. URLs are compared as written, up to a trailing slash, so one replica reached under
    two names is reported too."""
    synced = {url.rstrip("/") for url in vllm_urls}
    return [(gateway, url) for gateway, urls in upstreams.items() for url in urls
            if url.rstrip("/") not in synced]


class PauseLease:
    """A bridge's lease, on every gateway, of the pause of its replicas: taken before a push
    pauses them, renewed every third of `seconds` while it lasts, ended after they resume. A
    bridge that dies stops renewing, and the gateways resume its replicas when it runs out.
    A gateway that cannot be reached is logged, not fatal: the push goes on unleased."""

    def __init__(self, gateways: Iterable[str], admin_key: str, replicas: Iterable[str],
                 seconds: float) -> None:
        self.gateways = [g.rstrip("/") for g in gateways]
        self.replicas = [r.rstrip("/") for r in replicas]
        self.seconds = seconds
        self._http = httpx.Client(timeout=max(seconds / 3, 1.0),
                                  headers={"Authorization": f"Bearer {admin_key}"})
        self._stopped = threading.Event()
        self._renewer: threading.Thread | None = None

    def _post(self, seconds: float) -> None:
        for gateway in self.gateways:
            for url in self.replicas:
                body = {"url": url, "seconds": seconds}
                if error := attempt(lambda g, body=body: self._http.post(
                        f"{g}/admin/upstreams/pause-lease", json=body), gateway):
                    log.warning("weight sync: pause lease of %s on %s: %s", url, gateway, error)

    def _renew(self) -> None:
        while not self._stopped.wait(self.seconds / 3):
            self._post(self.seconds)

    def take(self) -> None:
        if self._renewer is not None:
            return
        self._post(self.seconds)
        self._stopped.clear()
        self._renewer = threading.Thread(target=self._renew, name="rolltap-pause-lease",
                                         daemon=True)
        self._renewer.start()

    def give_back(self) -> None:
        if self._renewer is None:
            return
        self._stopped.set()
        self._renewer.join()
        self._renewer = None
        self._post(0)

    def close(self) -> None:
        self.give_back()
        self._http.close()


class VersionedTransfer:
    """A weight transfer that announces each pushed version before the engines resume, holding
    a `PauseLease` (if given) from the pause to the resume."""

    def __init__(self, inner, announcer: PolicyAnnouncer, lease: PauseLease | None = None) -> None:
        self.inner = inner
        self.announcer = announcer
        self.lease = lease
        self.pushes = 0  # TRL's model_version after the push in flight

    def init_weight_transfer(self) -> None:
        self.inner.init_weight_transfer()

    def pause(self) -> None:
        if self.lease:
            self.lease.take()
        self.inner.pause()

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        try:
            self.inner.send_weights(iterator)
        except BaseException:
            # The inner sync resumed the engines on its way out.
            if self.lease:
                self.lease.give_back()
            raise
        # TRL bumps its version exactly once per send, right after `resume`.
        self.pushes += 1

    def resume(self) -> None:
        try:
            self.announcer.announce(self.pushes)
            crash_point("after_announce")
        finally:
            # A gateway that cannot be told fails the run, but the engines must not stay
            # frozen for the harnesses still talking to them.
            try:
                self.inner.resume()
            finally:
                if self.lease:
                    self.lease.give_back()

    def destroy(self) -> None:
        try:
            self.inner.destroy()
        finally:
            if self.lease:
                self.lease.close()


def _in_database(dsn: str, query, *args):
    """Runs one store query on its own connection, from synchronous trainer code (in a thread:
    the caller may itself be inside an event loop)."""

    async def run():
        conn = await asyncpg.connect(dsn)
        try:
            return await query(conn, *args)
        finally:
            await conn.close()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, run()).result()
