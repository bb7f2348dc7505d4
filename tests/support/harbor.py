"""Harbor tests run where Harbor's own venv exists (`make install` makes it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.harbor.backend import harbor_python
from sandbox.state import StateFile
from tests.support.gateway import ADMIN_KEY

REPO = Path(__file__).resolve().parents[2]

needs_harbor = pytest.mark.skipif(
    not os.access(harbor_python(), os.X_OK),
    reason=f"Harbor's venv is missing ({harbor_python()}): `make install` (and so `make test`) "
           "makes it")


def rollouts(gateway, tmp_path: Path, tasks: Path, agent: str, *extra: str,
             rootfs: str = "host") -> tuple[str, dict[str, dict], Path]:
    """Runs the CLI as a user would; returns its output, each task's rollout state at the
    gateway (one rollout per task), and the trials directory. The example tasks' Dockerfiles
    are FROM debian:bookworm-slim, which no registry here provides: on the bwrap environment
    they run on the host's system directories unless `rootfs="image"`."""
    state, trials = tmp_path / f"{agent}.jsonl", tmp_path / f"trials-{agent}"
    if "--environment" not in extra:
        extra = (*extra, "--environment-kwarg", f"rootfs={rootfs}")
    if "--model" not in extra:  # the runner's preflight wants a model the engine serves
        extra = (*extra, "--model", gateway.admin.get("/admin/models").json()["models"][0])
    argv = [sys.executable, "-m", "sandbox.cli", str(tasks), "--harness", f"harbor:{agent}",
            "--group-size", "1", "--concurrency", "4", "--gateway", gateway.url,
            "--state", str(state), "--trials-dir", str(trials), *extra]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "ROLLTAP_ADMIN_KEY": ADMIN_KEY})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    records = StateFile(str(state)).load()[1].values()
    states = {r.task_id: gateway.admin.get(f"/admin/rollouts/{r.rollout_id}").json()
              for r in records}
    assert len(states) == len(records), "one rollout per task"
    return out, states, trials
