"""The bwrap Harbor environment's host command lines and what they are made from: pure
functions of their inputs (environment.py runs them)."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from sandbox.confine import (
    GATEWAY_SOCKET,
    HOST_ROOT,
    RUN_DIR,
    STAGED_ROOT,
    SYSTEM_DIRS,
    host_system,
    ro_binds,
)

PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def exec_argv(pid: int, command: str, cwd: str, env: dict[str, str],
              path: str = PATH, uid: int | None = None) -> list[str]:
    """The host command line that runs `command` (bash) inside the sandbox whose init is
    `pid`, in `cwd`, with exactly `env` (plus PATH and HOME unless given): as the sandbox's
    root, or with `uid` as that host uid in every namespace of `pid` but its user namespace
    (the verifier, in its view's holder). Pure."""
    full = {"PATH": path, "HOME": "/root", **env}
    enter = (["--all"] if uid is None else
             ["--mount", "--uts", "--ipc", "--net", "--pid", "--cgroup", f"--setuid={uid}",
              f"--setgid={uid}"])
    return ["nsenter", f"--target={pid}", *enter, "--root", "--",
            "env", "-i", *(f"{k}={v}" for k, v in full.items()),
            "bash", "-c", 'cd -- "$0" && eval "$1"', cwd, command]


def bind_parents(paths: tuple[str, ...]) -> list[str]:
    """The directories above each bound path, but `/`. Pure."""
    return sorted({str(p) for path in paths for p in PurePosixPath(path).parents} - {"/"})


def system_layout(root: str) -> dict[str, str | None]:
    """The system directories (confine.SYSTEM_DIRS) of a root filesystem on the host (the
    host's `/` or an image's unpacked root): name -> link target, or None for a directory.
    The verifier's view takes them from here, not from the sandbox the agent could change."""
    layout: dict[str, str | None] = {}
    for name in SYSTEM_DIRS:
        path = os.path.join(root, name)
        if os.path.islink(path):
            layout[name] = os.readlink(path)
        elif os.path.isdir(path):
            layout[name] = None
    return layout


def image_source(docker_image: str | None, environment_dir: Path) -> tuple[str | None, str | None]:
    """(reference, Dockerfile directory) of a task's image, as Harbor's docker backend takes
    it: a prebuilt `docker_image` first, else `environment/Dockerfile`; (None, None) without
    either."""
    if docker_image:
        return docker_image, None
    if (environment_dir / "Dockerfile").is_file():
        return None, str(environment_dir)
    return None, None


def sandbox_argv(bwrap: str, disk_mb: int, socket: str | None, info_fd: int,
                 read_only: tuple[str, ...] = (),
                 staged: dict[str, str] | None = None) -> list[str]:
    """The long-lived sandbox: bwrap's init as PID 1 and `sleep infinity` to keep it, after a
    line on stdout that says its filesystem is in place (bwrap reports the PID on `info_fd`
    before it has built the root). With `staged` (where the root stage put each host source),
    `/` is the stage's image overlay and the host's system directories are under HOST_ROOT.
    Pure."""

    def src(path: str) -> str:
        return staged[path] if staged is not None else path

    args = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--uid", "0", "--gid", "0", "--hostname", "sandbox"]
    args += (["--size", str(disk_mb << 20), "--tmpfs", "/", *host_system()] if staged is None
             else ["--bind", STAGED_ROOT, "/", "--tmpfs", RUN_DIR, *host_system(HOST_ROOT)])
    args += ["--proc", "/proc", "--dev", "/dev", "--dir", "/tmp", "--dir", "/root",
             "--info-fd", str(info_fd)]
    for bind in ro_binds(read_only):
        args += ["--ro-bind", src(bind.source), bind.dest]
    if socket is not None:
        args += ["--ro-bind", src(socket), GATEWAY_SOCKET]
    if staged is not None:
        args += ["--remount-ro", RUN_DIR]
    return [*args, "--", "sh", "-c", "echo ready && exec sleep infinity"]
