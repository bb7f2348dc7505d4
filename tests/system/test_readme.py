"""The README's "First run on a CPU" block, run exactly as written (in order, by bash, from a
directory laid out like the repository's top), on this machine's CPU: tiny model, vLLM,
gateway with its embedded Postgres, sandboxed rollouts, `rolltap inspect`, one bridge step with
a weight push, and `rolltap export` read back with `datasets`. Only the two ports are swapped
for free ones, so parallel sessions do not collide."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import datasets
import pytest

from stack.launcher import stop_embedded_postgres
from tests.support.gateway import REPO, free_port

SECTION = "## First run on a CPU, step by step"


def readme_block() -> str:
    text = (REPO / "README.md").read_text()
    after = text.split(SECTION, 1)[1]
    match = re.search(r"```sh\n(.*?)```", after, flags=re.S)
    assert match, "the README's first-run section lost its ```sh block"
    return match.group(1)


def test_readme_block_is_the_cpu_sequence():
    commands = [line.split()[1] for line in readme_block().splitlines()
                if line.startswith("rolltap ")]
    assert commands == ["tiny-model", "serve-model", "gateway", "rollouts", "inspect", "bridge",
                        "export"]


@pytest.fixture
def top_dir():
    """A directory laid out like the repository's top. Under the repository's runs/, not
    pytest's private tmp: as root, pgserver runs Postgres as its own unprivileged user, which
    must reach the data directory."""
    (REPO / "runs").mkdir(exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="readme-test-", dir=REPO / "runs"))
    path.chmod(0o755)
    (path / "examples").symlink_to(REPO / "examples")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow  # the README's whole CPU sequence: `make test-slow`, run by CI
def test_readme_cpu_commands_work_in_order(top_dir):
    tmp_path = top_dir
    vllm_port, gw_port = free_port(), free_port()
    script = readme_block().replace(":8000", f":{vllm_port}").replace(
        "--port 8000", f"--port {vllm_port}").replace(":9000", f":{gw_port}").replace(
        "--port 9000", f"--port {gw_port}")
    assert "8000" not in script and "9000" not in script
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("ROLLTAP_DATABASE_URL", None)
    log = tmp_path / "readme.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = proc.wait(timeout=1500)
        finally:
            # The block leaves vLLM and the gateway running in the background, as a user would.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            stop_embedded_postgres(tmp_path / "runs" / "first" / "pgdata")
    output = log.read_text(errors="replace")
    servers = "".join(f"\n--- {p.name} ---\n" + p.read_text(errors="replace")[-3000:]
                      for p in sorted((tmp_path / "runs").glob("*.log")))
    assert returncode == 0, output[-6000:] + servers
    assert "fizzbuzz" in output  # rolltap inspect list
    summary = json.loads((tmp_path / "runs" / "bridge" / "summary.json").read_text())
    assert summary["steps"] == 1, summary
    tokens = datasets.load_dataset("parquet", split="train", data_files={
        "train": str(tmp_path / "runs" / "export" / "tokens.parquet")})
    messages = datasets.load_dataset("parquet", split="train", data_files={
        "train": str(tmp_path / "runs" / "export" / "messages.parquet")})
    assert {r["task_id"] for r in tokens} == {"fizzbuzz"}
    # Every rollout with a trained sequence has its conversation (the scripted agent's calls
    # all offer a tool).
    assert {r["rollout_id"] for r in messages} == {r["rollout_id"] for r in tokens}
    assert all(r["messages"][-1]["role"] == "assistant" for r in messages)
