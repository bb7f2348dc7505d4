"""What the whole-stack launchers share: their child processes, each server started and waited
for, and the embedded Postgres stopped at the end."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from stack.serve_model import die_with_parent

# The `rolltap` command of this interpreter, so children run the same environment.
ROLLTAP = [sys.executable, "-m", "core.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def step(text: str) -> None:
    print(f"\n== {text}", flush=True)


def wait_http(url: str, proc: subprocess.Popen, log: Path, what: str, timeout: float) -> None:
    import httpx

    started = time.monotonic()
    last = 0.0
    while time.monotonic() - started < timeout:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise SystemExit(f"{what} exited with code {proc.returncode}; log {log}:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                print(f"   {what} ready after {time.monotonic() - started:.0f} s", flush=True)
                return
        if time.monotonic() - last > 10:
            last = time.monotonic()
            print(f"   waiting for {what} ({time.monotonic() - started:.0f} s) …", flush=True)
        time.sleep(0.5)
    raise SystemExit(f"{what} not ready after {timeout:.0f} s; see {log}")


class Processes:
    """Child processes of a launcher, each in its own process group (a Ctrl-C in the terminal
    reaches the launcher, which stops them in its own time), each sent SIGTERM by the kernel
    when the launcher dies, even by SIGKILL (`die_with_parent`): nothing of it outlives it."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen] = []

    def start(self, args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
        # Secrets go by environment, never argv, where any local process could read them.
        proc = subprocess.Popen(args, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=die_with_parent(),
                                env={**os.environ, **(env or {})})
        self._procs.append(proc)
        return proc

    def stop_all(self, grace_s: float = 20.0) -> None:
        """SIGTERM to every group at once, SIGKILL to what is left after `grace_s`: all
        together, so the whole stop fits into the few seconds a parent's timeout allows."""
        running = [proc for proc in self._procs if proc.poll() is None]
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(deadline - time.monotonic(), 0))
        for proc in self._procs:
            # The group too: what a server started (vLLM's engine core) may outlive it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_once(args: list[str], env: dict | None = None, check: bool = True) -> int:
    """A child that runs to its end in the foreground (its output on the terminal)."""
    return subprocess.run(args, check=check, env={**os.environ, **(env or {})},
                          preexec_fn=die_with_parent()).returncode


def serve_model(procs: Processes, log: Path, model_dir: Path, port: int, name: str,
                extra: tuple[str, ...] = (), timeout: float = 600) -> subprocess.Popen:
    """`rolltap serve-model` (vLLM) on `port`, waited for."""
    proc = procs.start([*ROLLTAP, "serve-model", str(model_dir), "--port", str(port),
                        "--served-model-name", name, *extra], log)
    wait_http(f"http://127.0.0.1:{port}/health", proc, log, "vLLM", timeout)
    return proc


def start_gateway(procs: Processes, workdir: Path, upstream: str, port: int, admin_key: str,
                  extra: tuple[str, ...] = (), timeout: float = 180) -> subprocess.Popen:
    """`rolltap gateway` on `port` with its embedded Postgres in WORKDIR/data, waited for.
    The launcher stops that Postgres at its end (`stop_embedded_postgres`)."""
    log = workdir / "gateway.log"
    proc = procs.start([*ROLLTAP, "gateway", "--upstream", upstream, "--port", str(port),
                        "--data-dir", str(workdir / "data"), *extra],
                       log, env={"ROLLTAP_ADMIN_KEY": admin_key})
    wait_http(f"http://127.0.0.1:{port}/healthz", proc, log, "gateway", timeout)
    return proc


def admin_client(gateway: str, admin_key: str):
    import httpx

    return httpx.Client(base_url=gateway, timeout=60,
                        headers={"Authorization": f"Bearer {admin_key}"})


def stop_embedded_postgres(pgdata: Path, timeout: float = 30.0) -> None:
    """Stop the embedded Postgres in `pgdata`, which the gateway leaves running on purpose (a
    restart reuses it). Signalled directly: pgserver's own cleanup stops a server only when its
    last registered handle goes, and the gateway's handle stays registered."""
    pid_file = pgdata / "postmaster.pid"
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text().split("\n", 1)[0])
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGINT)  # Postgres's fast shutdown
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            os.kill(pid, 0)
            time.sleep(0.1)
