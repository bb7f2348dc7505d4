"""A Ray cluster of several nodes on this machine: a head and workers, each a `ray start --block`
process group of its own with its own custom resources, so a test can force placement on every
node and kill one node (its whole process group) mid-run.

Kept small for a shared 2-core machine: one CPU and an 80 MB object store per node, no
dashboard, free ports only, a temp dir of its own; the head declares a killed node dead in
~5 s instead of Ray's default ~30 s, yet gives a live node that is slow to answer (a loaded
machine) 5 s per probe."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.support.processes import alive_with, ancestors

OBJECT_STORE_BYTES = 80 * 1024 * 1024  # Ray's floor is 75 MB
# The GCS probes each raylet every second, dead after 5 failed probes. A killed raylet fails
# each probe at once; a short answer limit can declare a live node dead on a loaded machine.
FAST_DEATH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "5000",
              "RAY_health_check_failure_threshold": "5", "RAY_health_check_initial_delay_ms": "0"}
LOG_TAIL_BYTES = 3000

# A cluster on loopback, for one test: no token authentication. Left unset, Ray turns it on
# when ~/.ray/auth_token exists (any local `ray.init()` writes one), and a driver whose Ray
# has already read its settings cannot be given the token any more.
NO_TOKEN = {"RAY_AUTH_MODE": "disabled"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 1).close()
    except OSError:
        return False
    return True


class RayNode:
    def __init__(self, name: str, proc: subprocess.Popen) -> None:
        self.name, self.proc = name, proc

    def runs(self, pid: int) -> bool:
        """Whether process `pid` descends from this node (its raylet, a worker, a sandbox)."""
        return self.proc.pid in ancestors(pid)

    def kill(self) -> None:
        """The node dies at once, as a machine would: SIGKILL to its whole process group."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)


class RayCluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.gcs_port = _free_port()
        self.address = f"127.0.0.1:{self.gcs_port}"
        self.nodes: list[RayNode] = []

    def _start(self, name: str, resources: dict[str, float], *extra: str) -> RayNode:
        ports = {flag: _free_port() for flag in (
            "node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port")}
        # This interpreter, not a `ray` script on PATH: the nodes' workers import this checkout.
        args = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
                "--node-ip-address=127.0.0.1", "--num-cpus=1",
                f"--object-store-memory={OBJECT_STORE_BYTES}", "--disable-usage-stats",
                f"--resources={json.dumps(resources)}",
                *(f"--{flag}={port}" for flag, port in ports.items()), *extra]
        with open(self.root / f"{name}.log", "wb") as log:  # the child keeps its own copy
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True,
                                    env={**os.environ, **FAST_DEATH, **NO_TOKEN})
        node = RayNode(name, proc)
        self.nodes.append(node)
        return node

    def start(self, head: dict[str, float], workers: list[dict[str, float]],
              timeout_s: float = 180) -> RayCluster:
        self._start("head", head, "--head", f"--port={self.gcs_port}",
                    "--include-dashboard=false", f"--temp-dir={self.root / 'ray'}",
                    f"--ray-client-server-port={_free_port()}")
        deadline = time.monotonic() + timeout_s
        while not _listening(self.gcs_port):
            if time.monotonic() > deadline or self.nodes[0].proc.poll() is not None:
                logs = self.logs()
                self.stop()
                raise RuntimeError(f"the Ray head did not start:\n{logs}")
            time.sleep(0.2)
        for k, resources in enumerate(workers):
            self._start(f"worker{k}", resources, f"--address={self.address}")
        return self

    def logs(self) -> str:
        """The end of each node's log, for a failure message (the temp dir is gone after CI)."""
        tails = []
        for node in self.nodes:
            text = (self.root / f"{node.name}.log").read_bytes()[-LOG_TAIL_BYTES:]
            tails.append(f"--- {node.name} (exit {node.proc.poll()}) ---\n"
                         + text.decode(errors="replace"))
        return "\n".join(tails)

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.kill()
        # Ray's workers run in sessions of their own and end only once they notice their raylet
        # is gone: end those of this cluster (their command lines name its temp dir) now.
        for pid in alive_with(str(self.root)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
