"""Two real vLLM replicas behind one gateway: a killed replica's streams fail cleanly, its
rollouts move to the live one (recorded rerouted), it comes back, and a frozen one is detected.

The second replica is started by this module only (about a minute), and killed and restarted
once; the session's replica is never disturbed."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

from stack.serve_model import start_vllm
from tests.support.gateway import GatewayProcess, free_port
from tests.support.streams import OpenStream, long_stream_body
from tests.support.vllm import (
    TINY_MAX_MODEL_LEN,
    TINY_MODEL_NAME,
    VLLM_READY_TIMEOUT_S,
    wait_engine_idle,
)


def _start_replica(model_dir, port: int, log_path):
    # On the last core: vLLM's CPU build pins a server's engine to the first core, where the
    # first replica's already is, and one replica's long streams then starved the other's (a
    # survivor stream sent nothing for 30 s, in a full run).
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", str((os.cpu_count() or 1) - 1))
        vllm = start_vllm(model_dir, port, served_model_name=TINY_MODEL_NAME,
                          max_model_len=TINY_MAX_MODEL_LEN, kv_cache_gib=1, device="auto",
                          log_path=log_path)
    vllm.wait_ready(VLLM_READY_TIMEOUT_S)
    return vllm


@pytest.fixture(scope="module")
def second_replica(tiny_model_dir, tmp_path_factory):
    port = free_port()
    logs = tmp_path_factory.mktemp("replica2")
    state = {"vllm": _start_replica(tiny_model_dir, port, logs / "vllm.log"), "port": port,
             "logs": logs}
    yield state
    state["vllm"].stop()


def _gateway(urls, database_url, tmp_path, *extra) -> GatewayProcess:
    return GatewayProcess(urls, database_url, "--probe-interval", "0.5", "--eject-after", "2",
                          *extra, log_path=tmp_path / "gw.log").start(timeout=180)


def _short_call(rollout: dict, model: str, stream: bool = False):
    client = openai.OpenAI(base_url=rollout["openai_base_url"], api_key=rollout["api_key"],
                           max_retries=0, timeout=120)
    out = client.chat.completions.create(
        model=model, max_tokens=4, stream=stream,
        messages=[{"role": "user", "content": "hi"}])
    if stream:
        list(out)


def _state(gw: GatewayProcess, url: str) -> str:
    listing = gw.admin.get("/admin/upstreams").json()["upstreams"]
    return next(u["state"] for u in listing if u["url"] == url)


def _wait_state(gw: GatewayProcess, url: str, state: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _state(gw, url) != state:
        assert time.monotonic() < deadline, f"{url} never became {state}"
        time.sleep(0.2)


def test_killed_replica_fails_its_streams_moves_its_rollouts_and_comes_back(
    vllm_server, second_replica, database_url, tmp_path
):
    survivor, victim = vllm_server.url, second_replica["vllm"].url
    gw = _gateway([survivor, victim], database_url, tmp_path)
    try:
        rollouts = [gw.new_rollout(task_id=f"kill-{i}") for i in range(16)]
        for r in rollouts:  # place each rollout with one call
            _short_call(r, vllm_server.model)
        home = {r["rollout_id"]: gw.calls(r["rollout_id"])[0]["upstream"] for r in rollouts}
        on_victim = [r for r in rollouts if home[r["rollout_id"]] == victim]
        assert on_victim and len(on_victim) < 16, home  # rendezvous spread them over both

        # The victim's streams cannot finish before the kill; the survivor's end on their own.
        streams = {r["rollout_id"]: OpenStream(
            r["openai_base_url"], r["api_key"],
            long_stream_body(vllm_server.model, 20000 if r in on_victim else 1000))
            for r in rollouts}
        for s in streams.values():
            s.wait_started(180)
        second_replica["vllm"].send_signal(signal.SIGKILL)
        second_replica["vllm"].process.wait(30)
        for s in streams.values():
            s.join(300)

        # Judged by where each stream really ran: under load a probe can eject a replica and
        # move a rollout before its stream opens, either way (a short stream moved to the
        # victim may end before the kill).
        killed = []
        for r in rollouts:
            s = streams[r["rollout_id"]]
            last = gw.calls(r["rollout_id"])[-1]
            if last["upstream"] == victim and not (s.done and s.error is None):
                # Open at the kill: the harness gets a protocol error event, the call is failed.
                killed.append(r)
                assert s.error is not None and not s.done, (s.error, s.done)
                assert last["status"] == "failed" and last["error"]
            else:  # ended whole: the engine said how (a cut stream has no finish reason)
                assert s.done and s.error is None, (s.error, s.exception, last)
                assert last["status"] == "ok" and last["finish_reason"] in ("length", "stop")
        assert killed, "no stream was open on the killed replica"

        # The dead replica's rollouts go on at once on the live one, recorded as rerouted.
        for r in killed:
            _short_call(r, vllm_server.model, stream=True)
            last = gw.calls(r["rollout_id"])[-1]
            assert last["status"] == "ok" and last["upstream"] == survivor
            assert last["rerouted"] and victim in last["rerouted"], last["rerouted"]
        _wait_state(gw, victim, "ejected", 30)

        # Back on the same address: probes take it back, and new rollouts reach it again.
        second_replica["vllm"] = _start_replica(
            vllm_server.model_dir, second_replica["port"], second_replica["logs"] / "vllm2.log")
        _wait_state(gw, victim, "healthy", 30)
        fresh = [gw.new_rollout(task_id=f"back-{i}") for i in range(12)]
        for r in fresh:
            _short_call(r, vllm_server.model)
        assert any(gw.calls(r["rollout_id"])[0]["upstream"] == victim for r in fresh)
        # ...while the moved rollouts stay where their prefix cache now is.
        for r in killed:
            _short_call(r, vllm_server.model)
            last = gw.calls(r["rollout_id"])[-1]
            assert last["upstream"] == survivor and last["rerouted"] is None
    finally:
        gw.stop()
        if second_replica["vllm"].process.poll() is not None:
            # Failed before it brought the replica back: the module's other tests need it.
            second_replica["vllm"] = _start_replica(
                vllm_server.model_dir, second_replica["port"],
                second_replica["logs"] / "vllm-restarted.log")


def test_frozen_replica_ends_the_stream_with_an_error_and_counts_a_failure(
    vllm_server, second_replica, database_url, tmp_path
):
    victim = second_replica["vllm"]
    # Only the replica to freeze, so the stream surely runs there; a long eject threshold so
    # the probes of the stopped engine do not end the call first.
    gw = _gateway([victim.url], database_url, tmp_path, "--stream-idle-timeout", "2",
                  "--eject-after", "100")
    try:
        r = gw.new_rollout(task_id="frozen")
        s = OpenStream(r["openai_base_url"], r["api_key"], long_stream_body(vllm_server.model))
        s.wait_started(180)
        victim.send_signal(signal.SIGSTOP)
        try:
            s.join(60)
            assert s.error is not None and "no next chunk for 2s" in s.error["message"]
            [call] = gw.calls(r["rollout_id"])
            assert call["status"] == "failed" and "frozen" in call["error"]
            listing = gw.admin.get("/admin/upstreams").json()["upstreams"]
            assert listing[0]["consecutive_failures"] >= 1
        finally:
            victim.send_signal(signal.SIGCONT)
    finally:
        gw.stop()


def test_draining_and_removing_replicas_at_run_time(vllm_server, second_replica,
                                                   database_url, tmp_path):
    a, b = vllm_server.url, second_replica["vllm"].url
    gw = _gateway([a], database_url, tmp_path)
    try:
        assert gw.admin.post("/admin/upstreams", json={"url": b}).status_code == 200
        rollouts = [gw.new_rollout(task_id=f"drain-{i}") for i in range(12)]
        for r in rollouts:
            _short_call(r, vllm_server.model)
        on_b = [r for r in rollouts if gw.calls(r["rollout_id"])[0]["upstream"] == b]
        assert on_b, "the added replica takes new rollouts"

        r = gw.admin.post("/admin/upstreams", json={"url": b, "draining": True})
        assert {u["url"]: u["state"] for u in r.json()["upstreams"]}[b] == "draining"
        for r in on_b:
            _short_call(r, vllm_server.model)
            last = gw.calls(r["rollout_id"])[-1]
            assert last["upstream"] == a and "draining" in last["rerouted"]
        fresh = gw.new_rollout()
        _short_call(fresh, vllm_server.model)
        assert gw.calls(fresh["rollout_id"])[0]["upstream"] == a

        # A replica that never answers is ejected by the probes and gets no calls.
        dead = f"http://127.0.0.1:{free_port()}"
        gw.admin.post("/admin/upstreams", json={"url": dead})
        _wait_state(gw, dead, "ejected", 30)

        assert gw.admin.delete("/admin/upstreams", params={"url": b}).status_code == 200
        assert b not in [u["url"] for u in gw.admin.get("/admin/upstreams").json()["upstreams"]]
        bad = gw.admin.post("/admin/upstreams", json={"url": "not a url"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "url"
        assert gw.admin.delete("/admin/upstreams", params={"url": b}).status_code == 404
        # The admin key only: a rollout key is refused.
        refused = httpx.get(gw.url + "/admin/upstreams",
                            headers={"Authorization": f"Bearer {fresh['api_key']}"})
        assert refused.status_code == 403
    finally:
        gw.stop()


def _paused_since(gw: GatewayProcess, url: str):
    listing = gw.admin.get("/admin/upstreams").json()["upstreams"]
    return next(u["paused_since"] for u in listing if u["url"] == url)


def test_a_paused_replica_whose_lease_runs_out_is_resumed_and_an_unleased_pause_is_not(
    second_replica, database_url, tmp_path
):
    url = second_replica["vllm"].url
    gw = _gateway([url], database_url, tmp_path)
    try:
        lease = {"url": url, "seconds": 2}
        assert gw.admin.post("/admin/upstreams/pause-lease", json=lease).status_code == 200
        httpx.post(f"{url}/pause", params={"mode": "keep"}, timeout=30).raise_for_status()
        started = time.monotonic()
        # Frozen until the gateway resumes it: the bridge that paused it stopped renewing.
        _short_call(gw.new_rollout(), TINY_MODEL_NAME)
        assert 1.5 < time.monotonic() - started < 10
        assert not httpx.get(f"{url}/is_paused", timeout=30).json()["is_paused"]

        # A pause nobody leased (an operator's) stays, and is reported with its start.
        httpx.post(f"{url}/pause", params={"mode": "keep"}, timeout=30).raise_for_status()
        deadline = time.monotonic() + 10
        while _paused_since(gw, url) is None:
            assert time.monotonic() < deadline, "the gateway never saw the pause"
            time.sleep(0.2)
        time.sleep(2)  # four probes
        assert httpx.get(f"{url}/is_paused", timeout=30).json()["is_paused"]
        since = _paused_since(gw, url)
        assert time.time() - 15 < since < time.time()
        assert gw.admin.get("/healthz").json()["paused"] == {url: since}
        [gauge] = [line.split()[-1] for line in gw.admin.get("/metrics").text.splitlines()
                   if line.startswith(f'rolltap_replica_paused_since_seconds{{replica="{url}"}}')]
        assert float(gauge) == pytest.approx(since)

        for body, status in (({"url": url, "seconds": -1}, 400),
                             ({"url": "http://127.0.0.1:9", "seconds": 5}, 404)):
            r = gw.admin.post("/admin/upstreams/pause-lease", json=body)
            assert r.status_code == status, r.text
    finally:
        httpx.post(f"{url}/resume", timeout=30)
        gw.stop()


def test_one_rollouts_long_calls_do_not_eject_the_replica_others_use(
    vllm_server, database_url, tmp_path
):
    """Issue #28, attack 10: whole-response calls that run past --upstream-timeout are the
    rollout's long generations, not a replica fault. Before, three of them ejected the shared
    replica and every other rollout's call on it ended 503."""
    # No probe in between to take a failure count back (the last flag wins).
    gw = _gateway([vllm_server.url], database_url, tmp_path, "--upstream-timeout", "3",
                  "--probe-interval", "60")
    try:
        hog, other = gw.new_rollout(), gw.new_rollout()
        body = {**long_stream_body(vllm_server.model, max_tokens=4000), "stream": False}
        for _ in range(3):
            r = httpx.post(hog["openai_base_url"] + "/chat/completions", json=body, timeout=60,
                           headers={"Authorization": f"Bearer {hog['api_key']}"})
            assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"], r.text
        assert _state(gw, vllm_server.url) == "healthy"
        wait_engine_idle(vllm_server.url, 60)  # the hog's requests were aborted; the engine is free
        _short_call(other, vllm_server.model)
        assert [c["status"] for c in gw.calls(other["rollout_id"])] == ["ok"]
    finally:
        gw.stop()
