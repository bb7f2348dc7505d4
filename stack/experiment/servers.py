"""The servers one part of the experiment runs on: vLLM serving the base model fresh (every
part starts from the same weights), and for training parts the gateway with its embedded
Postgres. Stopped when the part ends, whatever way it ends."""

from __future__ import annotations

import secrets
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from stack.launcher import (
    Processes,
    admin_client,
    free_port,
    serve_model,
    start_gateway,
    stop_embedded_postgres,
)

MODEL_NAME = "smol"


@dataclass
class Servers:
    """`with Servers(...) as s:` vLLM (and the gateway if `gateway`) for one part in `workdir`."""

    workdir: Path
    model_dir: Path
    temperature: float
    gateway: bool = False
    procs: Processes = field(default_factory=Processes)
    admin_key: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    upstream: str = ""
    gateway_url: str = ""
    startup_s: float = 0.0
    admin: Any = None
    servers: list[subprocess.Popen] = field(default_factory=list)

    def __enter__(self) -> Servers:
        started = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.upstream = f"http://127.0.0.1:{port}"
        self.servers.append(serve_model(
            self.procs, self.workdir / "vllm.log", self.model_dir, port, MODEL_NAME,
            ("--max-model-len", "4096", "--kv-cache-gib", "1"), timeout=1800))
        if self.gateway:
            gw_port = free_port()
            self.gateway_url = f"http://127.0.0.1:{gw_port}"
            # The agent's calls carry no tools: --train-auxiliary makes them trained rollouts.
            self.servers.append(start_gateway(
                self.procs, self.workdir, self.upstream, gw_port, self.admin_key,
                ("--temperature", str(self.temperature), "--train-auxiliary"), timeout=600))
            self.admin = admin_client(self.gateway_url, self.admin_key)
        self.startup_s = round(time.monotonic() - started, 1)
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.procs.stop_all()
        stop_embedded_postgres(self.workdir / "data" / "pgdata")

    def alive(self) -> None:
        """Raise if a server died (on a machine short of memory the kernel may kill one)."""
        for proc in self.servers:
            if proc.poll() is not None:
                raise SystemExit(f"a server of this part exited (code {proc.returncode}); see "
                                 f"the logs in {self.workdir}")
