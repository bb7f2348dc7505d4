"""A Postgres outage under streaming load (issue 11, item 8): on a cluster this test owns, the
database is stopped and started again, then frozen (SIGSTOP) and thawed, while clients stream
calls. During each outage calls fail fast with a protocol-shaped 503 and /healthz says why;
once the database is back the same gateway process recovers on its own, nothing fails after
its first successful commit, and every call the clients saw end is in the database."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import asyncpg
import httpx
import pytest

from tests.support.gateway import GatewayProcess, free_port

CLIENTS = 8
# The gateway runs with 0.5 s timeouts below; the rest is room for a loaded machine (2.3 s was
# seen at load average 19), still far from holding calls until the database is back.
FAIL_FAST_S = 4.0

_INIT = "import sys, pgserver; pgserver.get_server(sys.argv[1], cleanup_mode=None)"


class Cluster:
    """A Postgres cluster of the test's own (pgserver's binaries) on a TCP port, started and
    stopped as a whole and frozen by signals, like a database host that goes away or stalls."""

    def __init__(self, pgdata: Path) -> None:
        self.pgdata = pgdata
        self.port = free_port()
        self.uri = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        # pgserver creates the cluster (as its own system user when run as root, which
        # Postgres refuses to run as); the test then runs it on a fixed port of its own.
        subprocess.run([sys.executable, "-c", _INIT, str(pgdata)], check=True,
                       capture_output=True, timeout=120)
        self.stop()

    def start(self) -> None:
        import pgserver

        pgserver.pg_ctl(
            ["-w", "-l", str(self.pgdata / "log"),
             "-o", f"-p {self.port} -h 127.0.0.1 -c unix_socket_directories=''", "start"],
            pgdata=self.pgdata, user="pgserver" if os.geteuid() == 0 else None, timeout=60)

    def postmaster(self) -> int:
        return int((self.pgdata / "postmaster.pid").read_text().split("\n", 1)[0])

    def processes(self) -> list[int]:
        """The postmaster and its children (backends, checkpointer, WAL writer...)."""
        root = self.postmaster()
        pids = [root]
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    stat = (entry / "stat").read_text()
                    if int(stat.rsplit(")", 1)[1].split()[1]) == root:
                        pids.append(int(entry.name))
        return pids

    def stop(self) -> None:
        pid = self.postmaster()
        os.kill(pid, signal.SIGINT)  # fast shutdown: backends are told to exit
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)
        raise AssertionError("test cluster did not stop")

    def signal_all(self, sig: int) -> None:
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path / "pg")
    c.start()
    yield c
    with contextlib.suppress(Exception):
        c.signal_all(signal.SIGCONT)
    with contextlib.suppress(Exception):
        c.stop()


class Load:
    """CLIENTS threads, each streaming short chat calls of its own rollout, one after another;
    every call's (start, end, outcome) is kept."""

    def __init__(self, gw: GatewayProcess, model: str) -> None:
        self.gw = gw
        self.model = model
        self.results: list[tuple[float, float, str, int, bytes]] = []
        self.rollouts = [gw.new_rollout(task_id=f"outage-{i}") for i in range(CLIENTS)]
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(r,), daemon=True)
                         for r in self.rollouts]

    def _client(self, rollout: dict) -> None:
        body = {"model": self.model, "stream": True, "max_tokens": 8,
                "messages": [{"role": "user", "content": "outage"}]}
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    r = client.post(rollout["openai_base_url"] + "/chat/completions", json=body,
                                    headers={"Authorization": f"Bearer {rollout['api_key']}"})
                    outcome = "ok" if r.status_code == 200 and b"data: [DONE]" in r.content \
                        else "error"
                    status, content = r.status_code, r.content
                except httpx.HTTPError as exc:
                    outcome, status, content = "transport", 0, repr(exc).encode()
                self.results.append((started, time.monotonic(), outcome, status, content))
                if outcome != "ok":
                    time.sleep(0.05)

    def wait_for_ok_after(self, moment: float, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(r[2] == "ok" and r[0] >= moment for r in list(self.results)):
                return
            time.sleep(0.1)
        raise AssertionError(f"no call succeeded within {timeout} s after the database was back")

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(60)


def _timeline(results, outages) -> str:
    """Every call as `start+duration outcome status`, relative to the first, for a failure."""
    t0 = results[0][0]
    marks = [f"{k}: {b - t0:.2f}..{e - t0:.2f}" for k, b, e in outages]
    calls = [f"{s - t0:.2f}+{e - s:.2f} {o} {st} {c[-120:]!r}" if o != "ok" else
             f"{s - t0:.2f}+{e - s:.2f} ok" for s, e, o, st, c in results]
    return "\n".join(marks + calls)


def _health_during_outage(gw: GatewayProcess) -> tuple[float, httpx.Response]:
    started = time.monotonic()
    r = gw.admin.get("/healthz", timeout=10)
    return time.monotonic() - started, r


async def _ok_rows(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval("SELECT count(*) FROM calls WHERE status = 'ok'")
    finally:
        await conn.close()


def _open_pool_connections(gw: GatewayProcess) -> None:
    """CLIENTS key lookups at once, so the gateway's pool holds a connection for each client
    before the load: on a loaded machine, opening them under the 0.5 s timeouts is what would
    fail, and that is not what this test is about."""
    keys = [gw.new_rollout()["api_key"] for _ in range(CLIENTS)]
    threads = [
        threading.Thread(target=httpx.get, args=(gw.url + "/v1/models",),
                         kwargs={"headers": {"Authorization": f"Bearer {k}"}, "timeout": 10})
        for k in keys
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_calls_fail_fast_during_an_outage_and_recover_without_restart(
        cluster, vllm_server, tmp_path):
    # A frozen server costs a call up to one command timeout and one release (acquire)
    # timeout: half a second each keeps every failure within FAIL_FAST_S.
    gw = GatewayProcess([vllm_server.url], cluster.uri, "--db-acquire-timeout", "0.5",
                        "--db-command-timeout", "0.5", log_path=tmp_path / "gw.log").start()
    try:
        outages = []
        health = []
        _open_pool_connections(gw)
        with Load(gw, vllm_server.model) as load:
            time.sleep(6)  # past the engine's warm-up: a slow first call is not the point
            for kind in ("stopped", "frozen"):
                began = time.monotonic()
                if kind == "stopped":
                    cluster.stop()
                else:
                    cluster.signal_all(signal.SIGSTOP)
                time.sleep(1.5)
                health.append((kind, *_health_during_outage(gw)))
                time.sleep(2.5)
                if kind == "stopped":
                    cluster.start()
                else:
                    cluster.signal_all(signal.SIGCONT)
                back = time.monotonic()
                outages.append((kind, began, back))
                load.wait_for_ok_after(back, timeout=120)  # the engine may be slow, not us
                time.sleep(4)  # calls after the recovery, which must all succeed
        results = sorted(load.results)
        pid = gw.proc.pid
        assert gw.proc.poll() is None and gw.proc.pid == pid  # the same process throughout
    finally:
        gw.stop()

    for kind, seconds, r in health:
        assert seconds < FAIL_FAST_S, (kind, seconds)
        assert r.status_code == 503 and r.json()["database"].startswith("down"), (kind, r.text)

    timeline = tmp_path / "timeline.txt"
    timeline.write_text(_timeline(results, outages))
    # Each outage's window: from its start to the first call that succeeded after the database
    # was back (the gateway's own recovery), and the stretch after it until the next outage.
    windows = []
    for k, (kind, began, back) in enumerate(outages):
        first_ok = min(e for s, e, o, _, _ in results if o == "ok" and s >= back)
        until = outages[k + 1][1] if k + 1 < len(outages) else float("inf")
        windows.append((kind, began, first_ok, until))
    failures = [r for r in results if r[2] != "ok"]
    assert failures, "the outages were not noticed at all"
    for started, ended, outcome, status, content in failures:
        # Fast, and in the protocol's shape: a 503 before the stream, or the stream's own
        # error event after it started.
        assert outcome == "error", content[:300]
        # Measured from when the call could first notice: its start, or the outage's.
        noticed = max([started] + [b for _, b, _, _ in windows if b <= ended])
        assert ended - noticed < FAIL_FAST_S, (ended - noticed, f"timeline in {timeline}")
        assert status == 503 or (status == 200 and b'"error"' in content), content[:300]
        assert any(began - FAIL_FAST_S <= started <= first_ok
                   for _, began, first_ok, _ in windows), (started, windows, content[:300])
    for kind, _began, first_ok, until in windows:
        later = [r for r in results if first_ok <= r[0] and r[1] < until]
        assert later and all(r[2] == "ok" for r in later), (
            kind, [r[2:4] for r in later if r[2] != "ok"])
    acknowledged = sum(r[2] == "ok" for r in results)
    assert asyncio.run(_ok_rows(cluster.uri)) >= acknowledged > 0
