"""A Postgres cluster of a test's own, to stop, start, freeze and thaw (never the machine's shared
server): for tests of a database outage or stall."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.gateway import free_port

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
