"""Gateway processes for tests: the real `rolltap gateway` command in a subprocess, so tests
can kill and restart it like any deployment would."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
ADMIN_KEY = "test-admin-key"

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GatewayProcess:
    """One `rolltap gateway` process and an admin client for it."""

    def __init__(self, upstreams: list[str], database_url: str | None, *extra: str,
                 log_path: Path | None = None, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # The admin key goes by environment, not argv, where any local process could read it.
        self.args = [sys.executable, "-m", "core.cli", "gateway", "--port", str(self.port),
                     *extra]
        for u in upstreams:
            self.args += ["--upstream", u]
        if database_url:
            self.args += ["--database-url", database_url]
        self.log_path = log_path or Path(tempfile.gettempdir()) / f"rolltap-gw-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self.unix_socket: Path | None = None
        self.admin = httpx.Client(base_url=self.url, timeout=60,
                                  headers={"Authorization": f"Bearer {ADMIN_KEY}"})

    def start(self, timeout: float = 60) -> GatewayProcess:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True,
                                     env={**os.environ, "ROLLTAP_ADMIN_KEY": ADMIN_KEY})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.kill()  # the caller gets no handle to stop it with
        raise RuntimeError(f"gateway not up in {timeout}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def kill(self) -> None:
        """SIGKILL: no shutdown hooks run, like a crash."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    # -- admin API helpers ------------------------------------------------------------------

    def new_rollout(self, **spec) -> dict:
        r = self.admin.post("/admin/rollouts", json=spec)
        assert r.status_code == 201, r.text
        return r.json()

    def finish(self, rollout_id: str, reward: float | None, **extra) -> httpx.Response:
        return self.admin.post(f"/admin/rollouts/{rollout_id}/finish",
                               json={"reward": reward, **extra})

    def calls(self, rollout_id: str) -> list[dict]:
        r = self.admin.get(f"/admin/rollouts/{rollout_id}/calls")
        assert r.status_code == 200, r.text
        return r.json()["calls"]
