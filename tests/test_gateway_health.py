"""`/healthz` tells a caller without the admin key only up or down, and no request to it makes
the gateway probe an engine (issue #28, attack 12: before, each request probed every replica,
feeding its ejection count, and answered engine URLs, the policy version and recorder figures
to anyone). The replica is the fault stand-in, which counts the probes it gets."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.support.frozen_replica import FrozenReplica
from tests.support.gateway import GatewayProcess


@pytest.fixture
def replica():
    return FrozenReplica()


def _healthy(gw: GatewayProcess, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(gw.url + "/healthz", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, gw.admin.get("/healthz").text
        time.sleep(0.1)


def test_healthz_without_the_admin_key_says_only_up_or_down(replica, database_url, tmp_path):
    gw = GatewayProcess([replica.url], database_url, log_path=tmp_path / "gw.log").start()
    try:
        _healthy(gw)
        for headers in ({}, {"Authorization": "Bearer rt-some-rollout-key"},
                        {"x-api-key": "not-the-admin-key"}):
            r = httpx.get(gw.url + "/healthz", headers=headers, timeout=5)
            assert (r.status_code, r.json()) == (200, {"status": "ok"}), headers
        details = gw.admin.get("/healthz").json()
        assert details["upstreams"] == {replica.url: "ok"}
        assert details["database"] == "ok" and "recorder" in details

        replica.healthy = False
        deadline = time.monotonic() + 30
        while (r := httpx.get(gw.url + "/healthz", timeout=5)).status_code != 503:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.2)
        assert r.json() == {"status": "down"}
        assert gw.admin.get("/healthz").json()["upstreams"][replica.url].startswith(
            "health check: HTTP 503")
    finally:
        gw.stop()


def test_healthz_requests_probe_no_engine(replica, database_url, tmp_path):
    # Probes every 30 s: any probe seen in the window below was made by a request.
    gw = GatewayProcess([replica.url], database_url, "--probe-interval", "30",
                        log_path=tmp_path / "gw.log").start()
    try:
        _healthy(gw)
        before = replica.health_probes
        started = time.monotonic()
        with httpx.Client(base_url=gw.url, timeout=5) as http:
            for _ in range(40):
                assert http.get("/healthz").status_code == 200
        for _ in range(10):
            assert gw.admin.get("/healthz").status_code == 200
        assert time.monotonic() - started < 25, "the window must stay inside one probe interval"
        assert replica.health_probes == before
    finally:
        gw.stop()
