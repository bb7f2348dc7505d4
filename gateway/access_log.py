"""One log line per HTTP call, so an operator sees a run: method, route, status, latency, the
rollout it belonged to and the request id."""

from __future__ import annotations

import logging

from aiohttp.abc import AbstractAccessLogger
from aiohttp.web import BaseRequest, StreamResponse

from gateway.app_keys import ROLLOUT_ID

LOGGER = logging.getLogger("rolltap.access")


def line(request: BaseRequest, response: StreamResponse, seconds: float) -> str:
    # The matched route's template (`/admin/rollouts/{rollout_id}`), not the raw path: query
    # strings stay out of the line; unmatched paths show as they came.
    info = getattr(request, "match_info", None)
    resource = info.route.resource if info is not None else None
    route = resource.canonical if resource is not None else request.path
    rollout = request.get(ROLLOUT_ID) or (info or {}).get("rollout_id") or "-"
    request_id = (
        response.headers.get("X-Request-Id") or request.headers.get("X-Request-Id") or "-"
    )
    return (
        f"{request.method} {route} {response.status} {seconds * 1000:.1f}ms "
        f"rollout={rollout} request_id={request_id}"
    )


class AccessLogger(AbstractAccessLogger):
    @property
    def enabled(self) -> bool:
        """Read once per connection by aiohttp: above INFO no line is formatted, nor the
        request's start time taken."""
        return self.logger.isEnabledFor(logging.INFO)

    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        self.logger.info(line(request, response, time))
