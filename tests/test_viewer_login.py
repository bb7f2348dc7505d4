"""Guessing the admin key at the viewer's login form is slow (issue #28): after five wrong keys
from one address the form answers 429 with Retry-After, whatever key comes next, and the admin
key as a header still opens the viewer's data. The engine is the fault stand-in: no call is
made to it."""

from __future__ import annotations

import httpx

from tests.support.frozen_replica import FrozenReplica
from tests.support.gateway import ADMIN_KEY, GatewayProcess


def test_wrong_keys_at_the_login_form_are_throttled(database_url, tmp_path):
    gw = GatewayProcess([FrozenReplica().url], database_url,
                        log_path=tmp_path / "gw.log").start()
    try:
        with httpx.Client(base_url=gw.url, timeout=10) as http:
            for attempt in range(5):
                r = http.post("/ui/login", data={"key": f"guess-{attempt}"})
                assert r.status_code == 401, (attempt, r.status_code)
            r = http.post("/ui/login", data={"key": "guess-5"})
            assert r.status_code == 429 and "Too many wrong keys" in r.text
            assert 1 <= int(r.headers["Retry-After"]) <= 12
            # the right key waits too: the throttle must not tell a guess it was right
            r = http.post("/ui/login", data={"key": ADMIN_KEY}, follow_redirects=False)
            assert r.status_code == 429 and "rolltap_ui" not in r.cookies
        assert gw.admin.get("/ui/api/rollouts").status_code == 200
    finally:
        gw.stop()
