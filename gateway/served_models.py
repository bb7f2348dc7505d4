"""The model names this gateway's replicas serve, refreshed at most every few seconds: an
unknown model fails fast with the list of served ones."""

from __future__ import annotations

import time

from gateway.protocols.errors import GatewayError
from gateway.upstream import Upstreams

_REFRESH_S = 5.0


class ServedModels:
    def __init__(self, upstreams: Upstreams) -> None:
        self._upstreams = upstreams
        self.names: set[str] = set()
        self._checked = 0.0

    async def refresh(self) -> None:
        self.names = await self._upstreams.served_models()
        self._checked = time.monotonic()

    async def check(self, model: str) -> None:
        """Returns if `model` is served (a replica may have come up since the last look)."""
        if model in self.names:
            return
        if time.monotonic() - self._checked > _REFRESH_S:
            self.names = await self._upstreams.served_models() or self.names
            self._checked = time.monotonic()
            if model in self.names:
                return
        served = ", ".join(sorted(self.names)) or "none (no replica answers /v1/models)"
        raise GatewayError(
            404,
            f"model {model!r} is not served here; served: {served}",
            "not_found_error",
            param="model",
            code="model_not_found",
        )
