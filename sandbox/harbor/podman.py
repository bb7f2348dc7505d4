"""What Harbor's podman environment needs on these machines, for the bench and the opt-in test.

podman runs here only with runc, lowered default ulimits (containers.conf, pointed to by
CONTAINERS_CONF, never written into /etc), podman-compose >= 1.6 in Harbor's venv (Debian's
1.0.3 lacks `--in-pod`) and base images in local storage, as no image registry is reachable.
`make bench-deps` installs the Debian packages; `make install` pins podman-compose.
"""

from __future__ import annotations

import os
import shutil
import subprocess

CONTAINERS_CONF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "containers.conf")
# examples/harbor's Dockerfiles start FROM it; rolltap's own base image (a minbase Debian
# bookworm from mmdebstrap) stands in under its name.
SLIM = "docker.io/library/debian:bookworm-slim"
INSTALL = "run `make bench-deps` (as root) and `make install`"


def env() -> dict[str, str]:
    return {"CONTAINERS_CONF": CONTAINERS_CONF}


def missing(harbor_python: str | None = None) -> str | None:
    """Why podman cannot run here, or None. With `harbor_python`, also what Harbor's podman
    environment needs beside podman: podman-compose in that venv."""
    for tool in ("podman", "runc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed: {INSTALL}"
    if harbor_python is not None:
        compose = os.path.join(os.path.dirname(harbor_python), "podman-compose")
        if not os.access(compose, os.X_OK):
            return f"no podman-compose in Harbor's venv ({compose}): {INSTALL}"
    return None


def stand_in_slim(base: str) -> None:
    """Tags the local image `base` as debian:bookworm-slim unless that name exists already."""
    exists = subprocess.run(["podman", "image", "exists", SLIM], env={**os.environ, **env()})
    if exists.returncode != 0:
        subprocess.run(["podman", "tag", base, SLIM], env={**os.environ, **env()}, check=True,
                       capture_output=True)
