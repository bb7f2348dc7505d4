"""Real harness CLIs from npm for tests: an idempotent installer of pinned versions into the
repository's `.cache/npm/`, and a runner that starts one headless and offline.

The install is shared by every test session (and `make test` on a fresh machine): one
`package.json` pinning every harness, installed under a file lock, redone only when an
installed version differs from its pin. A run gets a fresh sandbox tree (HOME, XDG dirs, an
empty workdir), the harness's config from its sandbox preset, an npm registry address where
nothing listens, and telemetry and update checks off, so nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from sandbox.harnesses import (
    HARNESS_PACKAGES,
    NPM_PREFIX,
    ensure_harnesses,
    harness_bin_dir,
    installed_versions,
)
from sandbox.layout import (
    SandboxDirs,
    base_env,
    make_area,
    make_root,
    sandbox_path,
    write_files,
)
from sandbox.presets import NPM_EXECUTABLES, Harness, LaunchContext, build_launch

__all__ = [
    "HARNESS_PACKAGES",
    "NPM_PREFIX",
    "HarnessRun",
    "ensure_harnesses",
    "harness_bin_dir",
    "installed_versions",
    "require_harnesses",
    "run_harness",
]

REPO = Path(__file__).resolve().parents[2]

def require_harnesses() -> Path:
    """The bin directory of the pinned harness CLIs, installed on first use; skips the calling
    test where Node.js and npm are missing (nothing else is a reason to skip)."""
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip("node/npm is not installed: the real harness CLIs cannot be installed")
    return ensure_harnesses()


@dataclass(frozen=True)
class HarnessRun:
    argv: list[str]
    returncode: int | None  # None: killed at the timeout
    stdout: str
    stderr: str
    seconds: float
    dirs: SandboxDirs

    def describe(self) -> str:
        """For assertion messages: how the run ended and the tail of what it printed."""
        return (
            f"exit {self.returncode} after {self.seconds:.1f} s\n--- stdout\n"
            f"{self.stdout[-2500:]}\n--- stderr\n{self.stderr[-2500:]}"
        )


def run_harness(
    bin_dir: Path,
    harness: Harness,
    prompt: str,
    rollout: dict,
    parent: Path,
    timeout_s: float,
) -> HarnessRun:
    """One headless run of `harness` against the gateway `rollout` (the admin API's answer to
    creating a rollout), in a fresh sandbox tree under `parent`. A run past `timeout_s` is
    killed with its whole process group."""
    exe = bin_dir / NPM_EXECUTABLES[harness.preset]
    harness = msgspec.structs.replace(harness, executable=str(exe))
    dirs, _ = make_area(make_root(str(parent), harness.preset), "agent", None)
    launch = build_launch(
        harness,
        LaunchContext(
            prompt=prompt,
            api_key=rollout["api_key"],
            openai_base_url=rollout["openai_base_url"],
            anthropic_base_url=rollout["anthropic_base_url"],
            workdir=dirs.work,
            home=dirs.home,
        ),
    )
    write_files(dirs.home, launch.files)
    env = base_env(dirs, os.pathsep.join([str(bin_dir), sandbox_path()]))
    env |= launch.env
    started = time.monotonic()
    proc = subprocess.Popen(
        launch.argv,
        cwd=dirs.work,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        code = None
    return HarnessRun(launch.argv, code, stdout, stderr, time.monotonic() - started, dirs)
