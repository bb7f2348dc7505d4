"""The policy version live in the run, as the bridge announces it (a Postgres notification,
read again on every reconnect): every sampled token is stamped with it (invariant 4)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from core.store import rollouts as rollouts_store

if TYPE_CHECKING:
    from core.store.conn import Conn

log = logging.getLogger(__name__)


class PolicyVersion:
    def __init__(self) -> None:
        self.value = 0

    def notified(self, payload: str) -> None:
        self._set(int(payload))

    async def read(self, conn: Conn) -> None:
        self._set(await rollouts_store.policy_version(conn))

    def _set(self, version: int) -> None:
        if version != self.value:
            log.info("policy version %d -> %d", self.value, version)
        self.value = version
